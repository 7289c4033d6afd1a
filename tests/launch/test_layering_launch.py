"""Covers: the layers of ``launch/`` and its distance from the runtime.

``LAYERS`` is the layer table of the test service (docs/test-service.md shows
the same table; a test compares them). Every module under ``launch/``, in
every subpackage, sits in exactly one layer and imports only from its own
layer or the ones below; the package has no import cycle; and no module of
it imports ``dtensor`` (statically, or at run time when every module is
imported), so any torch.distributed project can use it. Imports inside
functions count: a lazy import that runs up, or closes a loop, is still one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import _graph
from _graph import (
    ROOT,
    doc_layers,
    find_cycle,
    import_graph,
    module_files,
    outside_imports,
)

PACKAGE = "launch"

# Bottom to top; paths relative to launch/ ("pkg/": the package and all in it).
# A new module goes into the layer of what it serves; then add it to the table
# in docs/test-service.md too.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("package", ("__init__.py", "_moved.py")),
    ("shared", ("world.py", "agree.py", "hookspecs.py")),
    ("rank", ("rank/",)),
    ("hypothesis", ("hypo/",)),
    ("simulated world", ("sim/",)),
    ("modes", ("modes/",)),
    ("plugins", ("plugin.py", "shuffle.py", "torchbases/", "hypothesis_lockstep.py",
                 "given_lockstep.py")),
    ("fuzzing", ("fuzz/",)),
    ("command line", ("cli.py", "__main__.py")),
)


def _files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    return module_files(root, package)


def layers_of(module: str, layers=LAYERS) -> list[int]:
    return _graph.layers_of(module, layers)


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    return _graph.upward_imports(graph, layers)


def test_the_checks_find_what_they_look_for() -> None:
    layers = (("low", ("a.py",)), ("high", ("b.py", "pkg/")))
    graph = {"launch.a": {"launch.pkg.deep.x"}, "launch.b": {"launch.a"},
             "launch.pkg.deep.x": set()}
    assert upward_imports(graph, layers) == [
        "launch.a (low) imports launch.pkg.deep.x (high)"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [
        "a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_lazy_relative_and_nested_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "launch"
    (pkg / "fuzz").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "fuzz" / "__init__.py").write_text("")
    (pkg / "world.py").write_text("def f():\n    from launch.fuzz import probe\n")
    (pkg / "fuzz" / "probe.py").write_text("from .. import world\nimport dtensor.mesh\n")
    files = _files(tmp_path, "launch")
    graph = import_graph(files)
    assert graph["launch.world"] == {"launch.fuzz.probe"}
    assert graph["launch.fuzz.probe"] == {"launch.world"}
    assert find_cycle(graph) == ["launch.fuzz.probe", "launch.world", "launch.fuzz.probe"]
    assert "dtensor" in outside_imports(files["launch.fuzz.probe"])


def test_every_module_has_one_layer_and_every_entry_a_file() -> None:
    files = _files()
    assert any(m.startswith("launch.fuzz.") for m in files)  # the scan is recursive
    placed = {m: layers_of(m) for m in files}
    missing = sorted(m for m, ls in placed.items() if not ls)
    assert not missing, f"modules in no layer of LAYERS (add them): {missing}"
    twice = sorted(m for m, ls in placed.items() if len(ls) > 1)
    assert not twice, f"modules in more than one layer: {twice}"
    gone = [e for _, es in LAYERS for e in es if not (ROOT / PACKAGE / e).exists()]
    assert not gone, f"LAYERS names files that do not exist: {gone}"


def test_no_import_runs_up_the_layers() -> None:
    up = upward_imports(import_graph(_files()))
    assert not up, "imports that run up the layers:\n" + "\n".join(up)


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph(_files()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_launch_module_imports_dtensor() -> None:
    bad = {str(p.relative_to(ROOT)): "dtensor" for p in _files().values()
           if "dtensor" in outside_imports(p)}
    assert not bad, f"launch/ imports the runtime: {sorted(bad)}"


def test_importing_every_launch_module_loads_no_dtensor() -> None:
    mods = sorted(m for m in _files() if not m.endswith("__main__"))
    code = (f"import importlib, sys\nfor m in {mods!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'dtensor'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_the_documented_layer_table_is_this_one() -> None:
    want = [(name, tuple(sorted(es))) for name, es in LAYERS]
    got = [(name, tuple(sorted(es)))
           for name, es in doc_layers(ROOT / "docs" / "test-service.md")]
    assert got == want, (
        "docs/test-service.md's layer table differs from LAYERS in "
        f"tests/launch/test_layering_launch.py:\n doc:    {got}\n LAYERS: {want}")
