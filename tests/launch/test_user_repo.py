"""Covers: launch/modes/parent.py, launch/rank/procs.py, launch/modes/server.py (recovery),
launch/hypo/lockstep.py, launch/modes/lockstep.py (resume lines, interruption),
black-box, as a new user meets the service: a repository outside this one,
with no conftest and no ini file, the project installed in this venv (as
``pip install -e .`` / CI do), run with plain pytest, ``pytest -n 2`` and
``torchrun --nproc_per_node=4``. docs/test-service.md's fault matrix is
measured by these tests.

``LAUNCH_LOAD_TESTS=1`` also runs the fault suite beside CPU burners with
slow collection (about a minute on 2 cores; off by default for CI time).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from _user_repo import run_in
from childrun import _junit

FAULTS = '''
import os, time
import pytest, torch, torch.distributed as dist

W2 = pytest.mark.world_size(2)

@W2
def test_fails_on_rank1(world):
    assert world.rank == 0, "rank 1 fails"

@W2
@pytest.mark.dist_timeout(3)
def test_hang(world):
    if world.rank == 0:
        t = torch.ones(1); dist.all_reduce(t)  # rank 1 never joins

@W2
def test_after_hang(world):
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == 2

@W2
def test_rank1_dies(world):
    if world.rank == 1:
        os._exit(1)
    t = torch.ones(1); dist.all_reduce(t)

@W2
def test_after_death(world):
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == 2

@W2
@pytest.mark.dist_timeout(3)
def test_hang_again(world):
    if world.rank == 1:
        time.sleep(3600)
    t = torch.ones(1); dist.all_reduce(t)

@W2
def test_dies_right_after(world):
    if world.rank == 0:
        os._exit(1)
    t = torch.ones(1); dist.all_reduce(t)

@W2
def test_after_two_faults(world):
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == 2
'''
AFTER_FAULTS = {"test_fails_on_rank1": "failed", "test_hang": "failed",
                "test_after_hang": "passed", "test_rank1_dies": "failed",
                "test_after_death": "passed", "test_hang_again": "failed",
                "test_dies_right_after": "failed", "test_after_two_faults": "passed"}
# -n 2: a hang and a death, each followed by a test, across two workers
XDIST = {k: v for k, v in AFTER_FAULTS.items() if k in (
    "test_hang", "test_after_hang", "test_rank1_dies", "test_after_death")}

PROPS = '''
import pytest, torch, torch.distributed as dist
from hypothesis import given, settings, strategies as st
from dtensor import distribute_tensor
from dtensor.testing.strategies import distributed_inputs

@pytest.mark.world_size(2)
@settings(max_examples=10)
@given(x=st.integers(0, 10))
def test_given_on_the_test(world, x):
    t = torch.tensor([float(x)]); dist.all_reduce(t); assert t.item() == 2 * x

@pytest.mark.world_size(2)
def test_inner_given_as_documented(world):
    @settings(max_examples=10)
    @given(distributed_inputs(world_size=world.size))
    def check(inp):
        dt = distribute_tensor(inp.tensor, inp.mesh, inp.placements)
        assert dt.full_tensor().shape == inp.tensor.shape
    check()

@pytest.mark.world_size(2)
def test_rank_dependent_draws(world):
    @settings(max_examples=10)
    @given(st.integers(100 * world.rank, 100 * world.rank + 5))
    def check(x):
        t = torch.ones(1); dist.all_reduce(t)
    check()

@pytest.mark.world_size(2)
def test_example_in_a_world(world):
    x = st.integers().example()
    t = torch.ones(1); dist.all_reduce(t)
'''
STARTUP = '''
import os
import pytest, torch, torch.distributed as dist

# The first world's rank 1 aborts while collecting this module (once per run).
FLAG = os.path.join(os.path.dirname(__file__), "aborted-once")
if os.environ.get("LAUNCH_SERVER") and os.environ.get("RANK") == "1" \\
        and not os.path.exists(FLAG):
    open(FLAG, "w").close()
    os.abort()

@pytest.mark.world_size(2)
def test_a_world_that_died_starting_is_retried(world):
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == 2
'''


def test_plain_pytest_recovers_runs_hypothesis_in_lockstep_and_retries_a_start(user_repo):
    (user_repo / "test_faults.py").write_text(FAULTS)
    (user_repo / "test_props.py").write_text(PROPS)
    (user_repo / "test_startup.py").write_text(STARTUP)
    # torchrun starts these worlds: a forked rank never imports test_startup.py
    p = run_in(user_repo, "-m", "pytest", "-p", "no:cacheprovider", "--junitxml=junit.xml",
             "--dist-timeout=90", "-q", "test_startup.py", "test_faults.py", "test_props.py",
             env={"LAUNCH_START": "torchrun"})
    out = p.stdout
    assert not (user_repo / "conftest.py").exists()
    assert _junit(user_repo / "junit.xml") == {
        "test_a_world_that_died_starting_is_retried": "passed", **AFTER_FAULTS,
        "test_given_on_the_test": "passed", "test_inner_given_as_documented": "passed",
        "test_rank_dependent_draws": "failed", "test_example_in_a_world": "failed"}, out
    # a rank that died while starting: retried once, and its reason is in its log
    assert "launch: a 2-rank world died while starting and a fresh one was started" in out
    logs = "".join(f.read_text() for f in user_repo.glob(".launch-logs/*/w2g1-rank1.log"))
    assert "Fatal Python error: Aborted" in logs and "test_startup.py" in logs, logs
    assert "timed out after 3 s during test_faults.py::test_hang" in out, out
    assert "rank 1: DIED during test_faults.py::test_rank1_dies" in out, out
    # hypothesis: a divergence is named by its first differing draw, on every rank
    assert "ranks diverged at example #0 of " in out, out
    assert re.search(r"first differing draw \(#1\): rank 0: x=\d+\n.*rank 1: x=10\d", out), out
    assert "strategy.example() in a world test draws from this rank's own random" in out
    assert "FailedHealthCheck" not in out, out


def test_xdist_workers_each_recover_after_hang_and_death(user_repo):
    (user_repo / "test_faults.py").write_text(FAULTS)
    p = run_in(user_repo, "-m", "pytest", "-p", "no:cacheprovider", "--junitxml=junit.xml",
             "--dist-timeout=90", "-q", "-n", "2", *(f"test_faults.py::{t}" for t in XDIST))
    assert _junit(user_repo / "junit.xml") == XDIST, p.stdout


T4 = '''
import os, time
import pytest, torch, torch.distributed as dist
from hypothesis import given, settings, strategies as st

@pytest.mark.world_size(2)
def test_inner_given_in_a_sub_world(world):
    @settings(max_examples=5)
    @given(st.integers(0, 9))
    def check(x):
        t = torch.tensor([float(x)]); dist.all_reduce(t); assert t.item() == 2 * x
    check()

@pytest.mark.world_size(2)
@pytest.mark.dist_timeout(3)
def test_hang_in_a_sub_world(world):
    if world.rank == 0:
        t = torch.ones(1); dist.all_reduce(t)

def test_never_runs():
    pass
'''
INTERRUPT = '''
import os, time
import pytest, torch, torch.distributed as dist

def test_first():
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == dist.get_world_size()

@pytest.mark.world_size(2)
def test_stopped_by_the_user(world):
    open(os.path.join(os.environ["STAMPS_DIR"], "started"), "w").close()
    time.sleep(120)

def test_later():
    pass
'''


def test_torchrun_4_resume_line_names_the_run_and_an_interrupt_is_an_interrupt(user_repo):
    (user_repo / "test_t4.py").write_text(T4)
    p = run_in(user_repo, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
             "-m", "pytest", "-p", "no:cacheprovider", "--junitxml=junit.xml", "-q",
             "test_t4.py")
    out = p.stdout
    assert _junit(user_repo / "junit.xml") == {"test_inner_given_in_a_sub_world": "passed",
                                          "test_hang_in_a_sub_world": "failed",
                                          "test_never_runs": "skipped"}, out
    assert ("torchrun --nproc_per_node=4 -m pytest -p no:cacheprovider --junitxml=junit.xml"
            " -q test_t4.py --dist-start-after=test_t4.py::test_hang_in_a_sub_world") in out, out
    assert "ranks 1..3 logged to" in out and "other nodes" not in out, out

    (user_repo / "test_int.py").write_text(INTERRUPT)
    p = run_in(user_repo, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
             "-m", "pytest", "-p", "no:cacheprovider", "--junitxml=junit.xml", "-q",
             "test_int.py", stop_when="started")
    out = p.stdout
    assert _junit(user_repo / "junit.xml") == {"test_first": "passed",
                                          "test_stopped_by_the_user": "skipped"}, out
    assert "not run (interrupted): torchrun got SIGTERM while this test ran" in \
        (user_repo / "junit.xml").read_text()
    assert "launch: interrupted (SIGTERM to torchrun) during test_int.py::" \
        "test_stopped_by_the_user" in out, out
    assert "1 of 3 tests ran; 2 not run, starting with test_int.py::test_stopped_by_the_user" in out
    assert ("torchrun --nproc_per_node=4 -m pytest -p no:cacheprovider --junitxml=junit.xml"
            " -q test_int.py --dist-start-after=test_int.py::test_first") in out, out
    assert "1 passed, 1 skipped" in out, out
    assert "restarts it" not in out, out


SLOW_COLLECTION = '''
import os, time
if os.environ.get("LAUNCH_SERVER"):
    time.sleep(8)  # every rank of every world collects this slowly
'''


@pytest.mark.skipif(not os.environ.get("LAUNCH_LOAD_TESTS"),
                    reason="under-load recovery (about a minute): set LAUNCH_LOAD_TESTS=1")
def test_recovery_beside_cpu_burners_with_slow_collection(user_repo):
    (user_repo / "test_faults.py").write_text(FAULTS)
    (user_repo / "test_slow_import.py").write_text(SLOW_COLLECTION)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(2 * (os.cpu_count() or 2))]
    try:
        p = run_in(user_repo, "-m", "pytest", "-p", "no:cacheprovider", "--junitxml=junit.xml",
                 "--dist-timeout=120", "-q", "test_slow_import.py", "test_faults.py",
                 timeout=900)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert _junit(user_repo / "junit.xml") == AFTER_FAULTS, p.stdout


pytestmark = pytest.mark.slow  # starts several worlds or compiles: the full run, not the quick tier
