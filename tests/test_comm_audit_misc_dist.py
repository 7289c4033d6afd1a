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
  lower dim's shard, as PyTorch (dtensor/rules/pointwise.py);
- ``cat`` (``column_stack``, ``dstack``) joins on the operand shard that
  moves the fewest bytes, the output's padded gather counted; ``stack``
  (``cartesian_prod``) of operands mostly whole gathers the cut ones
  (dtensor/rules/join.py);
- ``bucketize`` by boundaries cut along their dim counts per block
  (``Partial(sum)``), and keeps the values' shard
  (dtensor/rules/bucketize.py).
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


@pytest.mark.world_size(2)
def test_column_stack_joins_on_a_shard_longer_than_the_axis(world) -> None:
    # operand 0's dim 2 has size 1: kept, rank 1's pieces are empty and
    # gathering the output sends it whole from every rank's padded piece
    a, b = _pieces((5, 2, 1), 100, 1), _pieces((5, 3, 1), 101, 1)
    _check_no_more_than_torch(world, lambda x, y: torch.column_stack([x, y]),
                              [("S2", a), ("S0", b)])


@pytest.mark.world_size(2)
def test_dstack_joins_on_the_shard_that_moves_the_fewest_operands(world) -> None:
    a, b, c = (_pieces((5, 5), s, 1) for s in (102, 103, 104))
    _check_no_more_than_torch(world, lambda x, y, z: torch.dstack([x, y, z]),
                              [("S0", a), ("S1", b), ("S1", c)])


@pytest.mark.world_size(2)
def test_stack_on_dims_shorter_than_the_axis_joins_whole_operands(world) -> None:
    # every operand shard cuts a dim of size 1: the output would sit on one
    # rank, so gathering the operands moves less than any shard
    a, b, c = (_pieces((1, 2, 1, 4), s, 1) for s in (110, 111, 112))
    _check_no_more_than_torch(world, lambda x, y, z: torch.stack([x, y, z], -1),
                              [("S0", a), ("S0", b), ("S2", c)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("R", "S1", "S0"), ("S1", "S3", "R"), ("S3", "S3", "S2")])
def test_stack_of_operands_cut_on_different_dims_gathers_them(world, layouts) -> None:
    # A shard as long as the axis is among them, yet moving the others onto
    # it and gathering the output sends more than gathering the operands
    a, b, c = (_pieces((1, 2, 1, 4), s, 1) for s in (113, 114, 115))
    _check_no_more_than_torch(world, lambda x, y, z: torch.stack([x, y, z], -1),
                              list(zip(layouts, (a, b, c), strict=True)))


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("R", "S0", "S0"), ("R", "S0", "R"), ("R", "R", "S0")])
def test_cartesian_prod_of_mostly_whole_operands_gathers_the_cut_ones(world, layouts) -> None:
    # The output is mostly whole operands: cutting it only to gather all of
    # it again moves more than gathering the cut operands first
    a, b, c = ([torch.tensor(v)] for v in ([5.0], [0.0, 1.0], [0.0, 1.0, 2.0, 3.0]))
    _check_no_more_than_torch(world, torch.cartesian_prod,
                              list(zip(layouts, (a, b, c), strict=True)))


def _sorted_boundaries(n: int, seed: int) -> list[torch.Tensor]:
    return [torch.sort(_pieces((n,), seed, 1)[0]).values]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("right", [False, True])
@pytest.mark.parametrize("out_int32", [False, True])
def test_bucketize_by_cut_boundaries_counts_per_block(world, right, out_int32) -> None:
    """Each rank counts its own block of the sorted boundaries below each
    value: ``Partial(sum)`` counts, where gathering the boundaries costs more."""
    def fn(x, b):
        return torch.bucketize(x, b, right=right, out_int32=out_int32)

    bounds = _sorted_boundaries(9, 105)
    bounds[0][3] = bounds[0][4]  # a tie: right= decides which block counts it
    values = [torch.cat([bounds[0][2:6], torch.tensor([-9.0, 9.0])])]
    _check_no_more_than_torch(world, fn, [("R", [values[0][3].clone()]), ("S0", bounds)])
    _check_no_more_than_torch(world, fn, [("R", values), ("S0", bounds)])
    # values cut, boundaries whole: elementwise, the values' shard stays
    _check_no_more_than_torch(world, fn, [("S0", _pieces((6, 3), 106, 1)), ("R", bounds)])



def _ours(world, fn, inputs):
    """(collectives, wire bytes) of ours alone (PyTorch's DTensor has no
    rule for these calls), checked against the single-device value."""
    from _comm_bytes import CommBytes
    from test_comm_audit_fixes_dist import _libs, _make

    lib, mesh = _libs(world)["ours"]
    args = [_make(lib, mesh, lay, ps, world.rank) for lay, ps in inputs]
    with CommBytes() as cb:
        full = fn(*args).full_tensor()
    torch.testing.assert_close(full, fn(*[ps[0] for _, ps in inputs]))
    return len(cb.records), cb.wire


@pytest.mark.world_size(2)
def test_searchsorted_by_cut_rows_counts_per_block(world) -> None:
    seq = [torch.sort(_pieces((3, 9), 107, 1)[0], dim=-1).values]
    values = _pieces((3, 2), 108, 1)
    # int64 counts all-reduced (48 B) against the rows gathered (60 B)
    assert _ours(world, torch.searchsorted, [("S1", seq), ("R", values)]) == (1, 48)
    # cut alike along the batch dim, or the values cut: the output's gather
    assert _ours(world, torch.searchsorted, [("S0", seq), ("S0", values)]) == (1, 32)
    assert _ours(world, torch.searchsorted, [("R", seq), ("S1", values)]) == (1, 24)
    flat = _sorted_boundaries(9, 109)
    for fn in (lambda s: torch.searchsorted(s, 0.1, side="right"),
               lambda b: torch.bucketize(0.1, b)):
        assert _ours(world, fn, [("S0", flat)]) == (1, 8)  # one count all-reduced
