"""Covers: dtensor/redistribute.py plan() (pure, no process group).

The plan is checked by simulating it on index tensors: every step is applied
to every coordinate's block with the pure layout math, and the result must be
each coordinate's block of the target layout.
"""

from __future__ import annotations

import itertools

import pytest

from dtensor import Partial, Replicate, Shard
from dtensor.redistribute import plan

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
