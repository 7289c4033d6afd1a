"""Covers: launch/hypo/lockstep.py for Hypothesis runs that are not plain
``@given`` world tests, black-box under torchrun N=2 (no conftest: the
installed entry point loads the service).

- ``hypothesis.find`` returns the same shrunk example on every rank (it used
  to come back as a ``RankFailure`` on every rank: find's ``Found`` signal
  was taken for a failing example); a find that finds nothing raises
  ``NoSuchExample`` on every rank;
- a test that passes its own rank-private ``database=`` finds the shrunk
  failure stored in it on every rank and replays it first (only rank 0 used
  to write, so the other ranks failed, left the test, and rank 0 waited for
  them until the lockstep timeout);
- a rank that leaves a test while another waits for it in a Hypothesis run
  fails that rank at once, naming who left (was: a wait until the timeout).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

TESTS = '''
import os
import pytest
from hypothesis import find, given, settings, strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import NoSuchExample

RANK = os.environ["RANK"]


def _record(name, value):
    with open(os.path.join(os.environ["OUT_DIR"], f"{name}.rank{RANK}"), "w") as f:
        f.write(repr(value))


def test_find_returns_the_shrunk_example():
    v = find(st.lists(st.integers(0, 100)), lambda xs: sum(xs) > 150)
    _record("find", v)
    assert sum(v) > 150


def test_find_of_nothing_raises_no_such_example():
    with pytest.raises(NoSuchExample):
        find(st.integers(0, 10), lambda x: x > 10)


def test_own_database_round_trip(tmp_path):
    path = tmp_path / "db"
    calls = []

    def make(n):  # the same source each time: the same database key
        @settings(database=DirectoryBasedExampleDatabase(str(path)), max_examples=n,
                  deadline=None)
        @given(st.integers(0, 1000))
        def body(x):
            calls.append(x)
            assert x < 500
        return body

    with pytest.raises(AssertionError):
        make(200)()
    assert calls[-1] == 500 and any(path.iterdir()), (calls[-1], sorted(path.iterdir()))
    calls.clear()
    with pytest.raises(AssertionError):
        make(5)()
    assert calls[0] == 500
    _record("db", str(tmp_path))


def test_rank_one_leaves_between_two_runs():
    @given(st.integers())
    def inner(x):
        pass

    inner()
    assert RANK != "1", "rank 1 leaves the test here"
    inner()
'''


@pytest.fixture(autouse=True)
def _single_process():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("launches its own 2-rank world; run from a single process")


def test_find_and_own_database_work_in_lockstep_and_a_leaving_rank_fails_fast(tmp_path):
    (tmp_path / "test_gen.py").write_text(textwrap.dedent(TESTS))
    env = dict(os.environ, OUT_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "LAUNCH_SERVER", "DTENSOR_MUTANT", "PYTEST_ADDOPTS"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "pytest", "-p", "no:cacheprovider", f"--rootdir={tmp_path}", "-q", "-rA",
           "--lockstep-timeout=120", "test_gen.py"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=400)
    out = proc.stdout + proc.stderr
    assert "3 passed" in out and "1 failed" in out, out[-5000:]
    found = [(tmp_path / f"find.rank{r}").read_text() for r in (0, 1)]
    assert found[0] == found[1] and sum(eval(found[0])) > 150, found
    dbs = [(tmp_path / f"db.rank{r}").read_text() for r in (0, 1)]
    assert dbs[0] != dbs[1], dbs  # each rank had its own database, both hold the failure
    assert "rank(s) [1] left test_gen.py::test_rank_one_leaves_between_two_runs" in out, \
        out[-5000:]
    assert "rank 0 is waiting" not in out, out[-5000:]  # not the timeout's message
