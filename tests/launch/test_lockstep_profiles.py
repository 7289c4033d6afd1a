"""Covers: launch/hypo/lockstep.py (the Hypothesis profile the tests started
with is put back after each test) and launch/hypo/run.py (the ranks agree on
a run's settings before it starts), black-box from a repository with no
conftest, under torchrun N=2 and plain pytest.

Importing ``torch.testing._internal.common_utils`` registers PyTorch's own
``dev`` profile (10 examples, no database) over the repository's ``dev`` and
loads it for the rest of the process. When only
some ranks import it (a test of a 2-rank sub-world in a 4-rank job), a later
``find()`` reads the example database on the other ranks only, and every
rank waited for the others until the lockstep timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

TESTS = '''
import os
from hypothesis import find, settings, strategies as st

RANK = os.environ.get("RANK", "0")


def _record(name, value):
    with open(os.path.join(os.environ["OUT_DIR"], f"{name}.rank{RANK}"), "w") as f:
        f.write(repr(value))


settings.register_profile("dev", max_examples=40)  # a repository's own "dev"


def _profiles():
    return (settings.get_current_profile_name(), settings.default.max_examples,
            settings.get_profile("dev").max_examples, settings.default.database is None)


def test_a_import_on_rank_zero_loads_pytorchs_profile():
    _record("before", _profiles())
    if RANK == "0":
        import torch.testing._internal.common_utils  # noqa: F401
        # PyTorch's "dev" (or "pytorch_ci" where CI is set), no database
        assert settings.get_current_profile_name() in ("dev", "pytorch_ci")
        assert settings.get_profile("dev").max_examples == 10


def test_b_find_after_it_runs_with_the_sessions_profile():
    _record("after", _profiles())
    assert find(st.integers(0, 100), lambda x: x > 50) == 51


def test_c_a_profile_loaded_on_one_rank_inside_a_test_is_refused_at_once():
    if RANK == "0":
        # find() sets its own max_examples: differ in what it keeps
        settings.register_profile("few", derandomize=not settings.default.derandomize)
        settings.load_profile("few")
    assert find(st.integers(0, 100), lambda x: x > 50) == 51
'''


@pytest.fixture(autouse=True)
def _single_process():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("launches its own 2-rank world; run from a single process")


def _env(tmp_path):
    env = dict(os.environ, OUT_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "LAUNCH_SERVER", "DTENSOR_MUTANT", "PYTEST_ADDOPTS"):
        env.pop(k, None)
    return env


def _write(tmp_path):
    (tmp_path / "test_gen.py").write_text(textwrap.dedent(TESTS))


def test_a_profile_loaded_by_a_test_on_some_ranks_does_not_outlive_it(tmp_path):
    _write(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "pytest", "-p", "no:cacheprovider", f"--rootdir={tmp_path}", "-q", "-rA",
           "--lockstep-timeout=60", "test_gen.py"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert "2 passed" in out and "1 failed" in out, out[-5000:]
    before = [(tmp_path / f"before.rank{r}").read_text() for r in (0, 1)]
    after = [(tmp_path / f"after.rank{r}").read_text() for r in (0, 1)]
    assert before[0] == before[1] and after[0] == after[1], (before, after)
    assert after[0] == before[0] and eval(after[0])[2] == 40, (before, after)
    # the third test: refused at once on every rank, naming the settings
    assert "different Hypothesis settings" in out, out[-5000:]
    assert "derandomize=True" in out and "derandomize=False" in out, out[-5000:]
    assert "did not report within" not in out, out[-5000:]


def test_under_plain_pytest_the_next_test_gets_the_sessions_profile_back(tmp_path):
    _write(tmp_path)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--rootdir={tmp_path}",
           "-q", "test_gen.py"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert "3 passed" in out, out[-5000:]
    before = (tmp_path / "before.rank0").read_text()
    after = (tmp_path / "after.rank0").read_text()
    assert after == before and eval(after)[2] == 40, (before, after)
