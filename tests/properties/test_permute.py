"""Covers: the ``permute`` rule of dtensor/rules/view.py (and ``movedim``,
which calls it), through the public ops.

Property: on 3-D and 4-D tensors with any placements (Shard of every dim,
nested shards, Replicate, Partial of every reduce op), every permutation of
the dims — cycles of length 3 and 4 included, not only self-inverse swaps —
through ``permute`` and ``movedim`` equals single device on every rank
(values, local shape, offset and placements through the per-rank oracle).
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import given
from hypothesis import strategies as st

from dtensor.testing import assert_matches_single_device, mesh_layouts, placements, tensors
from dtensor.testing.strategies import tensor_shapes


@given(data=st.data())
def test_every_permutation_on_every_layout_matches_single_device(n_ranks, world, impl, data):
    layout = data.draw(mesh_layouts(world_size=world.size), label="layout")
    x = data.draw(tensors(shape=tensor_shapes(min_dims=3, max_dims=4, max_side=4),
                          fills=("arange", "small")), label="x")
    ps = data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=x.ndim,
                              mixed_reduce_ops=impl.mixed_partials), label="placements")
    mesh = impl.mesh(layout)
    dx = impl.from_blocks(x, mesh, ps)
    where = f"of {x.dtype}{list(x.shape)} as {[str(p) for p in ps]} over {layout}"
    errors = []
    # Every permutation in one example: each is one local op (a shard follows
    # its dim), so all 24 of a 4-D tensor cost less than one more example.
    for perm in itertools.permutations(range(x.ndim)):
        for name, fn in (("permute", lambda t, p=perm: t.permute(p)),
                         ("movedim", lambda t, p=perm: torch.movedim(
                             t, tuple(range(len(p))), p))):
            try:
                assert_matches_single_device(fn(dx), fn(x), msg=f"{name}{perm} {where}")
            except AssertionError as e:
                errors.append(e)
        if errors:
            break
    if errors:
        raise errors[0]
