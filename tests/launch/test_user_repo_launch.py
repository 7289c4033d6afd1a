"""Covers: launch/cli.py (its own arguments and pytest's checked before any
world starts; the summary's whole time and restarts), launch/agree.py and
launch/hypo/run.py (one copy of a failure that is the same on several ranks).

Black-box where a world runs: a repository outside this one, one test file,
no conftest and no pytest configuration.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from _user_repo import run_in

from launch import agree


def run(repo: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m launch *args`` in the user's repository."""
    return run_in(repo, "-m", "launch", *args, timeout=timeout)


@pytest.fixture
def repo(user_repo: Path) -> Path:
    (user_repo / "test_x.py").write_text("def test_x():\n    pass\n")
    return user_repo


@pytest.mark.parametrize(("argv", "says"), [
    (["--nproc-per-node", "0", "--", "test_x.py"], "--nproc-per-node must be >= 1, got 0"),
    (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    (["--timeout", "0"], "--timeout must be > 0 seconds"),
    (["--backend", "mpi"], "invalid choice: 'mpi' (choose from 'gloo', 'nccl')"),
    (["--nprocs", "4", "--", "test_x.py"],
     "unknown option --nprocs (did you mean --nproc-per-node?); pytest's options go after --"),
    (["test_x.py", "-q"], "unknown option -q"),
])
def test_own_arguments_are_checked_before_any_world_starts(repo, argv, says):
    p = run(repo, *argv, timeout=60)
    assert p.returncode == 2, p.stdout
    assert says in p.stdout, p.stdout
    assert "exit status" not in p.stdout and not (repo / ".launch-logs").exists(), p.stdout


def test_nccl_without_a_gpu_is_one_line(repo):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nccl can start here")
    p = run(repo, "--backend", "nccl", "--", "test_x.py", timeout=60)
    assert p.returncode == 2, p.stdout
    assert p.stdout.strip().count("\n") == 0, p.stdout
    assert "--backend nccl needs a CUDA device per rank" in p.stdout, p.stdout


@pytest.mark.parametrize(("argv", "says"), [
    (["--", "tests/does_not_exist.py"], "ERROR: file or directory not found: tests/does_not_exist.py"),
    (["--", "test_x.py", "--nprocs"], "unrecognized arguments: --nprocs"),
])
def test_a_pytest_usage_error_is_said_once_and_not_retried(repo, argv, says):
    p = run(repo, *argv, timeout=120)
    assert p.returncode == 4, p.stdout
    assert p.stdout.count(says) == 1, p.stdout
    assert "no world started" in p.stdout, p.stdout


def test_help_shows_the_fuzz_subcommand_and_where_pytest_arguments_go(repo):
    out = run(repo, "--help", timeout=60).stdout
    assert "python -m launch fuzz" in out and "[-- pytest arguments]" in out, out
    assert "pytest's own arguments go after --" in out, out


def test_the_same_failure_on_several_ranks_is_shown_once():
    boom = agree.error_verdict("call", "E   AssertionError: boom")
    d = agree.decide([boom] * 4, (0, 1, 2, 3))
    assert d.text.count("AssertionError: boom") == 1, d.text
    assert "ranks 0–3, same error (call)" in d.text
    other = agree.error_verdict("call", "E   AssertionError: other")
    d = agree.decide([boom, other, boom, "P"], (0, 1, 2, 3))
    assert d.text.count("boom") == 1 and d.text.count("other") == 1, d.text
    assert "ranks 0, 2, same error (call)" in d.text and "rank 1 (call)" in d.text
    assert d.short == "failed on ranks 0, 1, 2 of 4 (rank 3: passed)"
    # processes print their own object addresses in a long traceback's locals
    a, b = (agree.error_verdict("call", f"E  db = <DB object at {x}>\nE  boom")
            for x in ("0x7f35d5f10d90", "0x7fb4d8e31ed0"))
    d = agree.decide([a, b], (0, 1))
    assert "ranks 0–1, same error (call)" in d.text and d.text.count("boom") == 1, d.text


SUITE = '''
import os, time
import pytest, torch, torch.distributed as dist
from hypothesis import given, settings, strategies as st

def test_same_on_every_rank():
    assert 1 == 2, "the same on every rank"

@pytest.mark.dist_timeout(3)
def test_hang():
    if dist.get_rank() == 0:
        t = torch.ones(1); dist.all_reduce(t)

def test_after():
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == dist.get_world_size()

@settings(max_examples=20, derandomize=True, database=None)
@given(x=st.integers(0, 10))
def test_property_fails_alike(x):
    assert x < 5, "a property that fails alike on every rank"
'''


@pytest.mark.slow
def test_the_summary_gives_the_whole_time_and_the_restarts(repo):
    (repo / "test_s.py").write_text(SUITE)
    p = run(repo, "--nproc-per-node", "2", "--", "test_s.py", "-q", "-p", "no:cacheprovider")
    out = p.stdout
    assert p.returncode == 1, out
    assert out.count("the same on every rank") == 2, out  # the traceback and E line, once
    assert "ranks 0–1, same error (call)" in out, out
    assert "3 failed, 1 passed" in out, out
    # the property's own per-rank blocks, one for both ranks
    assert "----- ranks 0–1, same error -----" in out, out
    # and the two ranks' reports of it, whose long tracebacks differ only in addresses
    assert out.count("ranks 0–1, same error (call)") == 2, out
    last = [ln for ln in out.splitlines() if ln.startswith("launch: 2 ranks, exit status 1")]
    assert last and " s in all, 1 world restart;" in last[-1], out
