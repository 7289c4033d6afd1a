"""Covers: launch/sim/fanout.py (a ``@given`` argument that holds rank state,
a mesh, is drawn on every rank thread), launch/sim/inner_given.py (an inner
``@given`` in a simulated world fails at once with what to write instead),
launch/modes/simulated.py.

Black-box, in a repository outside this one with no conftest and no pytest
configuration: every documented ``@given`` form gives a simulated world the
verdict a real world gives, or the error that names the form.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from _user_repo import run_in
from childrun import _junit

FORMS = '''
import pytest, torch, torch.distributed as dist
from hypothesis import given, settings, strategies as st
from dtensor import distribute_tensor
from dtensor.testing.strategies import distributed_inputs

@pytest.mark.world_size(2)
@settings(max_examples=20, derandomize=True, database=None)
@given(inp=distributed_inputs(world_size=2, max_ndim=1))
def test_given_on_the_test(world, inp):
    dt = distribute_tensor(inp.tensor, inp.mesh, inp.placements)
    full = dt.full_tensor()
    assert (full.shape, full.dtype) == (inp.tensor.shape, inp.tensor.dtype)

@pytest.mark.world_size(2)
@settings(max_examples=20, derandomize=True, database=None)
@given(inp=distributed_inputs(world_size=2, max_ndim=1))
def test_given_on_the_test_fails(world, inp):
    dt = distribute_tensor(inp.tensor, inp.mesh, inp.placements)
    assert dt.full_tensor().numel() < 3, "planted"

@pytest.mark.world_size(2)
@settings(max_examples=20, derandomize=True, database=None)
@given(data=st.data())
def test_through_data(world, data):
    inp = data.draw(distributed_inputs(world_size=2, max_ndim=1))
    dt = distribute_tensor(inp.tensor, inp.mesh, inp.placements)
    full = dt.full_tensor()
    assert (full.shape, full.dtype) == (inp.tensor.shape, inp.tensor.dtype)
'''
INNER = '''
import pytest, torch, torch.distributed as dist
from hypothesis import given, settings, strategies as st

@pytest.mark.world_size(2)
def test_inner_given(world):
    @settings(max_examples=5)
    @given(st.integers(100 * world.rank, 100 * world.rank + 5))
    def check(x):
        t = torch.ones(1); dist.all_reduce(t)
    check()
'''


def run(repo: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``pytest *args`` in the user's repository, a junit report beside."""
    return run_in(repo, "-m", "pytest", "-p", "no:cacheprovider", "--junitxml=junit.xml",
                  *args, timeout=timeout)


EXPECTED = {"test_given_on_the_test": "passed", "test_given_on_the_test_fails": "failed",
            "test_through_data": "passed"}


def test_given_forms_in_a_simulated_world(user_repo):
    (user_repo / "test_forms.py").write_text(FORMS)
    p = run(user_repo, "--dist-sim", "-q", "test_forms.py", timeout=200)
    assert _junit(user_repo / "junit.xml") == EXPECTED, p.stdout
    assert "planted" in p.stdout and "not initialized in the world group map" not in p.stdout


@pytest.mark.slow
def test_given_forms_in_a_real_world_give_the_same_verdicts(user_repo):
    (user_repo / "test_forms.py").write_text(FORMS)
    p = run(user_repo, "-q", "test_forms.py")
    assert _junit(user_repo / "junit.xml") == EXPECTED, p.stdout


def test_an_inner_given_in_a_simulated_world_says_what_to_write(user_repo):
    (user_repo / "test_inner.py").write_text(INNER)
    p = run(user_repo, "--dist-sim", "-q", "--dist-timeout=60", "test_inner.py", timeout=120)
    assert _junit(user_repo / "junit.xml") == {"test_inner_given": "failed"}, p.stdout
    assert "InnerGivenInSimWorld" in p.stdout, p.stdout
    assert "test_inner_given.<locals>.check is an inner @given" in p.stdout, p.stdout
    assert "@given(data=st.data())" in p.stdout, p.stdout
    assert "timed out" not in p.stdout and "Exception in thread" not in p.stdout, p.stdout
