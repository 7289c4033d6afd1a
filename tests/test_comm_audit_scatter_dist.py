"""Covers: dtensor/rules/scatter.py (scatter, scatter_add, select_scatter,
slice_scatter, index_put/index_put_, index_add, index_copy, index_fill) on a
2-rank Gloo world.

- the cases of the communication audit (bench/comm_audit.py) where these ops
  fell back to replicating everything, run with both runtimes as the audit
  counts them (the op plus making its result a full tensor): ours must send
  no more wire bytes (for equal bytes, no more collectives) than PyTorch's
  and equal the single-device value;
- every op on every combination of Replicate, Shard of each dim and the
  Partial kinds (sum, avg, max, min) of its operands equals single device:
  which pieces may pass an overwrite or an add is what these rules decide,
  and a wrong pass gives wrong values (a replicated written value counted
  once per rank, a max of sums).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_comm_audit_fixes_dist import _check_no_more_than_torch, _libs, _pieces

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _index(values, n: int = 2) -> list[torch.Tensor]:
    return [torch.tensor(values)] * n


def _scatter_case():
    g = torch.Generator().manual_seed(70)
    index = torch.randint(0, 10, (5, 5), generator=g)
    return _pieces((10, 5), 71), [index, index], _pieces((5, 5), 72)


# audit cases ------------------------------------------------------------------------
@pytest.mark.world_size(2)
@pytest.mark.parametrize("op", ["scatter", "scatter_add"])
@pytest.mark.parametrize("layouts", [("S1", "S1", "S1"), ("S0", "S1", "S1"),
                                     ("S1", "S0", "S1"), ("S1", "S1", "S0"),
                                     ("Psum", "R", "Psum"), ("R", "R", "Psum")])
def test_scatter_keeps_shards_off_the_scattered_dim_and_pieces(world, op, layouts) -> None:
    x, index, src = _scatter_case()
    fn = getattr(torch, op)
    _check_no_more_than_torch(world, lambda a, i, s: fn(a, 0, i, s),
                              [(layouts[0], x), (layouts[1], index), (layouts[2], src)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("op", ["scatter", "scatter_add"])
@pytest.mark.parametrize("kind", ["Psum", "Pmax"])
def test_scatter_of_pieces_everywhere(world, op, kind) -> None:
    # the index's pieces are reduced; pieces that cannot pass go onto a shard
    x, index, src = _scatter_case()
    index = [index[0] - 1, torch.ones_like(index[0])] if kind == "Psum" else index
    fn = getattr(torch, op)
    _check_no_more_than_torch(world, lambda a, i, s: fn(a, 0, i, s),
                              [(kind, x), (kind, index), (kind, src)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("layouts", "dim"), [(("S0", "S0"), 1), (("S2", "S1"), 1),
                                              (("S1", "S1"), -1), (("Pmax", "R"), 1)])
def test_select_scatter_keeps_the_other_dims_shards(world, layouts, dim) -> None:
    x, src = _pieces((5, 5, 5), 73), _pieces((5, 5), 74)
    _check_no_more_than_torch(world, lambda a, s: torch.select_scatter(a, s, dim, 2),
                              [(layouts[0], x), (layouts[1], src)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("S1", "S1"), ("S2", "S2"), ("R", "S1"), ("S0", "S2"),
                                     ("Psum", "Psum")])
def test_slice_scatter_keeps_the_other_dims_shards(world, layouts) -> None:
    # a shard of the (smaller) source alone is gathered, not followed: the
    # output would be the larger tensor to gather
    x, src = _pieces((20, 20, 20), 75), _pieces((10, 20, 20), 76)
    _check_no_more_than_torch(world, lambda a, s: torch.slice_scatter(a, s, 0, 10, 20),
                              [(layouts[0], x), (layouts[1], src)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("S1", "R", "S1"), ("S1", "S0", "S1"), ("S1", "S0", "S0"),
                                     ("Psum", "R", "Psum"), ("Pmax", "R", "R")])
@pytest.mark.parametrize("accumulate", [False, True])
def test_index_put_keeps_the_unindexed_dims_shards(world, layouts, accumulate) -> None:
    x, values = _pieces((5, 5), 77), _pieces((2, 5), 78)
    _check_no_more_than_torch(
        world, lambda a, i, v: torch.index_put(a, (i,), v, accumulate=accumulate),
        [(layouts[0], x), (layouts[1], _index([2, 0])), (layouts[2], values)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("op", ["index_add", "index_copy", "index_fill"])
@pytest.mark.parametrize("layout", ["S1", "Psum", "Pmax"])
def test_index_ops_keep_shards_and_pieces(world, op, layout) -> None:
    x, index = _pieces((6, 4), 79), _index([4, 1, 3])
    value = _pieces(() if op == "index_fill" else (3, 4), 80)
    fn = getattr(torch, op)
    ilay, vlay = "R", layout
    if layout == "Psum":  # the index's pieces are reduced, as the audit has them
        ilay, index = "Psum", [index[0] - 1, torch.ones_like(index[0])]
    if layout == "S1" and op == "index_fill":
        vlay = "R"  # a 0-d fill value
    _check_no_more_than_torch(world, lambda a, i, v: fn(a, 0, i, v),
                              [(layout, x), (ilay, index), (vlay, value)])


# every layout -----------------------------------------------------------------------
def _setitem(a, i, v):
    out = a.clone()
    out[i] = v
    return out


def _g(seed):
    return torch.Generator().manual_seed(seed)


# (name, fn, operands: (global tensor, may be Partial))
_SWEEP = {
    "scatter": (lambda a, i, s: torch.scatter(a, 0, i, s),
                [(torch.randn(6, 4, generator=_g(1)), True),
                 (torch.randint(0, 6, (3, 4), generator=_g(2)), False),
                 (torch.randn(4, 4, generator=_g(3)), True)]),
    "scatter_narrow_index": (lambda a, i, s: torch.scatter(a, 0, i, s),
                             [(torch.randn(6, 4, generator=_g(30)), True),
                              (torch.randint(0, 6, (3, 2), generator=_g(31)), False),
                              (torch.randn(4, 3, generator=_g(32)), True)]),
    "scatter_value": (lambda a, i: torch.scatter(a, 1, i, 2.5),
                      [(torch.randn(4, 6, generator=_g(4)), True),
                       (torch.randint(0, 6, (4, 3), generator=_g(5)), False)]),
    "scatter_add": (lambda a, i, s: torch.scatter_add(a, 1, i, s),
                    [(torch.randn(4, 6, generator=_g(6)), True),
                     (torch.randint(0, 6, (4, 3), generator=_g(7)), False),
                     (torch.randn(4, 5, generator=_g(8)), True)]),
    "select_scatter": (lambda a, s: torch.select_scatter(a, s, 1, 2),
                       [(torch.randn(4, 3, 6, generator=_g(9)), True),
                        (torch.randn(4, 6, generator=_g(10)), True)]),
    "slice_scatter": (lambda a, s: torch.slice_scatter(a, s, 1, 1, 5, 2),
                      [(torch.randn(4, 6, generator=_g(11)), True),
                       (torch.randn(4, 2, generator=_g(12)), True)]),
    "index_put": (lambda a, i, v: torch.index_put(a, (i,), v),
                  [(torch.randn(6, 4, generator=_g(13)), True),
                   (torch.tensor([4, 0, 2]), False),
                   (torch.randn(3, 4, generator=_g(14)), True)]),
    "index_put_middle": (lambda a, i, v: torch.ops.aten.index_put(a, [None, i], v),
                         [(torch.randn(4, 6, 2, generator=_g(15)), True),
                          (torch.tensor([5, 1]), False),
                          (torch.randn(2, 2, generator=_g(16)), True)]),
    "index_put_accumulate": (lambda a, i, v: torch.index_put(a, (i,), v, accumulate=True),
                             [(torch.randn(6, 4, generator=_g(17)), True),
                              (torch.tensor([4, 0, 4]), False),
                              (torch.randn(3, 4, generator=_g(18)), True)]),
    "index_put_mask": (lambda a, m, v: torch.index_put(a, (m,), v),
                       [(torch.randn(6, 4, generator=_g(19)), True),
                        (torch.tensor([True, False, False, True, True, False]), False),
                        (torch.randn(4, generator=_g(20)), True)]),
    "setitem": (_setitem,
                [(torch.randn(6, 4, generator=_g(21)), True),
                 (torch.tensor([3, 1]), False),
                 (torch.randn(2, 4, generator=_g(22)), True)]),
    "index_add": (lambda a, i, s: torch.index_add(a, 0, i, s, alpha=2),
                  [(torch.randn(6, 4, generator=_g(23)), True),
                   (torch.tensor([5, 0, 5]), False),
                   (torch.randn(3, 4, generator=_g(24)), True)]),
    "index_copy": (lambda a, i, s: torch.index_copy(a, 1, i, s),
                   [(torch.randn(4, 6, generator=_g(25)), True),
                    (torch.tensor([3, 0, 5]), False),
                    (torch.randn(4, 3, generator=_g(26)), True)]),
    "index_fill": (lambda a, i: torch.index_fill(a, 1, i, -1.5),
                   [(torch.randn(4, 6, generator=_g(27)), True),
                    (torch.tensor([2, 5]), False)]),
    "index_fill_tensor": (lambda a, i, v: torch.index_fill(a, 1, i, v),
                          [(torch.randn(4, 6, generator=_g(28)), True),
                           (torch.tensor([2, 5]), False),
                           (torch.randn((), generator=_g(29)), True)]),
}


def _layouts(t: torch.Tensor, partial: bool) -> list[str]:
    out = ["R", *(f"S{d}" for d in range(t.ndim))]
    if partial:
        out += ["Psum", "Pavg", "Pmax", "Pmin"]
    elif t.dtype != torch.bool:
        out += ["Psum"]
    return out


def _make(lib, mesh, layout: str, t: torch.Tensor, rank: int):
    """``t`` as a DTensor of ``layout``. Partial pieces differ per rank, and
    which rank holds an element's max (min) varies with the element and
    with the operand: pieces that pass an op only when every extreme sits
    on one rank would show."""
    if layout.startswith("P"):
        off = torch.full_like(t, 0.5) if t.is_floating_point() else torch.ones_like(t)
        mine = torch.rand(t.shape, generator=_g(t.numel() + 7 * t.ndim)) < 0.5
        mine = mine if rank == 0 else ~mine
        piece = {"Psum": (t - off, off), "Pavg": (t - off, t + off)}[layout][rank] if (
            layout in ("Psum", "Pavg")) else torch.where(
            mine, t, t - off if layout == "Pmax" else t + off)
        return lib.DTensor.from_local(piece, mesh, [lib.Partial(layout[1:])], run_check=False)
    p = lib.Replicate() if layout == "R" else lib.Shard(int(layout[1:]))
    return lib.distribute_tensor(t.clone(), mesh, [p])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("name", sorted(_SWEEP))
def test_every_layout_equals_single_device(world, name) -> None:
    lib, mesh = _libs(world)["ours"]
    fn, operands = _SWEEP[name]
    want = fn(*[t.clone() for t, _ in operands])
    for layouts in itertools.product(*[_layouts(t, p) for t, p in operands]):
        args = [_make(lib, mesh, lay, t, world.rank)
                for lay, (t, _) in zip(layouts, operands, strict=True)]
        got = fn(*args).full_tensor()
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, la=layouts: f"{la}: {m}")
