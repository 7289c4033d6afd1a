"""Covers: ops of the communication audit (bench/comm_audit.py) that fell
back to computing replicated where PyTorch's DTensor keeps the layout, each
run with both runtimes on a 2-rank Gloo world as the audit counts them (the
op plus making its result a full tensor). Ours must send no more wire bytes
(for equal bytes, no more collectives) than PyTorch's and equal the
single-device value:

- ``fmax``/``fmin`` of ``Partial("max")``/``Partial("min")`` pieces stay
  pieces, as ``maximum``/``minimum`` do (dtensor/rules/pointwise.py);
- ``repeat`` keeps the shards of dims repeated once and passes every
  Partial (dtensor/rules/view.py);
- ``cross`` keeps shards off the crossed dim (dtensor/rules/reduction.py);
- ``isin`` keeps the elements' shards and makes the test set whole
  (dtensor/rules/tensor_ops.py);
- ``amax``/``amin`` of pieces of their own extreme over unsharded dims
  stay pieces (dtensor/rules/extremes.py; the repeat cases end with them);
- ``clamp`` of a replicated input by bounds cut on different dims keeps the
  lower dim's shard, as PyTorch (dtensor/rules/pointwise.py).
"""

from __future__ import annotations

import pytest
import torch
from test_comm_audit_fixes_dist import _check_no_more_than_torch, _pieces


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("op", "kind"), [("fmax", "Pmax"), ("fmin", "Pmin")])
def test_fmax_fmin_keep_pieces_of_their_extreme(world, op, kind) -> None:
    a, b, c = _pieces((5, 4), 90), _pieces((5, 4), 91), _pieces((5, 4), 96, 1)
    # pieces of both operands combine; a replicated one joins the pieces
    _check_no_more_than_torch(world, getattr(torch, op), [(kind, a), (kind, b)])
    _check_no_more_than_torch(world, getattr(torch, op), [(kind, a), ("R", c)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layout", ["S0", "S1", "Psum", "Pmax", "Pmin"])
def test_repeat_keeps_shards_repeated_once_and_pieces(world, layout) -> None:
    # then a reduction that keeps the layout too: one small collective at the
    # end, where gathering or reducing the input first moves the whole input
    reps, dim = ((1, 3, 1), 1) if layout == "S1" else ((2, 1, 3), -1)
    reduce = {"Pmax": torch.amax, "Pmin": torch.amin}.get(layout, torch.sum)
    _check_no_more_than_torch(world, lambda x: reduce(x.repeat(*reps), dim),
                              [(layout, _pieces((4, 6), 92))])


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("layout", "dim"), [("S0", 1), ("S2", 1), ("S0", -1)])
def test_cross_keeps_shards_off_the_crossed_dim(world, layout, dim) -> None:
    shape = (4, 3, 6) if dim == 1 else (4, 6, 3)
    a, b = _pieces(shape, 93, 1), _pieces(shape, 94, 1)
    _check_no_more_than_torch(world, lambda x, y: torch.linalg.cross(x, y, dim=dim),
                              [(layout, a), (layout, b)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("S0", "R"), ("S0", "S0"), ("S1", "R")])
def test_isin_keeps_the_elements_shards(world, layouts) -> None:
    g = torch.Generator().manual_seed(95)
    elements = [torch.randint(0, 9, (6, 4), generator=g).float()]
    test = [torch.tensor([1.0, 4.0, 7.0, 8.0])]
    _check_no_more_than_torch(world, torch.isin, [(layouts[0], elements), (layouts[1], test)])
    # a scalar test set (isin.Tensor_Scalar)
    _check_no_more_than_torch(world, lambda e: torch.isin(e, 4.0), [(layouts[0], elements)])


@pytest.mark.world_size(2)
def test_any_of_partial_sums_reduces_the_pieces_first(world) -> None:
    """Why ``any`` of ``Partial(sum)`` is an accepted difference: PyTorch's
    ``any`` of each piece says True for pieces that cancel."""
    import comm_audit
    from test_comm_audit_fixes_dist import _libs, _make

    assert comm_audit.accepted("any", "P(sum)") and not comm_audit.accepted("any", "S(0)")
    pieces = [torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.0])]  # sum: [0, 0]
    got = {}
    for name, (lib, mesh) in _libs(world).items():
        got[name] = bool(torch.any(_make(lib, mesh, "Psum", pieces, world.rank)).full_tensor())
    assert got == {"ours": False, "torch": True}, got


@pytest.mark.world_size(2)
def test_clamp_by_bounds_cut_on_different_dims(world) -> None:
    x, lo, hi = _pieces((5, 10, 5), 97, 1), _pieces((10, 5), 98, 1), _pieces((10, 5), 99, 1)
    _check_no_more_than_torch(world, torch.clamp, [("R", x), ("S1", lo), ("S0", hi)])
