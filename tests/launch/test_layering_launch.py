"""Covers: launch/ stands apart from the runtime: no module of the test
service imports ``dtensor`` (statically, or at run time when the plugin and
every mode are imported), so any torch.distributed project can use it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = sorted((ROOT / "launch").glob("*.py"))


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_no_launch_module_imports_dtensor() -> None:
    assert len(LAUNCH) >= 10  # the scan sees the package
    bad = {p.name: sorted(n for n in _imported(p) if n.split(".")[0] == "dtensor")
           for p in LAUNCH}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_importing_every_launch_module_loads_no_dtensor() -> None:
    mods = [f"launch.{p.stem}" for p in LAUNCH if p.stem != "__main__"]
    code = (f"import importlib, sys\nfor m in {mods!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'dtensor'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
