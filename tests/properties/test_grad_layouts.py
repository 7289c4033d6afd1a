"""Covers: dtensor/tensor.py's autograd functions (to_local, from_local,
redistribute): where gradients land, not only their values.

Properties, on 1-D to 3-D meshes over the world:

- ``to_local(grad_placements=gp)``: the leaf's gradient is a DTensor laid
  out by ``gp`` holding the global gradient (its local pieces are read as
  ``gp`` says: ``Partial(sum)`` pieces add up);
- ``from_local(local, ps)`` then ``to_local(grad_placements=gp)``: the
  local leaf's gradient is its block of the global gradient under ``ps``;
- the gradient through ``redistribute`` returns to the source layout: a leaf
  laid out by ``ps`` gets a gradient laid out by ``ps``.

Every gradient is also checked block by block with the per-rank oracle.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from dtensor.placement import Partial, Replicate, Shard
from dtensor.testing import (
    assert_layout,
    assert_matches_single_device,
    distributed_inputs,
    dtypes,
    placements,
)

_FLOATS = dtypes(include=(torch.float32, torch.float64))


def _inputs(data, world, impl):
    return data.draw(distributed_inputs(world_size=world.size, mesh_factory=impl.mesh,
                                        allow_partial=False, dtype=_FLOATS,
                                        fills=("arange", "small")), label="input")


def _grad_placements(data, ps):
    """Placements giving the same local shapes as ``ps``: shards kept,
    Replicate or Partial(sum) elsewhere."""
    return tuple(p if isinstance(p, Shard) else data.draw(
        st.sampled_from([Replicate(), Partial("sum")]), label=f"grad placement {a}")
        for a, p in enumerate(ps))


def _weight(x: torch.Tensor) -> torch.Tensor:
    return (torch.arange(x.numel(), dtype=x.dtype).reshape(x.shape) % 7) + 1


def _names(ps) -> list[str]:
    return [str(p) for p in ps]


@given(data=st.data())
def test_to_local_grad_placements_lay_out_the_gradient(n_ranks, world, impl, data):
    inp = _inputs(data, world, impl)
    gp = _grad_placements(data, inp.placements)
    w = _weight(inp.tensor)
    x = impl.from_blocks(inp.tensor, inp.mesh, inp.placements).requires_grad_(True)
    w_local = impl.from_blocks(w, inp.mesh, gp).to_local()  # the gradient, as gp pieces
    local = x.to_local(grad_placements=impl.placements(gp))
    (local * w_local).sum().backward()
    what = f"grad of x.to_local(grad_placements={_names(gp)}), x on {_names(inp.placements)}"
    assert x.grad is not None, f"rank {world.rank}: {what}: no gradient"
    assert_matches_single_device(x.grad, w, msg=what)
    assert tuple(x.grad.placements) == impl.placements(gp), (
        f"rank {world.rank}: {what}: the gradient is laid out as "
        f"{_names(x.grad.placements)}, expected {_names(gp)}")


@given(data=st.data())
def test_from_local_gradient_is_the_local_block(n_ranks, world, impl, data):
    inp = _inputs(data, world, impl)
    gp = _grad_placements(data, inp.placements)
    w = _weight(inp.tensor)
    block = impl.from_blocks(inp.tensor, inp.mesh, inp.placements).to_local()
    leaf = block.detach().clone().requires_grad_(True)
    dt = impl.DTensor.from_local(leaf, inp.mesh, impl.placements(inp.placements),
                                 shape=tuple(inp.tensor.shape))
    w_local = impl.from_blocks(w, inp.mesh, gp).to_local()
    (dt.to_local(grad_placements=impl.placements(gp)) * w_local).sum().backward()
    what = (f"grad of from_local(local, {_names(inp.placements)})"
            f".to_local(grad_placements={_names(gp)})")
    assert leaf.grad is not None, f"rank {world.rank}: {what}: no gradient"
    # The local gradient must be this rank's block of w under the source layout.
    expected = impl.DTensor.from_local(leaf.grad, inp.mesh,
                                       impl.placements(inp.placements),
                                       shape=tuple(inp.tensor.shape))
    assert_layout(expected, w, msg=what)


@given(data=st.data())
def test_redistribute_gradient_returns_to_the_source_layout(n_ranks, world, impl, data):
    inp = _inputs(data, world, impl)
    dst = data.draw(placements(mesh_ndim=inp.layout.ndim, tensor_ndim=inp.tensor.ndim,
                               reduce_ops=("sum",)), label="redistribute to")
    w = _weight(inp.tensor)
    x = impl.from_blocks(inp.tensor, inp.mesh, inp.placements).requires_grad_(True)
    y = x.redistribute(inp.mesh, impl.placements(dst))
    (y.full_tensor() * w).sum().backward()
    what = f"grad through redistribute {_names(inp.placements)} -> {_names(dst)}"
    assert x.grad is not None, f"rank {world.rank}: {what}: no gradient"
    assert_matches_single_device(x.grad, w, msg=what)
    assert tuple(x.grad.placements) == impl.placements(inp.placements), (
        f"rank {world.rank}: {what}: the gradient is laid out as "
        f"{_names(x.grad.placements)}, expected the source layout "
        f"{_names(inp.placements)}")
