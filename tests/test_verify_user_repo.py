"""Covers: dtensor/testing/pytest_plugin.py and dtensor/testing/verify.py
(``rule_test``) black-box: a repository with no conftest and no pytest
configuration verifies its own op's rule under ``torchrun
--nproc_per_node=4 -m pytest`` and ``pytest --dist-sim``; a wrong rule fails
there with its counterexample.

The plugin is named with ``-p`` here: the ``pytest11`` entry point in
``pyproject.toml`` loads it by itself once the package is (re)installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = '''
import pytest, torch
from dtensor import Partial, Replicate, Sharding, register_rule
from dtensor.testing import rule_test

@torch.library.custom_op("userrepo::scale", mutates_args=())
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 3

@scale.register_fake
def _(x):
    return torch.empty_like(x)

@torch.library.custom_op("userrepo::relu", mutates_args=())
def relu(x: torch.Tensor) -> torch.Tensor:
    return x.clamp_min(0)

@relu.register_fake
def _(x):
    return torch.empty_like(x)

@register_rule(torch.ops.userrepo.scale.default)
def scale_rule(call):
    (spec,) = call.specs
    return Sharding(inputs=(None,), outputs=(spec.placements,))

@register_rule(torch.ops.userrepo.relu.default)
def relu_rule(call):  # wrong: keeps a Partial through relu
    (spec,) = call.specs
    return Sharding(inputs=(None,), outputs=(spec.placements,))

test_scale = rule_test(torch.ops.userrepo.scale.default, world_size=4, max_examples=15)
test_relu = rule_test(torch.ops.userrepo.relu.default, world_size=4, max_examples=200)

@pytest.mark.world_size(4)
def test_fixture(dtensor_verify):
    dtensor_verify.rule(torch.ops.userrepo.scale.default, max_examples=10)
'''


def _run(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([*args, "-p", "no:cacheprovider", "-p",
                           "dtensor.testing.pytest_plugin", "-q", "test_my_op.py"],
                          cwd=tmp, env=env, timeout=600, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "test_my_op.py").write_text(REPO)
    return tmp_path


def _torchrun() -> str:
    return shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")


@pytest.mark.skipif("LOCAL_RANK" in os.environ, reason="launches its own worlds")
def test_user_repo_under_torchrun(repo: Path) -> None:
    p = _run(repo, _torchrun(), "--nproc_per_node=4", "-m", "pytest")
    out = p.stdout
    assert "1 failed, 2 passed" in out, out[-4000:]
    assert "test_relu" in out and "sharding rule counterexample" in out, out[-4000:]


@pytest.mark.skipif("LOCAL_RANK" in os.environ, reason="launches its own worlds")
def test_user_repo_in_a_simulated_world(repo: Path) -> None:
    p = _run(repo, sys.executable, "-m", "pytest", "--dist-sim", "-k", "scale or relu")
    out = p.stdout
    assert "1 failed, 1 passed" in out, out[-4000:]
    assert "sharding rule counterexample" in out, out[-4000:]
