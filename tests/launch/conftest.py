"""Helpers for the test service's black-box self-tests: write a child suite
into a temporary folder and run it in a subprocess (torchrun, ``python -m
launch``, or plain pytest), returning its output, outcomes and timings, and
checking that it left no process behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from childrun import ROOT, UNDER_TORCHRUN, _junit, _processes_in, _stamps

CHILD_CONFTEST = '''
import os, time
import pytest

pytest_plugins = ["launch.plugin"]


@pytest.fixture
def stamp():
    """stamp(name): record when this rank got here (the self-test's clock)."""
    def record(name):
        with open(os.path.join(os.environ["STAMPS_DIR"], "stamps.txt"), "a") as f:
            f.write(f"{name} {os.environ.get('RANK', '-')} {time.time()!r}\\n")
    return record
'''
CHILD_INI = """[pytest]
markers =
    world_size(n): ranks
    dist_timeout(seconds): watchdog
    timeout(seconds): legacy watchdog
"""


@dataclass
class Child:
    rc: int
    out: str
    start: float  # time.time() when the command started
    end: float  # ... and when it ended
    outcomes: dict[str, str]  # test name -> passed/failed/error/skipped (junit.xml)
    stamps: dict[str, float]  # stamp name -> first time.time() any rank recorded it
    dir: Path

    @property
    def seconds(self) -> float:
        return self.end - self.start


@pytest.fixture
def child(tmp_path: Path):
    """``child(files, *cmd, timeout=...)`` runs ``python cmd`` in a folder holding
    files (plus a conftest with the plugin and a ``stamp`` fixture) and checks
    that no process of the run is left once it ended."""

    if UNDER_TORCHRUN:
        pytest.skip("self-test starts its own worlds; run it with plain pytest")

    def run(files: dict[str, str], *cmd: str, timeout: float = 300) -> Child:
        (tmp_path / "conftest.py").write_text(CHILD_CONFTEST)
        (tmp_path / "pytest.ini").write_text(CHILD_INI)
        for name, text in files.items():
            (tmp_path / name).write_text(textwrap.dedent(text))
        (tmp_path / "junit.xml").unlink(missing_ok=True)
        (tmp_path / "stamps.txt").unlink(missing_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env["STAMPS_DIR"] = str(tmp_path)
        for k in ("PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST"):
            env.pop(k, None)
        start = time.time()
        p = subprocess.run([sys.executable, *cmd], cwd=tmp_path, env=env, timeout=timeout,
                           capture_output=True, text=True)
        end = time.time()
        left = _processes_in(tmp_path)
        assert not left, f"processes left behind: {left}\n{p.stdout}{p.stderr}"
        return Child(p.returncode, p.stdout + p.stderr, start, end,
                     _junit(tmp_path / "junit.xml"), _stamps(tmp_path / "stamps.txt"), tmp_path)

    return run
