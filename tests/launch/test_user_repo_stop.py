"""Covers: launch/modes/lockstep.py and launch/rank/core.py (stopping in
lockstep: ``-x`` and ``--maxfail`` after a failure on a sub-world, a
collection error on one rank, ^C), under ``torchrun`` and ``python -m launch``.

Black-box: a repository outside this one, no conftest, no pytest
configuration. A rank that kept going would wait for the next test until
the hang watchdog's timeout and then dump its stack; these tests set that
timeout far above the suite's length and look for the dump.
"""

from __future__ import annotations

import signal

import pytest
from _user_repo import run_in
from childrun import _junit

SUB_WORLD_FAILS = '''
import pytest, torch, torch.distributed as dist

@pytest.mark.world_size(4)
def test_first(world):
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == 4

@pytest.mark.world_size(2)
def test_fails_on_two_ranks(world):
    assert False, "fails on the 2-rank sub-world"

@pytest.mark.world_size(4)
def test_after(world):
    t = torch.ones(1); dist.all_reduce(t)
'''
ONE_RANK_CANNOT_COLLECT = '''
import os
if os.environ.get("RANK") == "1":
    raise ImportError("rank 1 cannot import this module (planted)")
'''
OK = '''
import torch, torch.distributed as dist

def test_ok():
    t = torch.ones(1); dist.all_reduce(t)
'''
TIMEOUT = "--dist-timeout=600"  # a rank left waiting would hold the job this long


TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
            "-m", "pytest"]
LAUNCH = ["-m", "launch", "--nproc-per-node", "4", "--"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["torchrun", "launch"])
@pytest.mark.parametrize("stop", [["-x"], ["--maxfail=1"]], ids=["x", "maxfail"])
def test_a_failure_on_a_sub_world_stops_every_rank(user_repo, how, stop):
    (user_repo / "test_stop.py").write_text(SUB_WORLD_FAILS)
    cmd = TORCHRUN if how == "torchrun" else LAUNCH
    p = run_in(user_repo, *cmd, "-q", "-p", "no:cacheprovider", "--junitxml=junit.xml", TIMEOUT,
            *stop, "test_stop.py", timeout=240)
    out = p.stdout
    assert p.returncode == 1, out
    assert _junit(user_repo / "junit.xml") == {"test_first": "passed",
                                          "test_fails_on_two_ranks": "failed"}, out
    assert "stopping after 1 failures" in out, out
    logs = "".join(f.read_text() for f in user_repo.glob(".launch-logs/*/rank*.log"))
    assert "timed out" not in out + logs and "most recent call first" not in logs, out


SLOW_TEARDOWN = '''
import os, time
import torch.distributed as dist

# Rank 2 takes its time leaving its process group after the run.
_destroy = dist.destroy_process_group
def _slow_destroy(*args, **kwargs):
    if os.environ.get("RANK") == "2":
        time.sleep(3)
    return _destroy(*args, **kwargs)
dist.destroy_process_group = _slow_destroy
'''


@pytest.mark.slow
def test_a_failing_run_stops_no_rank_that_is_still_leaving(user_repo):
    # rank 0 leaves with the failing status last: torchrun stops the others
    # once one exits non-zero, which caught a rank inside destroy_process_group
    (user_repo / "test_stop.py").write_text(SUB_WORLD_FAILS + SLOW_TEARDOWN)
    p = run_in(user_repo, *TORCHRUN, "-q", "-p", "no:cacheprovider", TIMEOUT, "-x",
               "test_stop.py", timeout=240)
    assert p.returncode == 1, p.stdout
    logs = "".join(f.read_text() for f in user_repo.glob(".launch-logs/*/rank*.log"))
    assert "SIGTERM" not in logs and "most recent call first" not in logs, logs


@pytest.mark.slow
def test_a_collection_error_on_one_rank_stops_every_rank(user_repo):
    (user_repo / "test_a_broken.py").write_text(ONE_RANK_CANNOT_COLLECT)
    (user_repo / "test_b_ok.py").write_text(OK)
    p = run_in(user_repo, *TORCHRUN, "-q", "-p", "no:cacheprovider", TIMEOUT, ".", timeout=240)
    out = p.stdout
    assert p.returncode != 0, out
    assert "1 errors during collection on rank 1" in out, out
    assert "1 passed" not in out, out


SLEEPS = '''
import os, time
import torch, torch.distributed as dist

def test_first():
    t = torch.ones(1); dist.all_reduce(t)

def test_sleeps():
    open(os.path.join(os.environ["STAMPS_DIR"], "started"), "w").close()
    time.sleep(120)
    t = torch.ones(1); dist.all_reduce(t)

def test_later():
    pass
'''


@pytest.mark.slow
@pytest.mark.parametrize("how", ["torchrun", "launch"])
def test_ctrl_c_stops_every_rank_at_the_same_test(user_repo, how):
    """^C in a terminal: SIGINT to the whole foreground process group."""
    (user_repo / "test_int.py").write_text(SLEEPS)
    head = (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
             "pytest"] if how == "torchrun" else ["-m", "launch", "--nproc-per-node", "2", "--"])
    p = run_in(user_repo, *head, "-q", "-p", "no:cacheprovider", "test_int.py",
               timeout=200, stop_when="started", stop=signal.SIGINT, to_group=True,
               after_stop=60)  # not the 120 s the test sleeps
    out = p.stdout
    assert "launch: interrupted (SIGINT" in out and "during test_int.py::test_sleeps" in out, out
    assert "1 of 3 tests ran; 2 not run, starting with test_int.py::test_sleeps" in out, out
    assert p.returncode != 0, out
