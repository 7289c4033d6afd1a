"""Covers: launch/parent.py and launch/server.py, black-box: plain pytest runs
world_size-marked tests in worlds it launches, reports them as ordinary
results, and replaces a world that a hang or a dead rank broke."""

from __future__ import annotations

SUITE = '''
import os, signal, time
import pytest, torch, torch.distributed as dist

W2 = pytest.mark.world_size(2)

def test_local():
    assert not dist.is_initialized()

@W2
def test_fails_on_rank1_only(world):
    assert world.rank != 1, "only rank 1 fails"

@W2
def test_skips_on_one_rank(world):
    if world.rank == 1:
        pytest.skip("rank 1 skips")

@W2
@pytest.mark.timeout(5)
def test_hangs_on_rank1(world):
    if world.rank == 1:
        while True:
            time.sleep(0.05)

@W2
def test_after_hang(world):
    t = torch.ones(1); dist.all_reduce(t, group=world.group); assert t.item() == 2

@W2
def test_rank1_killed(world):
    if world.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1); dist.all_reduce(t, group=world.group)

@W2
def test_last(world):
    t = torch.ones(1); dist.all_reduce(t, group=world.group); assert t.item() == 2
'''


def test_faults_in_launched_worlds(child) -> None:
    c = child({"test_suite.py": SUITE}, "-m", "pytest", "-q", "-p", "no:cacheprovider",
              "--junitxml=junit.xml", "test_suite.py")
    out = c.out
    assert c.rc == 1, out
    assert c.outcomes == {
        "test_local": "passed",
        "test_fails_on_rank1_only": "failed",
        "test_skips_on_one_rank": "error",
        "test_hangs_on_rank1": "failed",
        "test_after_hang": "passed",
        "test_rank1_killed": "failed",
        "test_last": "passed",
    }, out
    assert "failed on rank 1 of 2 (rank 0: passed)" in out and "only rank 1 fails" in out
    assert "timed out after 5 s during test_suite.py::test_hangs_on_rank1" in out
    assert "rank 1: stuck at" in out
    assert "rank 1: DIED during test_suite.py::test_rank1_killed" in out
    assert c.seconds < 200, c.seconds


def test_k_and_x_select_and_stop_like_local_tests(child) -> None:
    c = child({"test_suite.py": SUITE}, "-m", "pytest", "-q", "-p", "no:cacheprovider",
              "-x", "-k", "fails_on_rank1 or after_hang or last", "test_suite.py")
    assert c.rc == 1
    assert "1 failed" in c.out and "passed" not in c.out.splitlines()[-1], c.out


XDIST = '''
import pytest, torch, torch.distributed as dist

@pytest.mark.world_size(2)
def test_{0}(world):
    t = torch.ones(1); dist.all_reduce(t, group=world.group); assert t.item() == 2
'''


def test_xdist_workers_launch_separate_worlds(child) -> None:
    c = child({"test_a.py": XDIST.format("a"), "test_b.py": XDIST.format("b")},
              "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "test_a.py", "test_b.py")
    assert c.rc == 0, c.out
    assert "2 passed" in c.out
