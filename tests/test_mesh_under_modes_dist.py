"""Covers: dtensor/_mesh_layout.py (``real_tensors``) and its users in
dtensor/_mesh_build.py and dtensor/mesh.py: meshes made, sliced, flattened,
printed and pickled under ``FakeTensorMode`` or ``with torch.device("meta")``
hold real CPU grids, and a mesh made under such a mode leaves every later
mesh of its layout alone. (PyTorch's ``init_device_mesh`` raises under
``FakeTensorMode``; a grid kept from one would break later meshes.)"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch._subclasses import FakeTensorMode

from dtensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor, init_device_mesh


def _geometry(grid, names) -> DeviceMesh:
    return DeviceMesh("cpu", grid, mesh_dim_names=names, _init_backend=False)


@pytest.mark.parametrize("mode", ["fake", "meta"])
def test_a_mesh_made_under_a_mode_is_real_and_leaves_later_meshes_alone(mode) -> None:
    # Ranks no other test uses, so this layout is made here first; no world
    # this suite runs in holds them, so every rank sees the same sub-meshes.
    grid = [[4013, 4002], [4007, 4005]] if mode == "fake" else [[4023, 4004], [4009, 4006]]
    ctx = FakeTensorMode() if mode == "fake" else torch.device("meta")
    with ctx:
        mesh = _geometry(grid, ("a", "b"))
        assert type(mesh.mesh) is torch.Tensor and mesh.mesh.device.type == "cpu"
        assert mesh.get_coordinate() is None  # an outsider: slices at coordinate 0
        assert mesh["b"].ranks == tuple(grid[0])
        assert mesh["a"].ranks == tuple(row[0] for row in grid)
        assert mesh["b", "a"].ranks == tuple(r for c in zip(*grid) for r in c)
        assert mesh.flatten("ab").ranks == tuple(r for row in grid for r in row)
        assert str(grid) in repr(mesh)
    again = _geometry(grid, ("a", "b"))
    assert again.mesh.tolist() == grid and again["a"].mesh.tolist() == [grid[0][0], grid[1][0]]
    assert torch.equal(again.flatten("ab").mesh, torch.tensor([r for row in grid for r in row]))


@pytest.mark.world_size(2)
def test_init_device_mesh_under_fake_tensors_and_a_meta_device(world) -> None:
    with FakeTensorMode():
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
        assert type(mesh.mesh) is torch.Tensor and mesh.get_coordinate() == (world.rank, 0)
        d = DTensor.from_local(torch.empty(3, 4), mesh, [Shard(0), Replicate()])
        assert type(d.to_local()).__name__ == "FakeTensor" and d.shape == (6, 4)
        assert pickle.loads(pickle.dumps(mesh)) == mesh
    with torch.device("meta"):
        flat = init_device_mesh("cpu", (1, 2), mesh_dim_names=("x", "y"))["y"]
    assert flat.mesh.device.type == "cpu" and flat.mesh.tolist() == [0, 1]
    after = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    assert after == mesh
    x = torch.arange(8.0).view(4, 2)
    got = distribute_tensor(x, after, [Shard(0), Replicate()])
    assert torch.equal(got.to_local(), x.chunk(2)[world.rank])
    assert torch.equal(got.full_tensor(), x)
