"""Covers: launch/fuzz/cli.py (checks before a world starts, a session that
ran nothing fails), launch/fuzz/rank.py and report.py (only the ranks that
ran a test are compared), launch/fuzz/replay.py (loaded by its entry point).

Black-box, in a repository outside this one: a temporary folder with one
test file, no conftest and no pytest configuration, the project installed
in this venv (its ``pytest11`` entry points are all it gets).
"""

from __future__ import annotations

import json

import pytest
from _user_repo import run_in
from childrun import _junit

PLANTED = '''
import pytest, torch, torch.distributed as dist
from hypothesis import given, settings, strategies as st

def test_plain_first():
    pass

@pytest.mark.world_size(2)
@settings(max_examples=3)
@given(x=st.integers(0, 1000))
def test_planted(world, x):
    t = torch.tensor([float(x)]); dist.all_reduce(t)
    assert t.item() == 2 * x
    assert x < 700, "planted"
'''
NO_GIVEN = '''
def test_plain():
    pass
'''
RANKS_CANNOT_START = '''
import os
from hypothesis import given, strategies as st
if os.environ.get("LOCAL_RANK"):  # only the session's ranks: the check passes
    raise ImportError("this module cannot be imported on a rank (planted)")

@given(st.integers())
def test_x(x):
    pass
'''


@pytest.mark.slow
def test_a_session_finds_a_planted_failure_and_plain_pytest_replays_it_first(user_repo):
    (user_repo / "test_user_dist.py").write_text(PLANTED)
    p = run_in(user_repo, "-m", "launch", "fuzz", "test_user_dist.py", "--minutes", "0.75",
            "--nproc", "4", "--report", "rep")
    out = p.stdout
    assert p.returncode == 1, out
    assert "FAILED test_user_dist.py::test_planted: error AssertionError" in out, out
    assert "example: x=700" in out, out
    # A 2-rank property in a 4-rank world: only ranks 0 and 1 ran it.
    doc = json.loads((user_repo / "rep" / "report.json").read_text())
    (fail,) = doc["failures"]
    assert sorted(fail["per_rank"]) == ["0", "1"] and all(fail["per_rank"].values()), fail
    md = (user_repo / "rep" / "report.md").read_text()
    assert "shrunk identically on every rank: yes (ranks 0-1, the test's world of 2 in 4)" \
        in md, md

    # Plain pytest, nothing loaded by hand: the stored failure runs first and
    # fails on its stored example, though the test asks for 3 examples only.
    p = run_in(user_repo, "-m", "pytest", "-p", "no:cacheprovider", "--junitxml=junit.xml", "-v",
            "test_user_dist.py")
    out = p.stdout
    assert p.returncode == 1, out
    assert _junit(user_repo / "junit.xml") == {"test_planted": "failed",
                                          "test_plain_first": "passed"}, out
    assert out.index("test_planted") < out.index("test_plain_first"), out
    assert "x=700" in out, out


@pytest.mark.parametrize(("files", "args", "says"), [
    ({}, ["test_missing.py"], "file or directory not found: test_missing.py"),
    ({"test_p.py": NO_GIVEN}, ["test_p.py"], "no @given test"),
    ({"test_p.py": NO_GIVEN}, ["test_p.py", "-p", "no_such_plugin"], "no_such_plugin"),
    ({"test_p.py": PLANTED}, ["test_p.py", "--hypothesis-profile=nope"], "nope"),
])
def test_a_session_that_cannot_run_fails_with_the_reason(user_repo, files, args, says):
    for name, text in files.items():
        (user_repo / name).write_text(text)
    p = run_in(user_repo, "-m", "launch", "fuzz", "--minutes", "0.5", "--nproc", "2", *args)
    assert p.returncode not in (0, 1), p.stdout  # 1: failures found
    assert says in p.stdout, p.stdout
    assert "0 examples" not in p.stdout, p.stdout


@pytest.mark.slow
def test_worlds_that_cannot_start_fail_the_session_with_their_reason(user_repo):
    (user_repo / "test_r.py").write_text(RANKS_CANNOT_START)
    p = run_in(user_repo, "-m", "launch", "fuzz", "test_r.py", "--minutes", "0.5", "--nproc", "2")
    assert p.returncode == 3, p.stdout
    assert "no example ran" in p.stdout, p.stdout
    assert "cannot be imported on a rank (planted)" in p.stdout, p.stdout
