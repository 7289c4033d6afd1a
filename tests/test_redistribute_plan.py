"""Covers: dtensor/redistribute.py plan(), dtensor/_plan_cost.py (pure, no process group).

Plans are checked three ways: the placement bookkeeping of every step is
valid; simulating the steps' collectives on every mesh coordinate's block
(2x2x2 and uneven shapes included, which the Gloo tests cannot reach) gives
each coordinate's block of the target; and no plan moves more wire bytes
than the phase plan or a naive reduce-gather-slice plan.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dtensor import Partial, Replicate, Shard
from dtensor._plan_cost import plan_cost
from dtensor.redistribute import Step, _kept_but_reduced, _phase_plan, plan
from dtensor.spec import local_block, shard_range

MESHES = [(3,), (2, 2), (2, 1, 2)]


def _placements(mesh_ndim: int, tensor_ndim: int, partial: bool = True):
    opts = [Replicate(), *(Shard(d) for d in range(tensor_ndim))]
    if partial:
        opts += [Partial("sum"), Partial("max")]
    return list(itertools.product(opts, repeat=mesh_ndim))


def test_no_op_plan_is_empty() -> None:
    for src in _placements(2, 2):
        assert plan(src, src, (2, 2)) == ()


def test_replicate_to_shard_is_a_local_slice() -> None:
    steps = plan((Replicate(), Replicate()), (Shard(0), Shard(1)), (2, 2))
    assert [s.kind for s in steps] == ["slice", "slice"]


def test_nested_shards_gather_innermost_first() -> None:
    steps = plan((Shard(0), Shard(0)), (Replicate(), Replicate()), (2, 2))
    assert [(s.kind, s.axis) for s in steps] == [("gather", 1), ("gather", 0)]


def test_common_prefix_is_kept() -> None:
    steps = plan((Shard(0), Shard(0)), (Shard(0), Replicate()), (2, 2))
    assert [(s.kind, s.axis) for s in steps] == [("gather", 1)]
    # Same placement on axis 1 but a different nesting: must move.
    steps = plan((Replicate(), Shard(0)), (Shard(0), Shard(0)), (2, 2))
    assert [(s.kind, s.axis) for s in steps] == [("gather", 1), ("slice", 0), ("slice", 1)]


def test_partial_transitions() -> None:
    assert [s.kind for s in plan((Partial(),), (Replicate(),), (2,))] == ["reduce"]
    assert [s.kind for s in plan((Partial(),), (Shard(0),), (2,))] == ["reduce_scatter"]
    assert [s.kind for s in plan((Replicate(),), (Partial(),), (2,))] == ["to_partial"]
    assert [s.kind for s in plan((Partial("max"),), (Partial(),), (2,))] == [
        "reduce",
        "to_partial",
    ]


def test_partial_to_shard_reduce_scatters_when_the_nesting_allows() -> None:
    # Nested shards of one dim: outer axis first, each cuts its own piece.
    steps = plan((Partial(), Partial()), (Shard(0), Shard(0)), (2, 2))
    assert [(s.kind, s.axis) for s in steps] == [("reduce_scatter", 0), ("reduce_scatter", 1)]
    # The outer shard is already in place: the inner partial cuts inside it.
    steps = plan((Shard(0), Partial()), (Shard(0), Shard(0)), (2, 2))
    assert [(s.kind, s.axis) for s in steps] == [("reduce_scatter", 1)]
    # Different dims never conflict; the later gather moves 1/2 of the data.
    steps = plan((Partial(), Shard(1)), (Shard(0), Replicate()), (2, 2))
    assert [(s.kind, s.axis) for s in steps] == [("reduce_scatter", 0), ("gather", 1)]


def test_partial_to_shard_falls_back_when_the_cut_would_be_out_of_order() -> None:
    # An inner axis already shards dim 0: cutting the outer piece now would
    # split the inner block, so reduce, regather the inner axis, then slice.
    steps = plan((Partial(), Shard(0)), (Shard(0), Shard(0)), (2, 2))
    assert [(s.kind, s.axis) for s in steps] == [
        ("reduce", 0), ("gather", 1), ("slice", 0), ("slice", 1),
    ]
    # The outer axis of the target is cut first (free), then the inner reduce-scatters.
    steps = plan((Replicate(), Partial()), (Shard(0), Shard(0)), (2, 2))
    assert [(s.kind, s.axis) for s in steps] == [("slice", 0), ("reduce_scatter", 1)]
    # Not the other way round: an outer partial waits for the inner axis' cut.
    steps = plan((Partial(), Replicate()), (Shard(1), Shard(1)), (2, 2))
    assert [(s.kind, s.axis) for s in steps] == [("reduce_scatter", 0), ("slice", 1)]


def test_reduce_scatters_go_before_all_reduces_when_they_commute() -> None:
    steps = plan((Shard(0), Partial(), Partial()), (Shard(0), Replicate(), Shard(0)), (2, 2, 2))
    assert [(s.kind, s.axis) for s in steps] == [("reduce_scatter", 2), ("reduce", 1)]
    # max then sum is not sum then max: mixed ops keep the axis order.
    steps = plan((Partial("max"), Partial()), (Replicate(), Shard(0)), (2, 2))
    assert [(s.kind, s.axis) for s in steps] == [("reduce", 0), ("reduce_scatter", 1)]


def test_replicated_axes_are_cut_before_anything_moves() -> None:
    # Cutting axis 1 first halves the block axis 0 gathers.
    steps = plan((Shard(0), Replicate()), (Replicate(), Shard(1)), (2, 2))
    assert [(s.kind, s.axis) for s in steps] == [("slice", 1), ("gather", 0)]
    # After the inner gather frees axis 1, it is cut before the outer gather.
    steps = plan((Shard(0), Shard(0)), (Replicate(), Shard(1)), (2, 2))
    assert [(s.kind, s.axis) for s in steps] == [("gather", 1), ("slice", 1), ("gather", 0)]
    # Inner axes gather first whatever their dim, so axis 1's cut comes before axis 0's gather.
    steps = plan((Shard(0), Replicate(), Shard(1)), (Replicate(), Shard(1), Replicate()), (2, 2, 2))
    assert [(s.kind, s.axis) for s in steps] == [("gather", 2), ("slice", 1), ("gather", 0)]
    # Before a reduce too: the all-reduce moves the sliced block.
    steps = plan((Replicate(), Partial()), (Shard(0), Replicate()), (2, 2))
    assert [(s.kind, s.axis) for s in steps] == [("slice", 0), ("reduce", 1)]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_every_plan_reaches_its_target_with_valid_steps(mesh_shape) -> None:
    for src, dst in itertools.product(_placements(len(mesh_shape), 2), repeat=2):
        cur = list(src)
        for step in plan(src, dst, mesh_shape):
            assert tuple(cur) == step.before and cur[step.axis] == step.src
            if step.kind == "gather":
                # Only the innermost shard of a dim may be gathered.
                inner = [a for a, p in enumerate(cur) if p == step.src]
                assert step.axis == max(inner), (src, dst, step)
            if step.kind in ("slice", "reduce_scatter"):
                later = [a for a, p in enumerate(cur) if p == step.dst and a > step.axis]
                assert not later, (src, dst, step)
            if step.kind in ("slice", "reduce_scatter"):
                # The outer shards of the dim are final: never gathered later.
                outer = [a for a in range(step.axis) if cur[a] == step.dst]
                assert outer == [a for a in range(step.axis) if dst[a] == step.dst], (src, dst)
            if step.kind == "reduce_scatter":
                assert isinstance(step.src, Partial), (src, dst, step)
            cur[step.axis] = step.dst
        assert tuple(cur) == dst


# Wire bytes: the planner compares orderings by cost --------------------------
def _cost(steps, mesh_shape, shape) -> float:
    return plan_cost(steps, mesh_shape, shape)


def test_partial_waits_for_the_gather_when_that_is_cheaper() -> None:
    # 2x2, 8x8: all-reducing the 4x8 block then gathering moves 32 + 32
    # elements; gathering the partial block, cutting the freed axis, then
    # reduce-scattering the 8x4 block moves 32 + 16 (torch's plan: 192 B).
    src, dst = (Partial(), Shard(0)), (Shard(0), Shard(1))
    steps = plan(src, dst, (2, 2), (8, 8))
    assert [(s.kind, s.axis) for s in steps] == [
        ("gather", 1), ("slice", 1), ("reduce_scatter", 0),
    ]
    assert _cost(steps, (2, 2), (8, 8)) * 4 == 192
    # P -> R while another axis re-shards: the all-reduce moves the cut block.
    src, dst = (Partial(), Replicate(), Shard(0)), (Replicate(), Shard(0), Shard(1))
    steps = plan(src, dst, (2, 2, 2), (8, 8))
    assert steps[-1].kind == "reduce" and _cost(steps, (2, 2, 2), (8, 8)) * 4 == 192


def test_partial_reduces_first_when_waiting_costs_more() -> None:
    # Two gathers in between: waiting would reduce-scatter the whole 8x8
    # (32 elements) after gathers of 16 + 32; reducing the 2x8 block first
    # moves 16, then the gathers 16 + 32.
    src, dst = (Shard(0), Shard(0), Partial()), (Replicate(), Replicate(), Shard(0))
    steps = plan(src, dst, (2, 2, 2), (8, 8))
    assert [(s.kind, s.axis) for s in steps] == [
        ("reduce", 2), ("gather", 1), ("gather", 0), ("slice", 2),
    ]
    assert _cost(steps, (2, 2, 2), (8, 8)) == 64


def test_the_global_shape_prices_uneven_padding() -> None:
    # 7x5 on 2x2x2: gathering S(1) first and cutting S(0) leaves a 2x5 block
    # to all-reduce instead of the 4x3 one (88 B vs 96 B); on even shapes the
    # two orders tie and the phase order stays.
    src, dst = (Shard(0), Partial(), Shard(1)), (Shard(0), Replicate(), Shard(0))
    uneven = plan(src, dst, (2, 2, 2), (7, 5))
    assert [s.kind for s in uneven] == ["gather", "slice", "reduce"]
    assert _cost(uneven, (2, 2, 2), (7, 5)) * 4 == 88
    assert [s.kind for s in plan(src, dst, (2, 2, 2), (8, 8))] == ["reduce", "gather", "slice"]
    assert plan(src, dst, (2, 2, 2)) == plan(src, dst, (2, 2, 2), (8, 8))


def test_two_partials_to_replicate_reduce_in_one_all_reduce() -> None:
    # P P -> R R: one all-reduce over both axes' 4 ranks (a reduce run), the
    # bytes of a reduce-scatter, a half-block all-reduce and a gather (3/4 of
    # two all-reduces) in one collective instead of three.
    steps = plan((Partial(), Partial()), (Replicate(), Replicate()), (2, 2), (8, 8))
    assert [s.kind for s in steps] == ["reduce", "reduce"]
    assert _cost(steps, (2, 2), (8, 8)) == 96


def _naive_plan(src, dst, mesh_shape):
    """Reference: all-reduce every Partial, gather every shard, then cut."""
    cur, steps = list(src), []
    # A kept partial axis below a non-commuting reduction is reduced too.
    redo = _kept_but_reduced(tuple(src), tuple(dst))

    def emit(axis, kind, new):
        steps.append(Step(axis, kind, cur[axis], new, tuple(cur)))
        cur[axis] = new

    for axis, (s, d) in enumerate(zip(src, dst, strict=True)):
        if isinstance(s, Partial) and (s != d or axis in redo):
            emit(axis, "reduce", Replicate())
    for axis in reversed(range(len(cur))):
        if isinstance(cur[axis], Shard):
            emit(axis, "gather", Replicate())
    for axis, d in enumerate(dst):
        if cur[axis] != d:
            emit(axis, "slice" if isinstance(d, Shard) else "to_partial", d)
    return steps


COST_CASES = [((2, 2), (8, 8)), ((2, 2), (7, 5)), ((3, 2), (7, 5)), ((2, 2, 2), (7, 5))]


@pytest.mark.parametrize(("mesh_shape", "shape"), COST_CASES, ids=str)
def test_no_plan_moves_more_than_the_phase_plan_or_a_naive_one(mesh_shape, shape) -> None:
    for src, dst in itertools.product(_placements(len(mesh_shape), 2), repeat=2):
        cost = _cost(plan(src, dst, mesh_shape, shape), mesh_shape, shape)
        assert cost <= _cost(_phase_plan(src, dst), mesh_shape, shape) + 1e-9, (src, dst)
        assert cost <= _cost(_naive_plan(src, dst, mesh_shape), mesh_shape, shape) + 1e-9


# Every plan computes the right blocks: collectives simulated on all coordinates
def _chunk(t: torch.Tensor, dim: int, n: int, i: int) -> torch.Tensor:
    start, length = shard_range(t.shape[dim], n, i)
    return t.narrow(dim, start, length)


def _block_of(full, mesh_shape, placements, coord) -> torch.Tensor:
    shape, offset = local_block(full.shape, mesh_shape, placements, coord)
    out = full
    for dim, (o, k) in enumerate(zip(offset, shape, strict=True)):
        out = out.narrow(dim, o, k)
    return out


def _piece(block, placements, mesh_shape, coord) -> torch.Tensor:
    """Coordinate's summand of a Partial source: weights over each axis sum to 1."""
    for axis, p in enumerate(placements):
        if isinstance(p, Partial):
            n, i = mesh_shape[axis], coord[axis]
            if p.reduce_op == "max":
                block = block - i  # coordinate 0 holds the max
            else:
                w = (i + 1) / (n * (n + 1) / 2)
                block = block * w * (n if p.reduce_op == "avg" else 1)
    return block


def _reduce(blocks, op):
    if op == "max":
        return torch.stack(blocks).amax(0)
    total = torch.stack(blocks).sum(0)
    return total / len(blocks) if op == "avg" else total


def _simulate(full, mesh_shape, src, steps):
    coords = list(itertools.product(*map(range, mesh_shape)))
    blocks = {c: _piece(_block_of(full, mesh_shape, src, c), src, mesh_shape, c)
              for c in coords}
    for step in steps:
        a, n = step.axis, mesh_shape[step.axis]

        def group(c, a=a, n=n, blocks=blocks):
            return [blocks[(*c[:a], i, *c[a + 1:])] for i in range(n)]

        if step.kind == "reduce":
            blocks = {c: _reduce(group(c), step.src.reduce_op) for c in coords}
        elif step.kind == "reduce_scatter":
            blocks = {c: _chunk(_reduce(group(c), step.src.reduce_op), step.dst.dim, n, c[a])
                      for c in coords}
        elif step.kind == "gather":
            blocks = {c: torch.cat(group(c), step.src.dim) for c in coords}
        elif step.kind == "slice":
            blocks = {c: _chunk(blocks[c], step.dst.dim, n, c[a]) for c in coords}
        else:
            blocks = {c: blocks[c] if c[a] == 0 else torch.zeros_like(blocks[c]) for c in coords}
    return blocks


SIM_CASES = [((2, 2), (7, 5)), ((3, 2), (7, 5)), ((2, 2, 2), (8, 8)), ((2, 2, 2), (7, 5))]


@pytest.mark.parametrize(("mesh_shape", "shape"), SIM_CASES, ids=str)
def test_every_plan_computes_every_coordinates_block(mesh_shape, shape) -> None:
    full = torch.arange(float(math.prod(shape))).reshape(shape)
    opts = [Replicate(), Shard(0), Shard(1), Partial()]
    pls = list(itertools.product(opts, repeat=len(mesh_shape)))
    pls += [(Partial("max"),) * len(mesh_shape), (Partial("avg"), *pls[0][1:])]
    for src, dst in itertools.product(pls, repeat=2):
        if any(isinstance(d, Partial) for d in dst):
            continue  # a Partial target's pieces are not unique
        got = _simulate(full, mesh_shape, src, plan(src, dst, mesh_shape, shape))
        for c, block in got.items():
            want = _block_of(full, mesh_shape, dst, c)
            assert block.shape == want.shape and torch.allclose(block, want), (src, dst, c)
