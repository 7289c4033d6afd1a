"""Covers: cases of the communication audit (bench/comm_audit.py) where ours
sent more than PyTorch's DTensor, each run here with both runtimes on a
2-rank Gloo world and counted by the same dispatch mode
(``bench/_comm_bytes.py``): the op plus making its result a full tensor.
Ours must send no more wire bytes (and, for equal bytes, no more
collectives) than PyTorch's and equal the single-device value:

- ``rsub`` of partial sums stays partial (dtensor/rules/pointwise.py);
- a widening cast of partial sums reduces before it (rules/tensor_ops.py);
- pooling reduces partial inputs onto a batch shard (rules/batched.py);
- a pointwise op's output takes the operand shard that leaves the fewest
  bytes to move (rules/pointwise.py);
- ``take`` keeps an index's shards; ``take``/``gather``/``index_select``
  keep max/min pieces (rules/join.py); ``narrow_copy`` keeps the shards of
  the dims it leaves alone (rules/view.py);
- ``max()`` of ``Partial("max")`` pieces and ``clamp_min``/``clamp_max``
  of pieces of their extreme stay pieces (rules/extremes.py, pointwise.py);
- ``norm(dim=)`` (pairwise distance, triplet losses) keeps shards, and
  ``dist`` of a replicated and a sharded operand cuts the replicated one
  (rules/norms.py).

And one accepted difference (``comm_audit.ACCEPTED``): PyTorch's integer
cast of ``Partial("max")`` pieces sends less but returns a wrong value.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _libs(world):
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    import dtensor

    return {"ours": (dtensor, dtensor.DeviceMesh("cpu", [0, 1])),
            "torch": (tdt, TorchMesh.from_group(world.group, "cpu"))}


def _make(lib, mesh, layout: str, pieces: list[torch.Tensor], rank: int):
    """A DTensor of ``lib`` whose global value is ``pieces`` combined by
    ``layout``: "R"/"S<d>" (pieces[0] distributed), "P<kind>" (rank r's piece)."""
    if layout.startswith("P"):
        return lib.DTensor.from_local(pieces[rank].clone(), mesh, [lib.Partial(layout[1:])],
                                      run_check=False)
    p = lib.Replicate() if layout == "R" else lib.Shard(int(layout[1:]))
    return lib.distribute_tensor(pieces[0].clone(), mesh, [p])


def _global(layout: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    if layout == "Psum":
        return pieces[0] + pieces[1]
    if layout == "Pavg":
        return (pieces[0] + pieces[1]) / 2
    if layout in ("Pmax", "Pmin"):
        return (torch.maximum if layout == "Pmax" else torch.minimum)(*pieces)
    return pieces[0]


def _run(world, fn, inputs):
    """{lib: (collectives, wire bytes, full value)} of ``fn`` on ``inputs``
    (pairs of layout and pieces), and the single-device value."""
    from _comm_bytes import CommBytes

    got = {}
    for name, (lib, mesh) in _libs(world).items():
        args = [_make(lib, mesh, lay, ps, world.rank) for lay, ps in inputs]
        with CommBytes() as cb:
            out = fn(*args)
            full = out.full_tensor()
        got[name] = (len(cb.records), cb.wire, full)
    want = fn(*[_global(lay, ps) for lay, ps in inputs])
    return got, want


def _check_no_more_than_torch(world, fn, inputs) -> None:
    got, want = _run(world, fn, inputs)
    (oc, ow, ov), (tc, tw, _) = got["ours"], got["torch"]
    torch.testing.assert_close(ov, want, **TOL)
    assert ow < tw + 1e-6, f"ours {oc} collectives / {ow:.0f} B, torch {tc} / {tw:.0f} B"
    assert ow < tw - 1e-6 or oc <= tc, f"ours {oc} collectives, torch {tc} ({ow:.0f} B)"


def _pieces(shape, seed: int, n: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


@pytest.mark.world_size(2)
def test_rsub_of_partial_sums_stays_partial(world) -> None:
    a, b = _pieces((3, 4), 1), _pieces((3, 4), 2)
    _check_no_more_than_torch(world, lambda x, y: torch.rsub(x, y, alpha=2),
                              [("Psum", a), ("Psum", b)])


@pytest.mark.world_size(2)
def test_cov_reduces_the_sum_of_average_weights_once(world) -> None:
    # cov reads its weights' sum four times; pieces kept by the sum would be
    # reduced by each of those reads
    x, w = _pieces((3, 2), 5, 1), [p.abs() + 0.5 for p in _pieces((2,), 6)]
    _check_no_more_than_torch(world, lambda a, b: torch.cov(a, correction=0, aweights=b),
                              [("R", x), ("Pavg", w)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.float64])
def test_widening_cast_of_partial_sums_reduces_first(world, dtype) -> None:
    _check_no_more_than_torch(world, lambda x: x.to(dtype), [("Psum", _pieces((3, 4), 3))])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["Psum", "Pmax"])
@pytest.mark.parametrize("pool", [
    lambda x: F.max_pool2d(x, 2), lambda x: F.max_pool3d(x.unsqueeze(2), (1, 2, 2)),
    lambda x: F.adaptive_avg_pool2d(x, 2), lambda x: F.avg_pool2d(x, 3),
    lambda x: F.adaptive_avg_pool3d(x.unsqueeze(2), (1, 2, 2)),
], ids=["max2d", "max3d", "adaptive_avg2d", "avg2d", "adaptive_avg3d"])
def test_pooling_reduces_partial_inputs_onto_a_batch_shard(world, kind, pool) -> None:
    _check_no_more_than_torch(world, pool, [(kind, _pieces((4, 3, 6, 6), 4))])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("S0", "S0", "S0"), ("R", "S0", "R"), ("S1", "S1", "S1")])
def test_triplet_margin_loss_keeps_shards(world, layouts) -> None:
    xs = [_pieces((6, 5), 10 + i, 1) for i in range(3)]
    _check_no_more_than_torch(world, F.triplet_margin_loss,
                              [(lay, ps) for lay, ps in zip(layouts, xs, strict=True)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("R", "S0"), ("S1", "R"), ("S0", "Psum")])
def test_dist_of_mixed_layouts_cuts_the_other_operand(world, layouts) -> None:
    a, b = _pieces((4, 6), 20), _pieces((4, 6), 21)
    _check_no_more_than_torch(world, lambda x, y: torch.dist(x, y, 3.0),
                              [(layouts[0], a), (layouts[1], b)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("R", "S0", "S1"), ("S0", "S1", "S1")])
def test_pointwise_output_takes_the_shard_that_moves_least(world, layouts) -> None:
    x, y = _pieces((10, 10), 30, 1), _pieces((10, 10), 31, 1)
    cond = [torch.rand(10, 10, generator=torch.Generator().manual_seed(32)) > 0.5]
    _check_no_more_than_torch(world, lambda a, c, b: torch.where(c, a, b),
                              [(layouts[0], x), (layouts[1], cond), (layouts[2], y)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("R", "S0"), ("Pmax", "R"), ("Psum", "R")])
def test_take_cuts_the_output_as_the_index(world, layouts) -> None:
    x = _pieces((3, 5), 40)
    index = [torch.tensor([[0, 14, 3], [7, 7, 2]])] * 2
    _check_no_more_than_torch(world, torch.take, [(layouts[0], x), (layouts[1], index)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["Pmax", "Pmin"])
def test_gather_and_index_select_keep_max_min_pieces(world, kind) -> None:
    x = _pieces((4, 5), 41)
    index = [torch.tensor([[0, 4, 1], [2, 2, 0], [1, 1, 1], [3, 0, 4]])] * 2
    _check_no_more_than_torch(world, lambda a, i: torch.gather(a, 1, i),
                              [(kind, x), ("R", index)])
    _check_no_more_than_torch(world, lambda a, i: torch.index_select(a, 1, i[0]),
                              [(kind, x), ("R", index)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layout", ["S0", "S2"])
def test_narrow_copy_keeps_the_other_dims_shards(world, layout) -> None:
    _check_no_more_than_torch(world, lambda x: torch.narrow_copy(x, 1, 1, 2),
                              [(layout, _pieces((4, 5, 6), 50, 1))])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", ["max", "clamp_min", "clamp_max"])
def test_extremes_keep_pieces_of_the_same_extreme(world, case) -> None:
    kind = "Pmin" if case == "clamp_max" else "Pmax"
    a, b = _pieces((5, 4), 60), _pieces((5, 4), 61)
    if case == "max":
        _check_no_more_than_torch(world, torch.max, [(kind, a)])
    else:
        _check_no_more_than_torch(world, getattr(torch, case), [(kind, a), (kind, b)])


@pytest.mark.world_size(2)
def test_byte_cast_of_partial_max_pieces_is_right_where_torch_is_not(world) -> None:
    """Why ``byte``/``char`` of ``Partial(max)`` is an accepted difference."""
    import comm_audit

    assert comm_audit.accepted("byte", "P(max)")
    pieces = [torch.tensor([-1.0, 3.0]), torch.tensor([0.0, 2.0])]
    got, want = _run(world, lambda x: x.byte(), [("Pmax", pieces)])
    assert torch.equal(got["ours"][2], want)  # [0, 3]
    assert not torch.equal(got["torch"][2], want)  # 255 = max(byte(-1.0), byte(0.0))
