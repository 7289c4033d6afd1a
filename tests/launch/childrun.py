"""Plain helpers shared by the service's self-tests (importable by name:
``tests/launch`` is on ``sys.path`` while its tests run)."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

from _user_repo import processes_in as _processes_in  # noqa: F401 (re-exported)

ROOT = Path(__file__).resolve().parents[2]
UNDER_TORCHRUN = "RANK" in os.environ  # children would start worlds on every rank


def _junit(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = [c.tag for c in case]
        out[case.get("name")] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                                 else "skipped" if "skipped" in kinds else "passed")
    return out


def _stamps(path: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            name, _, t = line.split()
            out[name] = min(out.get(name, float("inf")), float(t))
    return out
