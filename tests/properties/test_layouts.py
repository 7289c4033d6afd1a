"""Covers: dtensor/mesh.py (sub-meshes taken by name, coordinates, local
ranks) and the placement conventions of dtensor/spec.py.

Properties, checked on every rank against the per-rank oracle
(``dtensor.testing.oracle``: the coordinate is where the rank sits in the
mesh's rank tensor, the block is ``torch.chunk`` at that coordinate):

- a sub-mesh taken with named axes, in any order (``mesh["tp", "dp"]`` of a
  ``("dp", "tp")`` mesh, 2-D and 3-D parents), has the reference rank tensor
  (built element by element from the parent's), the names asked for, and
  coordinates / ``get_local_rank`` on every axis that agree with it; the
  parent's do too;
- tensors distributed and redistributed on such a sub-mesh hold the block
  of the reference layout on every rank.

Collectives first, asserts after: a rank that failed early would otherwise
leave the others waiting in a collective.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dtensor.testing import (
    assert_coordinate,
    assert_matches_single_device,
    placements,
    tensors,
)
from dtensor.testing.meshes import named_sub_meshes


def _sub_mesh(impl, parent, picked, as_str: bool):
    key = picked[0] if as_str else tuple(picked)
    try:
        return parent[key]
    except (KeyError, RuntimeError, ValueError) as e:
        if impl.name == "dtensor":
            raise
        pytest.skip(f"{impl.name}: mesh[{key!r}] is not supported: {e}")


@given(data=st.data())
def test_named_sub_meshes_follow_the_parent_rank_tensor(n_ranks, world, impl, data):
    case = data.draw(named_sub_meshes(world_size=world.size), label="mesh")
    as_str = len(case.picked) == 1 and data.draw(st.booleans(), label="index by str")
    x = data.draw(tensors(), label="tensor")
    src = data.draw(placements(mesh_ndim=len(case.picked), tensor_ndim=x.ndim,
                               allow_partial=False), label="placements")
    dst = data.draw(placements(mesh_ndim=len(case.picked), tensor_ndim=x.ndim,
                               allow_partial=False), label="redistribute to")
    parent = impl.named_mesh(case.layout, case.names)
    sub = _sub_mesh(impl, parent, case.picked, as_str)
    dt = impl.distribute_tensor(x, sub, impl.placements(src))
    moved = dt.redistribute(sub, impl.placements(dst))
    ref = case.sub_grid(world.rank)
    assert sub.mesh.tolist() == ref.tolist(), (
        f"rank {world.rank}: {case}: mesh[{list(case.picked)}] has rank tensor "
        f"{sub.mesh.tolist()}, expected {ref.tolist()} (the parent's ranks, axes in the "
        "order asked)")
    assert tuple(sub.mesh_dim_names or ()) == case.picked, (
        f"rank {world.rank}: {case}: sub-mesh names {sub.mesh_dim_names}, expected "
        f"{case.picked}")
    assert_coordinate(parent, msg=f"{case}: the parent")
    assert_coordinate(sub, msg=f"{case}: mesh[{list(case.picked)}]")
    assert_matches_single_device(dt, x, msg=f"distribute_tensor on {case} with {src}")
    assert_matches_single_device(moved, x, msg=f"redistribute {src} -> {dst} on {case}")
