"""Covers: launch/lockstep.py, launch/watchdog.py, launch/cli.py, black-box.

One ``python -m launch`` run of a child suite with every fault kind at 2 ranks:
each fault fails only its own test, with the rank and test named, and the
tests after it still run in a fresh world. A plain torchrun run with
rank-dependent collection stops before any test runs.
"""

from __future__ import annotations

import re

FAULTS = '''
import os, signal, time
import pytest, torch, torch.distributed as dist

def test_ok_first():
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == 2

def test_fails_on_rank1_only():
    assert dist.get_rank() != 1, "only rank 1 fails"

def test_skips_on_one_rank():
    if dist.get_rank() == 1:
        pytest.skip("rank 1 skips")

@pytest.mark.world_size(1)
def test_sub_world_of_one(world):
    assert world.ranks == (0,) and dist.get_world_size(world.group) == 1

@pytest.mark.world_size(4)
def test_needs_more_ranks(world):
    raise AssertionError("must not run")

@pytest.mark.timeout(5)
def test_hangs_on_rank1():
    if dist.get_rank() == 1:
        while True:
            time.sleep(0.05)  # HANG-LINE

def test_after_hang():
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == 2

def test_rank1_killed():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1); dist.all_reduce(t)

@pytest.mark.timeout(5)
def test_raises_before_collective():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 raised before all_reduce")
    t = torch.ones(1); dist.all_reduce(t)

def test_last():
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == 2
'''


def test_every_fault_is_reported_and_the_run_continues(child) -> None:
    c = child({"test_faults.py": FAULTS}, "-m", "launch", "--nproc-per-node", "2",
              "--", "-q", "-p", "no:cacheprovider", "--junitxml=junit.xml", "test_faults.py")
    out = c.out
    assert c.rc == 1, out
    assert c.outcomes == {
        "test_ok_first": "passed",
        "test_fails_on_rank1_only": "failed",
        "test_skips_on_one_rank": "error",
        "test_sub_world_of_one": "passed",
        "test_needs_more_ranks": "skipped",
        "test_hangs_on_rank1": "failed",
        "test_after_hang": "passed",
        "test_rank1_killed": "failed",
        "test_raises_before_collective": "failed",
        "test_last": "passed",
    }, out
    # rank-dependent failure and skip
    assert "failed on rank 1 of 2 (rank 0: passed)" in out and "only rank 1 fails" in out
    assert "skipped on ranks 1 (rank 1 skips)" in out
    # hang: which test, which rank, where
    hang_line = FAULTS.splitlines().index("            time.sleep(0.05)  # HANG-LINE") + 1
    assert "timed out after 5 s during test_faults.py::test_hangs_on_rank1" in out
    assert re.search(rf"rank 1: stuck at \S*test_faults.py:{hang_line} in test_hangs_on_rank1", out), out
    # dead rank: named with its test
    assert "rank 1: DIED during test_faults.py::test_rank1_killed" in out
    # raise before a collective: the stuck peer and the rank that raised
    assert re.search(r"rank 0: stuck in collective all_reduce at \S*test_faults.py:\d+", out), out
    assert "rank 1 failed first" in out and "rank 1 raised before all_reduce" in out
    # stacks in every rank's log
    logs = list(c.dir.glob(".launch-logs/*/rank1.log"))
    assert logs and "Python stacks" in logs[0].read_text()
    # bounded: 3 restarts of a 2-rank world plus two 5 s timeouts
    assert c.seconds < 200, c.seconds


MISMATCH = '''
import os, pytest

@pytest.mark.parametrize("k", range(int(os.environ["RANK"]) + 2))
def test_per_rank(k):
    pass
'''


def test_collections_that_differ_stop_every_rank_before_any_test(child) -> None:
    c = child({"test_mismatch.py": MISMATCH}, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node=2", "-m", "pytest", "-q", "-p", "no:cacheprovider",
              "test_mismatch.py", timeout=120)
    assert c.rc != 0
    assert "ranks collected different tests; no test was run" in c.out, c.out
    assert ("first difference at test #2: rank 0 has (end of list), rank 1 has "
            "test_mismatch.py::test_per_rank[2]") in c.out, c.out
    assert " passed" not in c.out
