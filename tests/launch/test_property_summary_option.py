"""Covers: tests/properties/conftest.py's per-property table: ``-q``
prints failures and pytest's summary only; the table is behind
``--property-summary``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNDER_TORCHRUN = "TORCHELASTIC_RUN_ID" in os.environ


def _run(*extra: str) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/properties/test_seeding.py", "-q",
         "-p", "no:cacheprovider", "--hypothesis-profile=ci",
         "-k", "reseeds and 2ranks", *extra],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    return p.stdout


@pytest.mark.slow  # several property runs in real worlds: the full run
def test_quiet_runs_print_no_property_table_unless_asked() -> None:
    if UNDER_TORCHRUN:
        pytest.skip("self-test starts its own worlds; run it with plain pytest")
    quiet = _run()
    assert "property summary" not in quiet and "pass  test_seeding.py" not in quiet, quiet
    assert "1 passed" in quiet, quiet
    asked = _run("--property-summary")
    assert "property summary" in asked, asked
    assert "pass  test_seeding.py::test_torch_manual_seed_reseeds[2ranks]" in asked, asked
