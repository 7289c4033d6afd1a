"""Covers: dtensor/strided.py (redistribute to and from StridedShard,
fsdp_tp_placements), the StridedShard hook of dtensor/redistribute.py,
distribute_tensor / from_local / full_tensor with it, and dispatch offering
rules StridedShard operands as Replicate (dtensor/dispatch/propagate.py).

Properties, on 1-D and 2-D meshes over the whole world, with uneven and
empty blocks (sides 0..7, split factors 1..4): any layout with StridedShard
axes (alone, nested inside or around Shard axes of the same dim, beside
Partial) -> any layout keeps the single-device value and puts the oracle's
block on every rank (``dtensor.testing.oracle``: ``torch.chunk`` of index
ranges, not the runtime's row math); a round trip returns the original
blocks; FSDP + TP blocks cut by hand (TP block, then its dp piece) wrapped
with ``from_local`` are the global tensor; ops on strided operands equal
single device, in-place and random ones included.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from dtensor.placement import Replicate, Shard, StridedShard
from dtensor.testing import (
    assert_matches_single_device,
    mesh_layouts,
    placements,
    tensors,
)
from dtensor.testing.strategies import tensor_shapes


@pytest.fixture(autouse=True)
def _ours(impl):
    if impl.name != "dtensor":
        pytest.skip(f"{impl.name}: StridedShard is private API there (_StridedShard, "
                    "even sizes only); covered for dtensor")


def _layout(data, world):
    return data.draw(mesh_layouts(world_size=world.size, max_ndim=2), label="layout")


def _x(data, dtype=None):
    return data.draw(tensors(shape=tensor_shapes(min_dims=1, max_dims=2, max_side=7),
                             dtype=dtype, fills=("arange", "small")), label="x")


def _strided(data, layout, x, *, allow_partial=True, label="placements"):
    """Drawn placements with some axes turned into StridedShard (at least one)."""
    ps = list(data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=x.ndim,
                                   allow_partial=allow_partial), label=label))
    axes = data.draw(st.sets(st.integers(0, layout.ndim - 1), min_size=1), label="strided axes")
    for axis in sorted(axes):
        dim = data.draw(st.integers(0, x.ndim - 1), label="dim")
        ps[axis] = StridedShard(dim, data.draw(st.integers(2, 4), label="split_factor"))
    return tuple(ps)


def _any(data, layout, x, label):
    if data.draw(st.booleans(), label=f"{label} strided"):
        return _strided(data, layout, x, allow_partial=False, label=label)
    return data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=x.ndim), label=label)


@given(data=st.data())
def test_distribute_tensor_and_full_tensor_with_strided_shard(n_ranks, world, impl, data):
    layout, x = _layout(data, world), _x(data)
    ps = _strided(data, layout, x, allow_partial=False)
    mesh = impl.mesh(layout)
    dt = impl.distribute_tensor(x, mesh, ps)
    assert_matches_single_device(dt, x, msg=f"distribute_tensor as {ps}")
    full = dt.full_tensor()
    assert torch.equal(full, x), f"rank {world.rank}: full_tensor of {ps}: {full} != {x}"


@given(data=st.data())
def test_redistribute_to_and_from_strided_shard(n_ranks, world, impl, data):
    layout, x = _layout(data, world), _x(data)
    mesh = impl.mesh(layout)
    if data.draw(st.booleans(), label="strided source"):
        src = _strided(data, layout, x)
        dst = _any(data, layout, x, "redistribute to")
    else:
        src = data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=x.ndim), label="src")
        dst = _strided(data, layout, x, allow_partial=False, label="redistribute to")
    dx = impl.from_blocks(x, mesh, src)
    y = dx.redistribute(mesh, dst)
    assert_matches_single_device(y, x, msg=f"redistribute {src} -> {dst}")
    if not any(p.is_partial() for p in src):  # Partial pieces are not unique
        back = y.redistribute(mesh, src)
        a, b = dx.to_local(), back.to_local()
        assert torch.equal(a, b), (
            f"rank {world.rank}: round trip {src} -> {dst} -> {src} changed the block "
            f"{a} -> {b}")


@given(data=st.data())
def test_fsdp_tp_blocks_cut_by_hand_are_the_global_tensor(n_ranks, world, impl, data):
    from dtensor.errors import PlacementError
    from dtensor.strided import fsdp_tp_placements
    from dtensor.testing.meshes import MeshLayout

    n_dp = data.draw(st.sampled_from([d for d in range(1, world.size + 1)
                                      if world.size % d == 0]), label="dp")
    n_tp = world.size // n_dp
    rows = data.draw(st.integers(0, 3 * world.size), label="rows")
    x = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    mesh = impl.named_mesh(MeshLayout((n_dp, n_tp), tuple(range(world.size))), ("dp", "tp"))
    try:
        ps = fsdp_tp_placements(mesh, Shard(0), x.shape)
    except PlacementError:
        assume(False)  # sizes the layout cannot express (unit tests cover the refusal)
    i, j = mesh.get_coordinate()
    # FSDP's cut, by hand: TP block j of the rows, then dp piece i of that block.
    block = _piece(_piece(x, n_tp, j), n_dp, i)
    dt = impl.DTensor.from_local(block, mesh, ps, shape=x.shape)
    assert_matches_single_device(dt, x, msg=f"FSDP + TP blocks as {ps}")
    assert torch.equal(dt.full_tensor(), x)
    tp_only = dt.redistribute(mesh, (Replicate(), Shard(0)))  # FSDP's all-gather
    assert_matches_single_device(tp_only, x, msg="to the TP layout")


@given(data=st.data())
def test_ops_on_strided_operands_match_single_device(n_ranks, world, impl, data):
    # float32: x * 2 + x and mul_ are defined for it (bool would promote)
    layout, x = _layout(data, world), _x(data, torch.float32)
    ps = _strided(data, layout, x, allow_partial=False)
    mesh = impl.mesh(layout)
    dx = impl.from_blocks(x, mesh, ps)
    y = dx * 2 + dx
    assert_matches_single_device(y, x * 2 + x, msg=f"x * 2 + x on {ps}")
    assert_matches_single_device(dx.sum(0), x.sum(0), msg=f"sum(0) on {ps}")
    dx.mul_(3)  # the write lands in dx's own (strided) layout
    assert dx.placements == ps, f"mul_ changed the layout {ps} -> {dx.placements}"
    assert_matches_single_device(dx, x * 3, msg=f"mul_ on {ps}")
    if x.is_floating_point():  # random values are a function of the global index
        import dtensor

        whole = dx.redistribute(mesh, (Replicate(),) * layout.ndim)
        dtensor.manual_seed(1234)
        dx.uniform_()
        dtensor.manual_seed(1234)
        whole.uniform_()
        assert_matches_single_device(dx, whole.full_tensor(), msg=f"uniform_ on {ps}")


def _piece(t: torch.Tensor, n: int, c: int) -> torch.Tensor:
    pieces = torch.chunk(t, n) if t.shape[0] else ()
    return pieces[c] if c < len(pieces) else t[:0]
