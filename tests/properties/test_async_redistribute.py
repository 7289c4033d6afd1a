"""Covers: ``redistribute(..., async_op=True)`` (dtensor/redistribute.py,
dtensor/_comm.py, dtensor/_async.py) against the synchronous redistribute.

Properties, on 1-D to 3-D meshes over the whole world, for every dtype: an
async redistribute from any placements to any placements leaves every rank
the block the synchronous one does (bit for bit: the same plan runs), and so
does a chain of two async redistributes whose first result is still in flight.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from dtensor.testing import distributed_inputs, placements


def _wait(t: torch.Tensor) -> torch.Tensor:
    wait = getattr(t, "wait", None)
    return wait() if callable(wait) else t


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(_wait(a), b, rtol=0, atol=0, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


@given(data=st.data())
def test_async_redistribute_leaves_the_synchronous_blocks(n_ranks, world, impl, data):
    inp = data.draw(distributed_inputs(world_size=world.size, mesh_factory=impl.mesh,
                                       mixed_reduce_ops=impl.mixed_partials))
    mid, dst = (data.draw(placements(mesh_ndim=inp.layout.ndim, tensor_ndim=inp.tensor.ndim,
                                     mixed_reduce_ops=impl.mixed_partials)) for _ in "ab")
    x = impl.from_blocks(inp.tensor, inp.mesh, inp.placements)
    sync = x.redistribute(inp.mesh, impl.placements(mid))
    pending = x.redistribute(inp.mesh, impl.placements(mid), async_op=True)
    chained = pending.redistribute(inp.mesh, impl.placements(dst), async_op=True)
    want = sync.redistribute(inp.mesh, impl.placements(dst))
    _same(chained.to_local(), want.to_local(), f"{inp.placements} -> {mid} -> {dst}")
    _same(pending.to_local(), sync.to_local(), f"{inp.placements} -> {mid}")
