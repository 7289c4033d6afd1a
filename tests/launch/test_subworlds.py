"""Covers: launch/rank/subworld.py and launch/rank/core.py, black-box: under a torchrun
world of N ranks a world_size(n) test sees a world of exactly n, with bare
collectives (no ``group=``), ``dist.get_world_size()``, ``dist.barrier()``,
``dist.new_group``, ``all_gather`` and the env, and the full world is back afterwards."""

from __future__ import annotations

import pytest

BARE = '''
import os
import pytest, torch, torch.distributed as dist

def _sum_of_ones():
    t = torch.ones(1)
    dist.all_reduce(t)          # no group=: the test's world
    return int(t.item())

@pytest.mark.world_size(2)
def test_two(world):
    assert dist.get_world_size() == 2 == world.size
    assert dist.get_rank() == world.rank == int(os.environ["RANK"]) < 2
    assert os.environ["WORLD_SIZE"] == "2"
    assert _sum_of_ones() == 2
    dist.barrier()
    assert world.group is dist.group.WORLD
    g = dist.new_group([0, 1])
    t = torch.ones(1); dist.all_reduce(t, group=g); assert t.item() == 2

def test_whole_world():
    n = int(os.environ["WORLD_SIZE"])
    assert dist.get_world_size() == n and _sum_of_ones() == n

@pytest.mark.world_size(2)
def test_two_again_reuses_its_groups(world):
    assert _sum_of_ones() == 2
    ranks = [torch.zeros(1), torch.zeros(1)]
    dist.all_gather(ranks, torch.tensor([float(dist.get_rank())]))
    assert [int(r.item()) for r in ranks] == [0, 1]

@pytest.mark.world_size(3)
def test_three(world):
    assert _sum_of_ones() == 3 == dist.get_world_size()
    dist.barrier()

@pytest.mark.world_size(1)
def test_one(world):
    assert _sum_of_ones() == 1 and dist.get_rank() == 0

@pytest.mark.world_size(2)
def test_fails_in_sub_world_rank1(world):
    assert dist.get_rank() == 0, "sub-world rank 1 fails"

def test_whole_world_at_the_end():
    n = int(os.environ["WORLD_SIZE"])
    assert _sum_of_ones() == n
'''


@pytest.mark.parametrize("n", [4, 8])
def test_bare_collectives_see_the_sub_world(child, n) -> None:
    c = child({"test_bare.py": BARE}, "-m", "torch.distributed.run", "--standalone",
              f"--nproc-per-node={n}", "-m", "pytest", "-q", "-p", "no:cacheprovider",
              "--dist-timeout=120", "--junitxml=junit.xml", "test_bare.py",
              timeout=400)
    expected = {name: "passed" for name in (
        "test_two", "test_whole_world", "test_two_again_reuses_its_groups",
        "test_three", "test_one", "test_whole_world_at_the_end")}
    expected["test_fails_in_sub_world_rank1"] = "failed"
    assert c.outcomes == expected, c.out
    assert "failed on rank 1 of 2" in c.out, c.out  # named in the sub-world
    assert c.rc == 1


pytestmark = pytest.mark.slow  # starts several worlds or compiles: the full run, not the quick tier
