"""Covers: launch/hypo/profiles.py end to end, black-box: a 2-rank
torchrun world runs a generated test file and we read its report.

- a failure on rank 1 only is raised on both ranks, which shrink to the same
  minimal example and print the replay command;
- ranks that draw different examples stop with a divergence error naming the
  first differing rank (no hang, no shrinking);
- with a random seed (the ``dev`` profile) every rank draws the same examples.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TESTS = '''
import json, os
import pytest
from hypothesis import given, strategies as st

@pytest.mark.world_size(2)
@given(x=st.integers(0, 1000))
def test_fails_on_rank_one_only(world, x):
    if world.rank == 1:
        assert x < 7

@pytest.mark.world_size(2)
@given(data=st.data())
def test_rank_dependent_draws_diverge(world, data):
    x = data.draw(st.integers(0, 100))
    if world.rank == 1 and x > 20:
        data.draw(st.integers(0, 3))

@pytest.mark.world_size(2)
@given(x=st.integers(), y=st.text())
def test_every_rank_draws_the_same(world, x, y):
    with open(os.path.join(os.environ["DRAWS_DIR"], f"rank{world.rank}"), "a") as f:
        f.write(json.dumps([x, y]) + "\\n")
'''


def _run(tmp_path: Path, *args: str) -> str:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["launch.plugin"]\n')
    (tmp_path / "test_generated.py").write_text(textwrap.dedent(TESTS))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               DRAWS_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "LAUNCH_SERVER", "DTENSOR_MUTANT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "pytest", "-p", "launch.hypo.profiles", "-p", "no:cacheprovider",
           f"--rootdir={tmp_path}", "-q", *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    return proc.stdout + proc.stderr


@pytest.fixture(autouse=True)
def _single_process():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("launches its own 2-rank world; run from a single process")


def test_failures_agree_shrink_identically_and_divergence_is_named(tmp_path):
    out = _run(tmp_path, "test_generated.py::test_fails_on_rank_one_only",
               "test_generated.py::test_rank_dependent_draws_diverge",
               "--hypothesis-profile=ci")
    assert "example failed on rank(s) [1] of [0, 1]: x=7" in out, out[-3000:]
    # both ranks report it (one block when their reports are the same text)
    assert "ranks 0–1, same error (call)" in out or (
        "rank 0 (call)" in out and "rank 1 (call)" in out), out[-3000:]
    assert out.count("x=7") >= 2  # both ranks report the same minimal example
    assert "Replay: torchrun --nproc_per_node=2 -m pytest -p launch.hypo.profiles " \
        "'test_generated.py::test_fails_on_rank_one_only' --hypothesis-profile=ci" in out
    assert "ranks diverged at example" in out and "first differing rank is 1" in out
    assert "2 failed" in out


def test_random_seed_is_shared_by_all_ranks(tmp_path):
    out = _run(tmp_path, "test_generated.py::test_every_rank_draws_the_same",
               "--hypothesis-profile=dev")
    assert "1 passed" in out, out[-3000:]
    draws = [(tmp_path / f"rank{r}").read_text() for r in (0, 1)]
    assert draws[0] == draws[1] and draws[0].count("\n") >= 10
