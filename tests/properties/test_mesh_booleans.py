"""Covers: ops whose result is one Python value for the whole mesh
(``equal``, ``allclose``, ``is_nonzero``, ``bool()``, ``item()``): dtensor's
``scalar_reduce`` in dtensor/dispatch/execute.py and the rules that ask for it.

Property: two DTensors with the same placements whose global values differ in
exactly one element — so only the ranks holding that element see a
difference in their blocks — give every rank the single-device answer; a
tensor compared with itself (or an equal copy) gives ``True`` everywhere.
Meshes are 1-D to 3-D over the world; placements are Shard of every dim,
nested shards, Replicate and Partial.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtensor.placement import Shard
from dtensor.testing import mesh_layouts, placements, tensors
from dtensor.testing.strategies import tensor_shapes


def _ops():
    return (
        ("torch.equal(x, y)", lambda a, b: torch.equal(a, b)),
        ("x.equal(x)", lambda a, b: a.equal(a)),
        ("torch.allclose(x, y)", lambda a, b: torch.allclose(a, b)),
        ("(x == y).all().item()", lambda a, b: bool((a == b).all().item())),
        ("bool((x != y).any())", lambda a, b: bool((a != b).any())),
        ("is_nonzero(x - y) of one element", lambda a, b: (
            (a - b).sum().is_nonzero())),
    )


_NAMES = [n for n, _ in _ops()]


@given(data=st.data())
def test_mesh_wide_booleans_see_one_rank_differ(n_ranks, world, impl, data):
    layout = data.draw(mesh_layouts(world_size=world.size), label="layout")
    x = data.draw(tensors(shape=tensor_shapes(min_dims=1, min_side=1, max_side=5),
                          dtype=torch.float32, fills=("arange", "small")), label="x")
    ps = data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=x.ndim,
                              mixed_reduce_ops=impl.mixed_partials), label="placements")
    _check_one_element_differs(world, impl, data, layout, x, ps)


def _later_wide_axis(layout) -> bool:
    return any(n > 1 for n in layout.shape[1:])


# Drawn placements seldom shard on a later mesh axis of size > 1 without a
# Partial (which makes the ops replicate first), yet only there does a block
# differ between ranks that agree on mesh axis 0: a reduction over the first
# axis alone answers differently on different ranks. This draws that case
# (every example of it can show such a bug: a fifth of the profile suffices).
@settings(max_examples=max(3, settings.default.max_examples // 5))
@given(data=st.data())
def test_mesh_wide_booleans_see_a_block_on_a_later_axis_differ(n_ranks, world, impl, data):
    layout = data.draw(mesh_layouts(world_size=world.size, min_ndim=2).filter(
        _later_wide_axis), label="layout")
    x = data.draw(tensors(shape=tensor_shapes(min_dims=1, min_side=1, max_side=5),
                          dtype=torch.float32, fills=("arange", "small")), label="x")
    ps = list(data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=x.ndim,
                                   allow_partial=False), label="placements"))
    wide = [a for a in range(1, layout.ndim) if layout.shape[a] > 1]
    axis = data.draw(st.sampled_from(wide), label="sharded later axis")
    ps[axis] = Shard(data.draw(st.integers(0, x.ndim - 1), label="its tensor dim"))
    _check_one_element_differs(world, impl, data, layout, x, tuple(ps))


def _check_one_element_differs(world, impl, data, layout, x, ps):
    flat = data.draw(st.integers(0, x.numel() - 1), label="element")
    y = x.clone()
    y.view(-1)[flat] += data.draw(st.sampled_from((1.0, -3.0, 0.5)), label="by")
    mesh = impl.mesh(layout)
    dx, dy = impl.from_blocks(x, mesh, ps), impl.from_blocks(y, mesh, ps)
    dz = impl.from_blocks(x.clone(), mesh, ps)
    errors = []
    # Every op, against the differing tensor and an equal copy, in each example.
    for name, fn in _ops():
        for other, d_other, what in ((y, dy, "one element differs"), (x, dz, "equal values")):
            expected = fn(x, other)
            got = fn(dx, d_other)
            if mesh.get_coordinate() is not None and got != expected:
                errors.append(AssertionError(
                    f"rank {world.rank}: {name} of {[str(p) for p in ps]} over {layout} "
                    f"({what}, element {flat}): got {got!r}, single device {expected!r}"))
    if errors:
        raise errors[0]
