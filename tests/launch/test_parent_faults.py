"""Covers: launch/modes/parent.py and launch/modes/server.py, black-box: plain pytest runs
world_size-marked tests in worlds it launches, reports them as ordinary
results (``-k``, ``-x``, ``--lf``, junit), and replaces a world that a hang or a
dead rank broke; pytest-xdist workers launch separate worlds."""

from __future__ import annotations

import re

SUITE = '''
import os, signal, time
import pytest, torch, torch.distributed as dist

W2 = pytest.mark.world_size(2)

def test_local():
    assert not dist.is_initialized()

@W2
def test_fails_on_rank1_only(world, stamp):
    stamp("first")
    assert world.rank != 1, "only rank 1 fails"

@W2
def test_skips_on_one_rank(world):
    if world.rank == 1:
        pytest.skip("rank 1 skips")

@W2
@pytest.mark.parametrize("r", [os.environ.get("RANK", "0")])
def test_collected_per_rank(world, r):
    pass

@W2
@pytest.mark.timeout(3)
def test_hangs_on_rank1(world, stamp):
    stamp("hang")
    if world.rank == 1:
        while True:
            time.sleep(0.05)  # HANG-LINE
    t = torch.ones(1); dist.all_reduce(t, group=world.group)

@W2
def test_after_hang(world, stamp):
    stamp("after_hang")
    t = torch.ones(1); dist.all_reduce(t, group=world.group); assert t.item() == 2

@W2
def test_rank1_killed(world):
    if world.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1); dist.all_reduce(t, group=world.group)

@W2
def test_rank1_exits_0(world):
    if world.rank == 1:
        os._exit(0)  # torchrun takes status 0 for success and does not stop the world
    t = torch.ones(1); dist.all_reduce(t, group=world.group)

@W2
def test_raises_before_collective(world):
    if world.rank == 1:
        raise ValueError("rank 1 raised before all_reduce")
    t = torch.ones(1); dist.all_reduce(t, group=world.group)

@W2
def test_last(world):
    t = torch.ones(1); dist.all_reduce(t, group=world.group); assert t.item() == 2
'''
HANG_LINE = SUITE.splitlines().index("            time.sleep(0.05)  # HANG-LINE") + 1


def _into_test(out: str, test: str) -> float:
    m = re.search(rf"during test_suite\.py::{test} \(([\d.]+) s into the test\)", out)
    assert m, out
    return float(m.group(1))


def test_faults_in_launched_worlds_then_lf_k_x(child) -> None:
    c = child({"test_suite.py": SUITE}, "-m", "pytest", "-q", "--junitxml=junit.xml",
              "test_suite.py")
    out = c.out
    assert c.rc == 1, out
    assert c.outcomes == {
        "test_local": "passed",
        "test_fails_on_rank1_only": "failed",
        "test_skips_on_one_rank": "error",
        "test_collected_per_rank[0]": "error",  # failed in setup on rank 1
        "test_hangs_on_rank1": "failed",
        "test_after_hang": "passed",
        "test_rank1_killed": "failed",
        "test_rank1_exits_0": "failed",
        "test_raises_before_collective": "failed",
        "test_last": "passed",
    }, out
    assert "failed on rank 1 of 2 (rank 0: passed)" in out and "only rank 1 fails" in out
    assert "skipped on ranks 1 (rank 1 skips)" in out
    assert "test_suite.py::test_collected_per_rank[0] was not collected on rank 1" in out
    # hang: test, ranks, where; the next test ran in a fresh world, in bounded time
    assert "timed out after 3 s during test_suite.py::test_hangs_on_rank1" in out
    assert re.search(rf"rank 1: stuck at \S*test_suite.py:{HANG_LINE} in test_hangs_on_rank1", out), out
    assert re.search(r"rank 0: stuck in collective all_reduce at \S*test_suite.py:\d+", out), out
    startup = c.stamps["first"] - c.start
    assert c.stamps["after_hang"] - c.stamps["hang"] < 3 + 30 + 3 * startup + 10, (c.stamps, out)
    # SIGKILL: rank and test named, noticed within 30 s
    assert "rank 1: DIED during test_suite.py::test_rank1_killed" in out
    assert _into_test(out, "test_rank1_killed") < 30, out
    # os._exit(0): the watchdogs see the process gone
    assert "rank 1 died (its process is gone) during test_suite.py::test_rank1_exits_0" in out
    assert _into_test(out, "test_rank1_exits_0") < 30, out
    # raise before a collective: noticed long before the 120 s default timeout
    assert re.search(r"rank 0 was stuck in all_reduce for \d+ s after rank 1 failed during ", out), out
    assert _into_test(out, "test_raises_before_collective") < 30, out
    assert "rank 1 raised before all_reduce" in out
    assert re.search(r"launch: worlds of 2 ranks; logs in \S+", out), out

    # --lf picks the failures from the cache, -k filters, -x stops at the first
    again = child({}, "-m", "pytest", "-q", "--junitxml=junit.xml", "--lf", "-x",
                  "-k", "not local", "test_suite.py")
    assert again.rc == 1, again.out
    assert again.outcomes == {"test_fails_on_rank1_only": "failed"}, again.out
    assert "stopping after 1 failures" in again.out, again.out


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
    # each worker launched its own world (own store, own rendezvous port)
    worlds = list(c.dir.glob(".launch-logs/*/w2g1-torchrun.log"))
    assert len(worlds) == 2, c.out


import pytest  # noqa: E402

pytestmark = pytest.mark.slow  # black-box worlds with faults: the full run, not the quick tier


LINGER = '''
import os, time
import pytest, torch, torch.distributed as dist

class Linger:
    """Rank 0 stays between tests (after test_a's report) until the world is
    stopped: its watchdog ends the process once rank 1 has died."""
    def pytest_runtest_logfinish(self, nodeid, location):
        if nodeid.endswith("test_a"):
            end = time.monotonic() + 120
            while time.monotonic() < end:
                time.sleep(0.1)

@pytest.mark.world_size(2)
def test_a(world, request):
    if world.rank == 0:
        request.config.pluginmanager.register(Linger(), "linger")

@pytest.mark.world_size(2)
def test_b(world):
    if world.rank == 1:
        os._exit(1)
    t = torch.ones(1); dist.all_reduce(t, group=world.group)
'''


def test_a_death_while_rank0_is_between_tests_is_the_next_tests(child) -> None:
    # Rank 1 dies in test_b while rank 0 has not started it yet: the report
    # still names test_b, the dead rank and where rank 0 was.
    c = child({"test_suite.py": LINGER}, "-m", "pytest", "-q", "--junitxml=junit.xml",
              "test_suite.py")
    assert c.outcomes == {"test_a": "passed", "test_b": "failed"}, c.out
    assert "during test_suite.py::test_b" in c.out, c.out
    assert "dead ranks: 1" in c.out and "rank 1: DIED during test_suite.py::test_b" in c.out, c.out
    assert "rank 0: between tests" in c.out, c.out


SLOW_PEER = '''
import os, time
import pytest, torch, torch.distributed as dist

if os.environ.get("LAUNCH_SERVER") and os.environ.get("RANK") == "3":
    time.sleep(8)  # rank 3 still collects while rank 1 could start the first test

@pytest.mark.world_size(4)
def test_first_kills_rank_1(world):
    if world.rank == 1:
        os._exit(1)
    t = torch.ones(1); dist.all_reduce(t, group=world.group)

@pytest.mark.world_size(4)
def test_next_world_is_fine(world):
    t = torch.ones(1); dist.all_reduce(t, group=world.group); assert t.item() == 4
'''


def test_a_death_in_the_first_test_while_a_peer_collects_is_the_tests(child) -> None:
    # Every rank waits for every other to collect before its first test, so a
    # rank that dies in that test dies in a started world: the test fails, the
    # world is not taken for one that never started (retried, then every later
    # test of that size failed in setup).
    c = child({"test_suite.py": SLOW_PEER}, "-m", "pytest", "-q", "--junitxml=junit.xml",
              "test_suite.py")
    assert c.outcomes == {"test_first_kills_rank_1": "failed",
                          "test_next_world_is_fine": "passed"}, c.out
    assert "while starting" not in c.out, c.out
    assert "rank 1: DIED during test_suite.py::test_first_kills_rank_1" in c.out, c.out
