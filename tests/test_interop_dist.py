"""Covers: dtensor/interop.py (to_torch / from_torch) on Gloo worlds."""

from __future__ import annotations

import pytest
import torch
from torch.distributed import tensor as ttensor

from dtensor import (
    DeviceMesh,
    DTensor,
    Partial,
    PlacementError,
    Replicate,
    Shard,
    StridedShard,
    distribute_tensor,
)
from dtensor.interop import from_torch, to_torch

TORCH = {Shard: ttensor.Shard, Replicate: ttensor.Replicate, Partial: ttensor.Partial}


def _check_pair(ours, theirs) -> None:
    assert isinstance(theirs, ttensor.DTensor) and isinstance(ours, DTensor)
    assert tuple(theirs.shape) == tuple(ours.shape) and theirs.stride() == ours.stride()
    assert theirs.device_mesh.mesh.tolist() == ours.device_mesh.mesh.tolist()
    for a, b in zip(ours.placements, theirs.placements, strict=True):
        assert type(b) is TORCH[type(a)]
        assert getattr(a, "dim", None) == getattr(b, "dim", None)
        assert getattr(a, "reduce_op", None) == getattr(b, "reduce_op", None)
    if ours.device_mesh.get_coordinate() is not None:
        assert theirs.to_local().data_ptr() == ours.to_local().data_ptr()  # no copy
        assert torch.equal(theirs.to_local(), ours.to_local())


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    "placements",
    [[Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Partial("max")], [Shard(0), Shard(0)]],
)
def test_round_trip_shares_storage_on_2x2_uneven(world, placements) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    full = torch.arange(35.0).reshape(7, 5)
    x = distribute_tensor(full, mesh, placements)
    t = to_torch(x)
    _check_pair(x, t)
    if not any(p.is_partial() for p in placements):
        # PyTorch's DTensor computes over our process groups.
        assert torch.equal(t.full_tensor(), full)
    back = from_torch(t)
    _check_pair(back, t)
    assert back.device_mesh == mesh and back.placements == x.placements
    assert torch.equal(back.full_tensor(), x.full_tensor())


@pytest.mark.world_size(2)
def test_torch_dtensor_comes_over_and_meshes_map_once(world) -> None:
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    tmesh = TorchMesh.from_group(world.group, "cpu", mesh_dim_names=("tp",))
    t = ttensor.distribute_tensor(torch.arange(10.0), tmesh, [ttensor.Shard(0)])
    x = from_torch(t)
    _check_pair(x, t)
    assert x.device_mesh.mesh_dim_names == ("tp",)
    assert torch.equal((x * 2).full_tensor(), torch.arange(10.0) * 2)
    assert from_torch(t).device_mesh is x.device_mesh
    assert to_torch(x).device_mesh is to_torch(x).device_mesh


@pytest.mark.world_size(2)
def test_gradients_cross_both_ways(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    x = distribute_tensor(torch.arange(6.0), mesh, [Shard(0)]).requires_grad_()
    t = to_torch(x)
    (t * t).sum().backward()  # PyTorch's DTensor ops, our leaf
    assert isinstance(x.grad, DTensor)
    assert torch.equal(x.grad.full_tensor(), 2 * torch.arange(6.0))

    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    tmesh = TorchMesh.from_group(world.group, "cpu")
    tleaf = ttensor.distribute_tensor(torch.arange(4.0), tmesh, [ttensor.Shard(0)])
    tleaf.requires_grad_()
    (from_torch(tleaf) * 3).sum().backward()  # our ops, PyTorch's leaf
    assert torch.equal(tleaf.grad.full_tensor(), torch.full((4,), 3.0))


@pytest.mark.world_size(2)
def test_sub_mesh_outsider_gets_an_empty_block(world) -> None:
    mesh = DeviceMesh("cpu", [1])
    x = distribute_tensor(torch.arange(3.0), mesh, [Shard(0)])
    t = to_torch(x)
    _check_pair(x, t)
    back = from_torch(t)
    assert back.device_mesh == mesh
    if world.rank == 0:
        assert back.to_local().numel() == 0
    else:
        assert torch.equal(back.to_local(), torch.arange(3.0))


@pytest.mark.world_size(2)
def test_bad_input_is_a_clear_error_on_every_rank(world) -> None:
    with pytest.raises(PlacementError, match=r"expected a dtensor\.DTensor, got Tensor"):
        to_torch(torch.ones(2))
    with pytest.raises(ValueError, match=r"expected a torch.distributed.tensor.DTensor"):
        from_torch(torch.ones(2))
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh
    from torch.distributed.tensor.placement_types import _StridedShard

    tmesh = TorchMesh.from_group(world.group, "cpu")
    t = ttensor.DTensor.from_local(torch.ones(2, 2), tmesh, [_StridedShard(0, split_factor=2)])
    assert from_torch(t).placements == (StridedShard(0, 2),)  # a counterpart, kept
    assert to_torch(from_torch(t)).placements == (_StridedShard(0, split_factor=2),)
    from torch.distributed.tensor.placement_types import _MaskPartial

    t = ttensor.DTensor.from_local(torch.ones(2, 2), tmesh, [_MaskPartial()])
    with pytest.raises(PlacementError, match="no dtensor counterpart"):
        from_torch(t)
