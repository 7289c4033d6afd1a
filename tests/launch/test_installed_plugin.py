"""Covers: the ``pytest11`` entry point and launch/world.py's timeout
reconciliation, black-box: a repository outside this one, with no conftest
and no ini file, gets the service from the installed project (this venv has
it installed, as ``pip install -e .`` / CI do); pytest-timeout installed
beside it never times out one rank alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from childrun import UNDER_TORCHRUN, _junit, _processes_in

USER_SUITE = '''
import pytest, torch, torch.distributed as dist

@pytest.mark.world_size(2)
def test_two(world):
    t = torch.ones(1); dist.all_reduce(t)
    assert t.item() == 2 == dist.get_world_size() == world.size

@pytest.mark.world_size(2)
@pytest.mark.dist_timeout(60)
def test_rank_one_fails(world):
    assert dist.get_rank() == 0, "rank 1 fails"

@pytest.mark.cuda
def test_needs_cuda():
    assert torch.cuda.is_available()

def test_local():
    assert not dist.is_initialized()
'''


def _run(tmp: Path, *args: str, timeout: float = 300, extra_path: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER",
                        "PYTEST_CURRENT_TEST", "PYTEST_PLUGINS")}
    if extra_path:
        env["PYTHONPATH"] = extra_path
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, *args], cwd=tmp, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert not _processes_in(tmp), "processes left behind"
    return p


@pytest.fixture
def user_repo(tmp_path: Path) -> Path:
    if UNDER_TORCHRUN:
        pytest.skip("self-test starts its own worlds; run it with plain pytest")
    eps = [e for e in entry_points(group="pytest11") if e.value == "launch.plugin"]
    assert eps, "the project is not installed: pip install -e '.[test]'"
    (tmp_path / "test_user.py").write_text(USER_SUITE)
    return tmp_path


def test_an_installed_project_serves_a_repo_without_conftest(user_repo: Path) -> None:
    assert not (user_repo / "conftest.py").exists()
    p = _run(user_repo, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--strict-markers",
             "-rs", "--junitxml=junit.xml", "test_user.py")
    out = p.stdout + p.stderr
    assert _junit(user_repo / "junit.xml") == {
        "test_two": "passed", "test_rank_one_fails": "failed", "test_needs_cuda": "skipped",
        "test_local": "passed"}, out
    assert "failed on rank 1 of 2 (rank 0: passed)" in out, out
    assert "needs CUDA (marked cuda)" in out, out


PYTEST_TIMEOUT_SUITE = '''
import time
import pytest, torch, torch.distributed as dist

@pytest.mark.timeout(4)
def test_rank1_hangs():
    if dist.get_rank() == 1:
        time.sleep(3600)  # SLEEP-LINE
    t = torch.ones(1); dist.all_reduce(t)

def test_after():
    pass
'''


@pytest.mark.slow  # a child run with a hang (~30 s on 2 cores): the full run
def test_pytest_timeout_never_kills_one_rank_mid_collective(user_repo: Path) -> None:
    """pytest-timeout's thread method would dump and os._exit one rank at 4 s
    (its peer left in all_reduce); here our watchdog times out both together."""
    try:
        import pytest_timeout
    except ImportError:
        pytest.fail("pytest-timeout is part of the test extra: pip install -e '.[test]'")
    (user_repo / "test_user.py").unlink()
    (user_repo / "test_pt.py").write_text(PYTEST_TIMEOUT_SUITE)
    site = str(Path(pytest_timeout.__file__).parent)
    p = _run(user_repo, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             "-m", "pytest", "-p", "no:cacheprovider", "--timeout=300",
             "--timeout-method=thread", "--junitxml=junit.xml", "test_pt.py",
             extra_path=site, timeout=240)
    out = p.stdout + p.stderr
    assert "timeout method: thread" in out, out  # pytest-timeout was active
    assert "+++++ Timeout +++++" not in out, out  # and never fired
    assert "timed out after 4 s during test_pt.py::test_rank1_hangs" in out, out
    assert "stuck ranks: 0, 1" in out, out
    assert re.search(r"rank 0: stuck in collective all_reduce", out), out
    assert _junit(user_repo / "junit.xml") == {"test_rank1_hangs": "failed",
                                               "test_after": "skipped"}, out
