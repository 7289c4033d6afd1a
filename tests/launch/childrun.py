"""Plain helpers shared by the service's self-tests (importable by name:
``tests/launch`` is on ``sys.path`` while its tests run)."""

from __future__ import annotations

import os
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNDER_TORCHRUN = "RANK" in os.environ  # children would start worlds on every rank


def _processes_in(folder: Path, wait: float = 10.0) -> list[str]:
    """Live processes whose working directory is ``folder`` (the run's own:
    torchrun, its ranks, worlds), after waiting up to ``wait`` s for them to go."""
    end = time.monotonic() + wait
    while True:
        found = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if Path(os.readlink(d / "cwd")) == folder.resolve() and (d / "stat").read_text() \
                        .split(") ", 1)[1][0] not in "ZX":
                    found.append(f"{d.name}: {(d / 'cmdline').read_bytes()[:200]!r}")
            except (OSError, IndexError):
                continue
        if not found or time.monotonic() > end:
            return found
        time.sleep(0.2)


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
