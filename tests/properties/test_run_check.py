"""Covers: ``DTensor.from_local(run_check=True)`` (dtensor/tensor.py,
dtensor/_local_check.py).

Properties, on 1-D to 3-D meshes over the world, with ``shape=`` given or
not:

- good blocks (every rank its ``torch.chunk`` block, uneven and empty ones
  included) give the global tensor, every rank holding its block;
- one rank's bad block — one row too many, an extra dim, another dtype —
  is rejected on every rank with a ``ValueError`` (no rank returns, none
  hangs);
- under ``Replicate``, a rank holding other values than the mesh axis's
  first rank ends up with the first rank's values (PyTorch's documented
  behaviour), so the result is the first rank's tensor.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dtensor.testing import (
    assert_matches_single_device,
    distributed_inputs,
    dtypes,
    mesh_layouts,
)

KINDS = ("good", "extra_row", "extra_dim", "dtype", "replica_values")


def _bad_block(local: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "extra_row":
        if local.ndim == 0:
            return local.reshape(1).repeat(2)
        return torch.cat([local, local.new_zeros((1, *local.shape[1:]))], 0)
    if kind == "extra_dim":
        return local.unsqueeze(0)
    if kind == "dtype":
        return local.to(torch.float64 if local.dtype != torch.float64 else torch.float32)
    return local + 1  # replica_values


@given(data=st.data())
def test_run_check_accepts_good_blocks_and_rejects_bad_ones_everywhere(
        n_ranks, world, impl, data):
    inp = data.draw(distributed_inputs(
        world_size=world.size, mesh_factory=impl.mesh, allow_partial=False,
        dtype=dtypes(include=(torch.float32, torch.int64)), fills=("arange", "small")),
        label="input")
    kind = data.draw(st.sampled_from(KINDS), label="kind")
    # Without shape=, one more row on a shard can be a valid uneven layout of
    # a larger tensor: an extra row is bad input only against a given shape.
    give_shape = kind == "extra_row" or data.draw(st.booleans(), label="shape= given")
    layout, ps = inp.layout, inp.placements
    # replica_values: a rank off coordinate 0 of a Replicate axis (if any).
    replicated = [a for a, p in enumerate(ps) if not p.is_shard() and layout.shape[a] > 1]
    if kind == "replica_values" and not replicated:
        kind = "good"
    if kind == "replica_values":
        axis = data.draw(st.sampled_from(replicated), label="replicate axis")
        bad = [r for r in layout.ranks if layout.coordinate_of(r)[axis] != 0]
    else:
        bad = list(layout.ranks)
    bad_rank = data.draw(st.sampled_from(bad), label="bad rank")
    local = impl.from_blocks(inp.tensor, inp.mesh, ps).to_local().clone()
    if kind != "good" and world.rank == bad_rank:
        local = _bad_block(local, kind)
    shape = tuple(inp.tensor.shape) if give_shape else None
    what = (f"from_local(run_check=True, shape={shape}) on {ps} of {layout}, "
            f"rank {bad_rank}'s block {kind}")
    raised = None
    try:
        dt = impl.DTensor.from_local(local, inp.mesh, impl.placements(ps), run_check=True,
                                     shape=shape)
    except ValueError as e:
        raised = e
    if kind in ("good", "replica_values"):
        assert raised is None, f"rank {world.rank}: {what}: raised {raised!r}"
        assert_matches_single_device(dt, inp.tensor, msg=what)
    elif raised is None:
        pytest.fail(f"rank {world.rank}: {what}: returned {dt.shape} instead of raising "
                    "a ValueError on every rank")


@given(data=st.data())
def test_run_check_accepts_every_layout_and_replicas_agree_on_every_axis(
        n_ranks, world, impl, data):
    """Every valid layout — uneven and empty blocks, Partial pieces, 1-D to
    3-D meshes, ``shape=`` given or not — is accepted; where every rank
    holds its own values on the ``Replicate`` axes (two or more of them when
    the mesh has the axes), each replica ends up with the values of the rank
    at coordinate 0 on those axes, on every rank."""
    layout = data.draw(mesh_layouts(world_size=world.size,
                                    min_ndim=data.draw(st.sampled_from((2, 1)))), label="layout")
    inp = data.draw(distributed_inputs(
        world_size=world.size, mesh_factory=impl.mesh, min_ndim=layout.ndim,
        max_ndim=layout.ndim, mixed_reduce_ops=impl.mixed_partials,
        dtype=dtypes(include=(torch.float32, torch.int64)), fills=("arange", "small")),
        label="input")
    layout, ps = inp.layout, list(inp.placements)
    if data.draw(st.booleans(), label="replicate two axes") and layout.ndim >= 2:
        for axis in data.draw(st.permutations(range(layout.ndim)), label="axes")[:2]:
            ps[axis] = impl_replicate()
    ps = tuple(ps)
    give_shape = data.draw(st.booleans(), label="shape= given")
    # Good blocks are the other property's; here replicas always start apart.
    disagree = True
    local = impl.from_blocks(inp.tensor, inp.mesh, ps).to_local().clone()
    coord = inp.mesh.get_coordinate()
    if disagree and coord is not None:
        # Off coordinate 0 of a Replicate axis: other values than the first replica.
        off = sum((c + 1) * (a + 1) for a, (c, p) in enumerate(zip(coord, ps, strict=True))
                  if c and not p.is_shard() and not p.is_partial())
        local = local + off
    shape = tuple(inp.tensor.shape) if give_shape else None
    what = (f"from_local(run_check=True, shape={shape}) on {[str(p) for p in ps]} of "
            f"{layout}" + (", replicas disagree" if disagree else ""))
    if not give_shape and not _inferable(inp.tensor.shape, layout.shape, ps):
        shape = tuple(inp.tensor.shape)
    dt = impl.DTensor.from_local(local, inp.mesh, impl.placements(ps), run_check=True,
                                 shape=shape)
    assert_matches_single_device(dt, inp.tensor, msg=what)


def impl_replicate():
    from dtensor.placement import Replicate

    return Replicate()


def _inferable(shape, mesh_shape, ps) -> bool:
    """Whether the blocks' shapes name one global shape: a sharded dim of
    size 0 (every block empty) cannot say how large the others are."""
    return all(shape[p.dim] > 0 for p in ps if p.is_shard())
