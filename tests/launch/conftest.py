"""Helpers for the test service's black-box self-tests: write a child suite
into a temporary folder and run it in a subprocess (torchrun, ``python -m
launch``, or plain pytest), returning its output and outcomes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNDER_TORCHRUN = "RANK" in os.environ  # children would start worlds on every rank

CHILD_CONFTEST = 'pytest_plugins = ["launch.plugin"]\n'
CHILD_INI = """[pytest]
markers =
    world_size(n): ranks
    timeout(seconds): watchdog
"""


@dataclass
class Child:
    rc: int
    out: str
    seconds: float
    outcomes: dict[str, str]  # test name -> passed/failed/error/skipped
    dir: Path


@pytest.fixture
def child(tmp_path: Path):
    """``child(files, *cmd, timeout=...)`` runs cmd in a folder holding files."""

    if UNDER_TORCHRUN:
        pytest.skip("self-test starts its own worlds; run it with plain pytest")

    def run(files: dict[str, str], *cmd: str, timeout: float = 240) -> Child:
        (tmp_path / "conftest.py").write_text(CHILD_CONFTEST)
        (tmp_path / "pytest.ini").write_text(CHILD_INI)
        for name, text in files.items():
            (tmp_path / name).write_text(textwrap.dedent(text))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.pop("PYTEST_XDIST_WORKER", None)
        env.pop("PYTEST_ADDOPTS", None)
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, *cmd], cwd=tmp_path, env=env, timeout=timeout,
                           capture_output=True, text=True)
        seconds = time.monotonic() - t0
        return Child(p.returncode, p.stdout + p.stderr, seconds,
                     _junit(tmp_path / "junit.xml"), tmp_path)

    return run


def _junit(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = [c.tag for c in case]
        out[case.get("name")] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                                 else "skipped" if "skipped" in kinds else "passed")
    return out

