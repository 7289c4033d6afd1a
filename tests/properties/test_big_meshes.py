"""Covers: dtensor/mesh.py, dtensor/_mesh_build.py, dtensor/redistribute.py on
meshes drawn from the world size (dtensor/testing/big_meshes.py): 1-D to 4-D
factorizations of the world, a sub-mesh of some of their axes in any order,
some axes flattened into one, and tensors that split unevenly over them.

Property: the view's rank tensor is the reference grid built element by
element from the parent's; this rank's coordinate agrees with it; a tensor
distributed on the view, and redistributed to other placements, holds the
single-device block on every rank (ranks outside a sub-mesh hold nothing).

At the default 2 and 4 ranks this is a small-mesh property; its point is the
simulated runs at 256 to 1024 ranks (``DTENSOR_WORLD_SIZES=256 pytest
--dist-sim``), where axes of 128+ ranks and 8x8x8-like meshes occur.
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
from dtensor.testing.big_meshes import VIEWS, big_meshes, uneven_shapes

pytestmark = pytest.mark.dist_timeout(300)


@given(data=st.data())
def test_big_mesh_views_hold_the_single_device_blocks(n_ranks, world, impl, data):
    # Flattening is private API in PyTorch (_flatten): covered for dtensor.
    views = VIEWS if impl.name == "dtensor" else tuple(v for v in VIEWS if v != "flattened")
    case = data.draw(big_meshes(world_size=world.size, views=views), label="mesh")
    x = data.draw(tensors(shape=uneven_shapes(mesh_shape=case.shape)), label="tensor")
    src = data.draw(placements(mesh_ndim=len(case.shape), tensor_ndim=x.ndim,
                               allow_partial=False), label="placements")
    dst = data.draw(placements(mesh_ndim=len(case.shape), tensor_ndim=x.ndim,
                               allow_partial=False), label="redistribute to")
    mesh = case.build(impl)
    ref = case.ranks(world.rank)
    got = mesh.mesh
    assert got.tolist() == ref.tolist(), (
        f"rank {world.rank}: {case}: rank tensor of shape {tuple(got.shape)} differs from "
        f"the reference grid of shape {tuple(ref.shape)} at "
        f"{(got != ref).nonzero()[:4].tolist() if got.shape == ref.shape else 'its shape'}")
    assert_coordinate(mesh, msg=str(case))
    dt = impl.distribute_tensor(x, mesh, impl.placements(src))
    assert_matches_single_device(dt, x, msg=f"distribute_tensor {src} on {case}")
    moved = dt.redistribute(mesh, impl.placements(dst))
    assert_matches_single_device(moved, x, msg=f"redistribute {src} -> {dst} on {case}")
