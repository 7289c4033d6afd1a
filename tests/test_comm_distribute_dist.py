"""Covers: dtensor/distribute.py ``distribute_tensor`` scattering shards from
the source rank (dtensor/_comm.py ``scatter``) where a broadcast sent the
whole tensor to every rank, and the errors PyTorch's DTensor raises for
unsound input (dtensor/tensor.py ``from_local`` of a DTensor,
``distribute_tensor`` of a DTensor laid out otherwise, dtensor/_persist.py
a checkpoint shard of a Partial DTensor)."""

from __future__ import annotations

import pytest
import torch

from dtensor import DeviceMesh, DTensor, Partial, PlacementError, Replicate, Shard, distribute_tensor
from dtensor.debug import CommDebugMode

LAYOUTS_2D = [
    (Shard(0), Shard(1)),
    (Shard(0), Shard(0)),
    (Replicate(), Shard(1)),
    (Shard(1), Replicate()),
    (Shard(0), Partial()),
    (Partial("max"), Shard(0)),
]


def _x(shape, dtype=torch.float32) -> torch.Tensor:
    # Every rank draws the same values; each rank's own copy is spoiled below.
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    return x.to(dtype)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("rows", [8, 5, 2], ids=["even", "uneven", "empty-shards"])
def test_shard_is_scattered_from_the_source(world, rows) -> None:
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    x = _x((rows, 3))
    mine = x + world.rank  # only rank 0's copy counts
    with CommDebugMode() as comm:
        d = distribute_tensor(mine, mesh, [Shard(0)])
    counts = comm.get_comm_counts()
    assert counts["scatter"] == 1 and comm.get_total_counts() == 1, counts  # PyTorch: 1 scatter
    # the buffer of one scatter: n pieces of the largest block, not n copies of x
    assert comm.get_total_bytes() == 4 * -(-rows // 4) * 3 * 4
    torch.testing.assert_close(d.full_tensor(), x)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("layout", LAYOUTS_2D, ids=str)
@pytest.mark.parametrize("src", [0, 1])
def test_2d_layouts_hold_the_source_copy(world, layout, src) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    x = _x((5, 6))
    coord = mesh.get_coordinate()
    source = coord == (src, src)
    d = distribute_tensor(x if source else x * 0 - 7, mesh, list(layout), src_data_rank=src)
    assert d.placements == layout
    torch.testing.assert_close(d.full_tensor(), x)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64, torch.int16], ids=str)
def test_scatter_carries_dtypes_gloo_lacks(world, dtype) -> None:
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    x = (_x((6, 2)) > 0).to(dtype) if dtype != torch.complex64 else _x((6, 2)).to(dtype) * 1j
    d = distribute_tensor(x, mesh, [Shard(0)])
    assert d.dtype == dtype
    assert torch.equal(d.full_tensor(), x)


@pytest.mark.world_size(4)
def test_from_local_of_a_dtensor_raises(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    d = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    with pytest.raises(PlacementError, match=r"got a DTensor .* x\.to_local\(\)"):
        DTensor.from_local(d, mesh, [Shard(0)])


@pytest.mark.world_size(4)
def test_distribute_tensor_of_a_dtensor(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    d = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    assert distribute_tensor(d, mesh, [Shard(0)]) is d  # as PyTorch: already so
    with pytest.raises(ValueError, match="redistribute"):  # PyTorch: ValueError
        distribute_tensor(d, mesh, [Replicate()])
    with pytest.raises(ValueError, match="redistribute"):
        distribute_tensor(d, DeviceMesh("cpu", [[0, 1], [2, 3]]), [Shard(0), Replicate()])


@pytest.mark.world_size(4)
def test_checkpoint_shard_of_a_partial_names_the_problem(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    p = DTensor.from_local(torch.ones(2), mesh, [Partial()])
    with pytest.raises(ValueError, match="Partial"):  # PyTorch: ValueError
        p.__get_tensor_shard__(0)
