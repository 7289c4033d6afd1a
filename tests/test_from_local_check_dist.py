"""Covers: dtensor/_local_check.py (``from_local(run_check=True)``) on Gloo worlds.

Every bad input must raise the same ``ValueError`` on every rank (a rank that
raised alone would leave the others blocked: the test would hang, not pass).
"""

from __future__ import annotations

import pytest
import torch

from dtensor import (
    DeviceMesh,
    DTensor,
    Partial,
    PlacementError,
    Replicate,
    Shard,
    distribute_tensor,
)


@pytest.mark.world_size(4)
def test_replicas_of_different_shapes_fail_on_every_rank_naming_them(
    line_mesh, world
) -> None:
    local = torch.ones(world.rank + 1, 2)  # (1,2) ... (4,2)
    with pytest.raises(ValueError, match=r"rank 1 has \(2, 2\), expected \(1, 2\)") as e:
        DTensor.from_local(local, line_mesh(4), [Replicate()], run_check=True)
    assert isinstance(e.value, PlacementError)
    assert "rank 3 has (4, 2)" in str(e.value)


@pytest.mark.world_size(2)
def test_block_with_other_ndim_or_dtype_fails_on_every_rank(line_mesh, world) -> None:
    local = torch.ones(2, 2, 1) if world.rank == 1 else torch.ones(2, 2)
    with pytest.raises(PlacementError, match=r"ndim: rank 0: 2; rank 1: 3"):
        DTensor.from_local(local, line_mesh(2), [Shard(0)], run_check=True)
    local = torch.ones(2, dtype=torch.float64 if world.rank else torch.float32)
    with pytest.raises(PlacementError, match=r"dtype: rank 0: torch.float32; rank 1: torch.float64"):
        DTensor.from_local(local, line_mesh(2), [Shard(0)], run_check=True)


@pytest.mark.world_size(2)
def test_placements_that_differ_across_ranks_fail_on_every_rank(
    line_mesh, world
) -> None:
    # Shard(2) does not even fit rank 1's 2-D block: still one error everywhere.
    placements = [Shard(2)] if world.rank == 1 else [Shard(0)]
    with pytest.raises(PlacementError, match="arguments: rank 0: digest"):
        DTensor.from_local(torch.ones(2, 2), line_mesh(2), placements, run_check=True)
    with pytest.raises(PlacementError, match="arguments"):
        DTensor.from_local(
            torch.ones(2, 2), line_mesh(2), [Shard(0)], shape=(4 + world.rank, 2), run_check=True
        )


@pytest.mark.world_size(2)
def test_uneven_blocks_without_shape_are_inferred_from_all_ranks(
    line_mesh, world
) -> None:
    full = torch.arange(15.0).reshape(5, 3)
    local = full[:3] if world.rank == 0 else full[3:]
    x = DTensor.from_local(local, line_mesh(2), [Shard(0)], run_check=True)
    assert x.shape == (5, 3)
    assert torch.equal(x.full_tensor(), full)
    # Blocks that are no torch.chunk layout (2 rows then 3) are rejected.
    local = full[:2] if world.rank == 0 else full[2:]
    with pytest.raises(PlacementError, match=r"rank 0 has \(2, 3\), expected \(3, 3\)"):
        DTensor.from_local(local, line_mesh(2), [Shard(0)], run_check=True)


@pytest.mark.world_size(4)
def test_uneven_nested_shards_on_a_2d_mesh_are_inferred(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    full = torch.arange(7.0 * 5).reshape(7, 5)
    local = distribute_tensor(full, mesh, [Shard(0), Shard(1)]).to_local()
    x = DTensor.from_local(local, mesh, [Shard(0), Shard(1)], run_check=True)
    assert x.shape == (7, 5)
    assert torch.equal(x.full_tensor(), full)


@pytest.mark.world_size(2)
def test_given_shape_is_checked_on_every_rank(line_mesh, world) -> None:
    rows = 3  # right on rank 0 for 5 rows; rank 1 should hold 2
    with pytest.raises(PlacementError, match=r"rank 1 has \(3, 3\), expected \(2, 3\)"):
        DTensor.from_local(torch.ones(rows, 3), line_mesh(2), [Shard(0)], shape=(5, 3), run_check=True)


@pytest.mark.world_size(2)
def test_replicate_takes_the_first_ranks_values_and_keeps_the_gradient(
    line_mesh, world
) -> None:
    local = torch.full((2, 2), float(world.rank + 1), requires_grad=True)
    x = DTensor.from_local(local, line_mesh(2), [Replicate()], run_check=True)
    assert torch.equal(x.to_local(), torch.ones(2, 2))
    x.to_local().sum().backward()
    assert torch.equal(local.grad, torch.ones(2, 2))
    # Partial and Shard axes keep each rank's own values.
    y = DTensor.from_local(torch.full((2,), float(world.rank)), line_mesh(2), [Partial()], run_check=True)
    assert torch.equal(y.full_tensor(), torch.ones(2))


@pytest.mark.world_size(4)
def test_replicate_on_one_axis_of_a_2d_mesh_broadcasts_along_that_axis(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    local = torch.full((1, 2), float(world.rank))
    x = DTensor.from_local(local, mesh, [Shard(0), Replicate()], run_check=True)
    # Rows of the mesh hold ranks (0, 1) and (2, 3): values of 0 and 2.
    assert torch.equal(x.full_tensor(), torch.tensor([[0.0, 0.0], [2.0, 2.0]]))


@pytest.mark.world_size(2)
def test_meta_blocks_are_checked_without_values(line_mesh, world) -> None:
    local = torch.empty(3 if world.rank == 0 else 2, 4, device="meta")
    x = DTensor.from_local(local, line_mesh(2), [Shard(0)], run_check=True)
    assert x.shape == (5, 4) and x.to_local().is_meta
    mixed = torch.empty(2, 4, device="meta" if world.rank else "cpu")
    with pytest.raises(PlacementError, match=r"meta: rank 0: False; rank 1: True"):
        DTensor.from_local(mixed, line_mesh(2), [Shard(0)], run_check=True)


@pytest.mark.world_size(4)
def test_sub_mesh_members_check_and_outsiders_do_not_block(world) -> None:
    mesh = DeviceMesh("cpu", [1, 2])
    local = torch.ones(world.rank, 2)
    if world.rank in (1, 2):
        with pytest.raises(PlacementError, match=r"rank 2 has \(2, 2\), expected \(1, 2\)"):
            DTensor.from_local(local, mesh, [Replicate()], run_check=True)
    else:  # outsiders hold empty blocks and take no part
        x = DTensor.from_local(local, mesh, [Replicate()], run_check=True)
        assert x.to_local().numel() == 0


@pytest.mark.world_size(2)
def test_global_stride_follows_the_blocks_stride_as_in_pytorch(
    line_mesh, world
) -> None:
    mesh = line_mesh(2)
    assert DTensor.from_local(torch.ones(4, 8), mesh, [Shard(0)]).stride() == (8, 1)
    assert DTensor.from_local(torch.ones(8, 4), mesh, [Shard(1)]).stride() == (8, 1)
    permuted = torch.ones(8, 4, 8).permute(1, 2, 0)  # stride (8, 1, 32)
    x = DTensor.from_local(permuted, mesh, [Shard(1)])
    assert x.shape == (4, 16, 8) and x.stride() == (16, 1, 64)
    assert torch.equal(x.full_tensor(), torch.ones(4, 16, 8))


@pytest.mark.world_size(2)
def test_a_transposed_block_on_one_rank_fails_the_check_on_every_rank(
    line_mesh, world
) -> None:
    local = torch.ones(4, 4)
    if world.rank == 0:
        local = local.t().contiguous().t()  # same shape, transposed strides
    with pytest.raises(PlacementError, match=r"stride: rank 0: \(1, 4\); rank 1: \(4, 1\)"):
        DTensor.from_local(local, line_mesh(2), [Replicate()], run_check=True)
    # Contiguous uneven blocks have different strides and pass.
    x = DTensor.from_local(torch.ones(3, 3 - world.rank), line_mesh(2), [Shard(1)], run_check=True)
    assert x.shape == (3, 5) and x.stride() == (5, 1)
