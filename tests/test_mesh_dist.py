"""Covers: dtensor/mesh.py on Gloo worlds (and single-process geometry)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtensor import DeviceMesh, MeshError, current_mesh, init_device_mesh


def _geometry_mesh(grid, names=None) -> DeviceMesh:
    # _init_backend=False: pure geometry, whatever world this process is in.
    return DeviceMesh("cpu", grid, mesh_dim_names=names, _init_backend=False)


def test_mesh_geometry() -> None:
    mesh = _geometry_mesh([[0, 1], [2, 3]], ("dp", "tp"))
    assert mesh.shape == (2, 2) and mesh.ndim == 2 and mesh.size() == 4
    assert mesh.size("tp") == 2
    r = mesh.get_rank()
    assert mesh.get_coordinate() == ((r // 2, r % 2) if r < 4 else None)
    if r == 0:
        assert mesh["tp"].mesh.tolist() == [0, 1] and mesh["dp"].mesh.tolist() == [0, 2]
        assert mesh["tp", "dp"].mesh.tolist() == [[0, 2], [1, 3]]
    assert hash(mesh) == hash(_geometry_mesh([[0, 1], [2, 3]], ("dp", "tp")))
    assert repr(mesh) == "DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))"


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("cpu", [0, 0]), {}, "each rank may appear once"),
        (("cpu", []), {}, "empty"),
        (("cpu", [[0]]), {"mesh_dim_names": ("a",)}, "expected 2 unique mesh_dim_names"),
        ((0, [0]), {}, "device_type must be a str"),
    ],
)
def test_bad_meshes_raise(args, kwargs, match) -> None:
    with pytest.raises(MeshError, match=match):
        DeviceMesh(*args, **kwargs)


def test_bad_axis_names_raise() -> None:
    mesh = _geometry_mesh([[0, 1]], ("dp", "tp"))
    with pytest.raises(MeshError, match="no axis named 'pp'"):
        mesh["pp"]
    with pytest.raises(MeshError, match="out of range"):
        mesh.size(2)


def test_with_mesh_nests_and_restores_on_error() -> None:
    a, b = _geometry_mesh([0]), _geometry_mesh([[0]])
    assert current_mesh() is None
    with a:
        with pytest.raises(ValueError), b:
            assert current_mesh() is b
            raise ValueError
        assert current_mesh() is a
    assert current_mesh() is None


@pytest.mark.world_size(4)
def test_mesh_coordinates_groups_and_submeshes(world) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    r = world.rank
    assert mesh.get_coordinate() == (r // 2, r % 2)
    assert mesh.get_local_rank("tp") == r % 2 and mesh.get_local_rank("dp") == r // 2
    tp = mesh["tp"]
    assert tp.mesh.tolist() == [r // 2 * 2, r // 2 * 2 + 1]
    # The tp group reduces over this rank's row only.
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=mesh.get_group("tp"))
    assert t.item() == sum(tp.mesh.tolist())
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=mesh.get_group("dp"))
    assert t.item() == sum(mesh["dp"].mesh.tolist())


@pytest.mark.world_size(4)
def test_submesh_of_some_ranks_built_by_members_only(world) -> None:
    # Ranks with different group histories (rank 0 and 1 build an extra mesh)
    # must still agree on the next group; outsiders never take part.
    if world.rank in (0, 1):
        DeviceMesh("cpu", [0, 1])
    if world.rank in (0, 2):
        mesh = DeviceMesh("cpu", [0, 2])
        t = torch.tensor([1.0])
        dist.all_reduce(t, group=mesh.get_group())
        assert t.item() == 2.0
    outside = DeviceMesh("cpu", [1, 3])
    if world.rank in (0, 2):
        assert outside.get_coordinate() is None and outside.get_group() is None
        with pytest.raises(MeshError, match="not in"):
            outside.get_local_rank()


@pytest.mark.world_size(2)
def test_init_device_mesh_checks_the_world_size(world) -> None:
    # init_device_mesh spans the whole process world, which under a larger
    # torchrun world is bigger than this test's sub-world.
    n = torch.distributed.get_world_size()
    with pytest.raises(MeshError, match=f"holds {n + 1} ranks but the world has {n}"):
        init_device_mesh("cpu", (n + 1,))
