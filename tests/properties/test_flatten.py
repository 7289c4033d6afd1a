"""Covers: dtensor/mesh.py and dtensor/_mesh_build.py — flattened mesh axes
(``mesh["dp", "cp"]._flatten("dp_cp")``, how torchtitan and FSDP build their
data-parallel axis) and the process group dtensor/_comm.py makes for them.

Property, on named meshes over the whole world (2-D and 3-D) and any sub-mesh
of their axes (in any order): the flattened mesh's rank tensor is the
reference sub-mesh's, flattened row-major (built element by element from the
parent's grid, not by the runtime's slicing); the root learns the name
(``root[name]`` has the same ranks); ``get_coordinate``/``get_local_rank``/
``size`` agree with the per-rank oracle; the axis group holds exactly the
flattened ranks in that order; tensors distributed and redistributed on it
hold the single-device blocks.

Under ``torchrun --nproc_per_node=4`` this runs in lockstep beside the 2-rank
sub-world tests (ranks 0-1 swap sub-worlds in and out, ranks 2-3 never do);
it once hung there (ranks 2-3 in a broadcast on the flattened mesh) while a
group-cache hook dropped the 4-rank world's groups on ranks 0-1 only. See
tests/test_mesh_dist.py for the deterministic regression test.
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

pytestmark = pytest.mark.dist_timeout(180)


@given(data=st.data())
def test_flattened_axes_lay_out_like_one_axis(n_ranks, world, impl, data):
    if impl.name != "dtensor":
        pytest.skip(f"{impl.name}: flattening is private API there (_flatten); "
                    "covered for dtensor")
    import torch.distributed as dist

    case = data.draw(named_sub_meshes(world_size=world.size), label="mesh")
    x = data.draw(tensors(), label="tensor")
    src = data.draw(placements(mesh_ndim=1, tensor_ndim=x.ndim, allow_partial=False),
                    label="placements")
    dst = data.draw(placements(mesh_ndim=1, tensor_ndim=x.ndim, allow_partial=False),
                    label="redistribute to")
    parent = impl.named_mesh(case.layout, case.names)
    name = "_".join(case.picked) + "_flat"
    flat = parent[case.picked]._flatten(name)
    ref = case.sub_grid(world.rank).flatten().tolist()
    where = f"rank {world.rank}: {case}: flattened as {name!r}"
    assert flat.mesh.tolist() == ref, (
        f"{where}: rank tensor {flat.mesh.tolist()}, expected {ref}")
    assert flat.mesh_dim_names == (name,), (
        f"{where}: mesh_dim_names {flat.mesh_dim_names}, expected {(name,)}")
    again = parent[name]
    assert again.mesh.tolist() == ref, (
        f"{where}: parent[{name!r}] has ranks {again.mesh.tolist()}, expected {ref}")
    assert again.get_coordinate() == (ref.index(world.rank),), (
        f"{where}: parent[{name!r}].get_coordinate() is {again.get_coordinate()}, "
        f"expected {(ref.index(world.rank),)}")
    assert_coordinate(flat, msg=f"{case}: flattened {case.picked}")
    group = flat.get_group(name)
    ranks = list(dist.get_process_group_ranks(group))
    assert ranks == ref, f"{where}: the axis group has ranks {ranks}, expected {ref}"
    dt = impl.distribute_tensor(x, flat, impl.placements(src))
    moved = dt.redistribute(flat, impl.placements(dst))
    assert_matches_single_device(dt, x, msg=f"distribute_tensor {src} on flattened {case}")
    assert_matches_single_device(moved, x, msg=f"redistribute {src} -> {dst} on flattened {case}")
