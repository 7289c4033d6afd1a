"""Covers: launch/modes/lockstep.py, launch/rank/watchdog.py, launch/cli.py, black-box.

One ``python -m launch`` run of a child suite with every fault kind at 2 ranks:
each fault fails only its own test, with the rank and test named, within its
bound, and the tests after it still run in a fresh world. Plain torchrun
runs (no restarts): rank-dependent collection stops every rank before any
test; a hang at 4 ranks ends the world within timeout + 30 s.
"""

from __future__ import annotations

import re

FAULTS = '''
import os, signal, time
import pytest, torch, torch.distributed as dist

def test_ok_first(stamp):
    stamp("first")
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

@pytest.mark.timeout(3)
def test_hangs_on_rank1(stamp):
    stamp("hang")
    if dist.get_rank() == 1:
        while True:
            time.sleep(0.05)  # HANG-LINE
    t = torch.ones(1); dist.all_reduce(t)

def test_after_hang(stamp):
    stamp("after_hang")
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == 2

def test_rank1_killed():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1); dist.all_reduce(t)

def test_raises_before_collective():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 raised before all_reduce")
    t = torch.ones(1); dist.all_reduce(t)

def test_last():
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == 2
'''
HANG_LINE = FAULTS.splitlines().index("            time.sleep(0.05)  # HANG-LINE") + 1


def _into_test(out: str, test: str) -> float:
    """Seconds into ``test`` at which the report says the fault was noticed."""
    m = re.search(rf"during test_\w+\.py::{test} \(([\d.]+) s into the test\)", out)
    assert m, out
    return float(m.group(1))


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
    # hang: which test, which rank, where; a fresh world ran the next test
    assert "timed out after 3 s during test_faults.py::test_hangs_on_rank1" in out
    assert "stuck ranks: 0, 1" in out
    assert re.search(rf"rank 1: stuck at \S*test_faults.py:{HANG_LINE} in test_hangs_on_rank1", out), out
    assert re.search(r"rank 0: stuck in collective all_reduce at \S*test_faults.py:\d+", out), out
    startup = c.stamps["first"] - c.start  # what one world costs to start here, now
    assert c.stamps["after_hang"] - c.stamps["hang"] < 3 + 30 + 3 * startup + 10, (c.stamps, out)
    # dead rank (SIGKILL): named with its test, noticed within 30 s
    assert "rank 1: DIED during test_faults.py::test_rank1_killed" in out
    assert _into_test(out, "test_rank1_killed") < 30, out
    # raise before a collective: the peer stuck in it is noticed long before the
    # 120 s default timeout; the report has the stuck rank and the raise
    assert re.search(r"rank 0 was stuck in all_reduce for \d+ s after rank 1 failed during ", out), out
    assert _into_test(out, "test_raises_before_collective") < 30, out
    assert "rank 1 failed first" in out and "rank 1 raised before all_reduce" in out
    # stacks in every rank's log; the summary line
    logs = list(c.dir.glob(".launch-logs/*/rank1.log"))
    assert logs and "Python stacks" in logs[0].read_text()
    # the whole command's time and its restarts (a hang and a killed rank: 2 or more)
    assert re.search(r"launch: 2 ranks, exit status 1, [\d.]+ s in all, [2-9] world restarts; "
                     r"rank logs in", out), out
    assert c.seconds < 240, c.seconds


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


HANG4 = '''
import time
import pytest, torch, torch.distributed as dist

@pytest.mark.world_size(2)
def test_sub_world(world):
    t = torch.ones(1); dist.all_reduce(t, group=world.group); assert t.item() == 2

@pytest.mark.dist_timeout(3)
def test_rank3_hangs(stamp):
    stamp("hang")
    if dist.get_rank() == 3:
        time.sleep(3600)  # SLEEP-LINE
    t = torch.ones(1); dist.all_reduce(t)  # ALL-REDUCE-LINE

def test_never_runs():
    pass
'''


def test_a_hang_under_plain_torchrun_ends_the_world_in_bounded_time(child) -> None:
    c = child({"test_hang4.py": HANG4}, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node=4", "-m", "pytest", "-q", "-p", "no:cacheprovider",
              "--junitxml=junit.xml", "test_hang4.py", timeout=180)
    out = c.out
    assert c.rc != 0, out
    assert c.end - c.stamps["hang"] < 3 + 30, (c.stamps, c.end, out)
    assert "timed out after 3 s during test_hang4.py::test_rank3_hangs" in out
    assert "stuck ranks: 0, 1, 2, 3" in out
    lines = HANG4.splitlines()
    sleep = next(k for k, ln in enumerate(lines, 1) if ln.endswith("# SLEEP-LINE"))
    coll = next(k for k, ln in enumerate(lines, 1) if ln.endswith("# ALL-REDUCE-LINE"))
    assert re.search(rf"rank 3: stuck at \S*test_hang4.py:{sleep} in test_rank3_hangs", out), out
    assert re.search(rf"rank 2: stuck in collective all_reduce at \S*test_hang4.py:{coll} ", out), out
    assert "1 tests not run: the world is unusable (no restarts left):\n  test_hang4.py::test_never_runs" in out
    # the resume command skips what ran, the bad test included
    assert "--dist-start-after=test_hang4.py::test_rank3_hangs" in out, out
    assert c.outcomes == {"test_sub_world": "passed", "test_rank3_hangs": "failed",
                          "test_never_runs": "skipped"}, out


import pytest  # noqa: E402

pytestmark = pytest.mark.slow  # black-box worlds with faults: the full run, not the quick tier
