"""Covers: launch/plugin.py's ``world`` fixture on real Gloo worlds, in both
modes (plain pytest launches the worlds; under torchrun they are sub-worlds)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


@pytest.mark.world_size(2)
def test_all_reduce_on_two_ranks(world) -> None:
    assert world.ranks == (0, 1) and world.rank in world.ranks
    t = torch.tensor([float(world.rank + 1)])
    dist.all_reduce(t, group=world.group)
    assert t.item() == 3.0


@pytest.mark.world_size(4)
def test_all_reduce_on_four_ranks(world) -> None:
    t = torch.ones(2)
    dist.all_reduce(t, group=world.group)
    assert t.tolist() == [4.0, 4.0]
    assert dist.get_world_size(world.group) == 4


@pytest.mark.world_size(2)
def test_every_rank_is_seeded_identically(world) -> None:
    mine = torch.rand(3)
    gathered = [torch.empty(3) for _ in range(2)]
    dist.all_gather(gathered, mine, group=world.group)
    assert torch.equal(gathered[0], gathered[1])


def test_single_process_world_without_a_process_group(world) -> None:
    if dist.is_initialized():  # under torchrun this runs on every rank
        assert world.size == dist.get_world_size()
    else:
        assert (world.rank, world.size, world.ranks, world.group) == (0, 1, (0,), None)
