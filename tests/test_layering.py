"""Covers: package layering. The runtime never imports the test service or
``dtensor.testing``, and only ``dtensor/_comm.py`` calls collectives."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNTIME = [p for p in (ROOT / "dtensor").rglob("*.py") if "testing" not in p.parts]
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "broadcast", "barrier", "send", "recv", "gather", "scatter",
}


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_runtime_never_imports_the_test_service() -> None:
    for path in RUNTIME:
        bad = {n for n in _imports(path) if n.split(".")[0] == "launch" or n.startswith("dtensor.testing")}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_only_comm_calls_torch_distributed_collectives() -> None:
    for path in RUNTIME:
        if path.name == "_comm.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in COLLECTIVES
                and isinstance(node.value, ast.Name)
                and node.value.id == "dist"
            ):
                raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno} calls dist.{node.attr}")


def test_importing_dtensor_loads_neither_launch_nor_testing() -> None:
    code = "import sys, dtensor; print(sorted(m for m in sys.modules if m.startswith(('launch', 'dtensor.testing'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
