"""Covers: launch/modes/lockstep.py and launch/rank/core.py (stopping in
lockstep: ``-x`` and ``--maxfail`` after a failure on a sub-world, a
collection error on one rank, ^C), under ``torchrun`` and ``python -m launch``.

Black-box: a repository outside this one, no conftest, no pytest
configuration. A rank that kept going would wait for the next test until
the hang watchdog's timeout and then dump its stack; these tests set that
timeout far above the suite's length and look for the dump.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from childrun import UNDER_TORCHRUN, _junit, _processes_in

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


def run(tmp: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "LAUNCH_")) and k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, *args], cwd=tmp, env=env, text=True, timeout=timeout,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert not _processes_in(tmp), f"processes left behind\n{p.stdout}"
    return p


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    if UNDER_TORCHRUN:
        pytest.skip("self-test starts its own worlds; run it with plain pytest")
    return tmp_path


TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
            "-m", "pytest"]
LAUNCH = ["-m", "launch", "--nproc-per-node", "4", "--"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["torchrun", "launch"])
@pytest.mark.parametrize("stop", [["-x"], ["--maxfail=1"]], ids=["x", "maxfail"])
def test_a_failure_on_a_sub_world_stops_every_rank(repo, how, stop):
    (repo / "test_stop.py").write_text(SUB_WORLD_FAILS)
    cmd = TORCHRUN if how == "torchrun" else LAUNCH
    p = run(repo, *cmd, "-q", "-p", "no:cacheprovider", "--junitxml=junit.xml", TIMEOUT,
            *stop, "test_stop.py", timeout=240)
    out = p.stdout
    assert p.returncode == 1, out
    assert _junit(repo / "junit.xml") == {"test_first": "passed",
                                          "test_fails_on_two_ranks": "failed"}, out
    assert "stopping after 1 failures" in out, out
    logs = "".join(f.read_text() for f in repo.glob(".launch-logs/*/rank*.log"))
    assert "timed out" not in out + logs and "most recent call first" not in logs, out


@pytest.mark.slow
def test_a_collection_error_on_one_rank_stops_every_rank(repo):
    (repo / "test_a_broken.py").write_text(ONE_RANK_CANNOT_COLLECT)
    (repo / "test_b_ok.py").write_text(OK)
    p = run(repo, *TORCHRUN, "-q", "-p", "no:cacheprovider", TIMEOUT, ".", timeout=240)
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
def test_ctrl_c_stops_every_rank_at_the_same_test(repo, how):
    """^C in a terminal: SIGINT to the whole foreground process group."""
    import signal
    import time

    (repo / "test_int.py").write_text(SLEEPS)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "LAUNCH_")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", STAMPS_DIR=str(repo))
    head = (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
             "pytest"] if how == "torchrun" else ["-m", "launch", "--nproc-per-node", "2", "--"])
    cmd = [*head, "-q", "-p", "no:cacheprovider", "test_int.py"]
    p = subprocess.Popen([sys.executable, *cmd], cwd=repo, env=env, text=True,
                         start_new_session=True, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    end = time.monotonic() + 200
    while not (repo / "started").exists() and p.poll() is None and time.monotonic() < end:
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGINT)
    out, _ = p.communicate(timeout=60)  # not the 120 s the test sleeps
    assert not _processes_in(repo), f"processes left behind\n{out}"
    assert "launch: interrupted (SIGINT" in out and "during test_int.py::test_sleeps" in out, out
    assert "1 of 3 tests ran; 2 not run, starting with test_int.py::test_sleeps" in out, out
    assert p.returncode != 0, out
