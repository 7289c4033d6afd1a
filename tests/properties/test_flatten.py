"""Covers: dtensor/mesh.py and dtensor/_mesh_build.py — flattened mesh axes
(``mesh["dp", "cp"]._flatten("dp_cp")``, how torchtitan and FSDP build their
data-parallel axis).

Property, on named meshes over the whole world (2-D and 3-D) and any sub-mesh
of their axes (in any order): the flattened mesh's rank tensor is the
reference sub-mesh's, flattened row-major; the root learns the name
(``root[name]`` is the same mesh); coordinates agree with the per-rank oracle;
tensors distributed and redistributed on it hold the reference blocks.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dtensor.testing import assert_coordinate, assert_matches_single_device, placements, tensors
from dtensor.testing.meshes import named_sub_meshes

pytestmark = pytest.mark.dist_timeout(180)


@given(data=st.data())
def test_flattened_axes_lay_out_like_one_axis(n_ranks, world, impl, data):
    if impl.name != "dtensor":
        pytest.skip(f"{impl.name}: flattening is private API there (_flatten); "
                    "covered for dtensor")
    case = data.draw(named_sub_meshes(world_size=world.size), label="mesh")
    x = data.draw(tensors(), label="tensor")
    src = data.draw(placements(mesh_ndim=1, tensor_ndim=x.ndim, allow_partial=False),
                    label="placements")
    dst = data.draw(placements(mesh_ndim=1, tensor_ndim=x.ndim, allow_partial=False),
                    label="redistribute to")
    parent = impl.named_mesh(case.layout, case.names)
    name = "_".join(case.picked) + "_flat"
    flat = parent[case.picked]._flatten(name)
    dt = impl.distribute_tensor(x, flat, impl.placements(src))
    moved = dt.redistribute(flat, impl.placements(dst))
    ref = case.sub_grid(world.rank).flatten()
    assert flat.mesh.tolist() == ref.tolist(), (
        f"rank {world.rank}: {case}: flattened rank tensor {flat.mesh.tolist()}, "
        f"expected {ref.tolist()}")
    assert parent[name].mesh.tolist() == ref.tolist(), f"root[{name!r}] is another mesh"
    assert_coordinate(flat, msg=f"{case}: flattened {case.picked}")
    assert_matches_single_device(dt, x, msg=f"distribute_tensor on flattened {case}")
    assert_matches_single_device(moved, x, msg=f"redistribute {src} -> {dst} on flattened {case}")
