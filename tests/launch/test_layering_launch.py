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

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


# The import graph ---------------------------------------------------------------
def _files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    out = {}
    for p in (root / package).rglob("*.py"):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import statements at any depth (functions too), except under
    ``if TYPE_CHECKING:``, which never runs."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for b in node.orelse for n in _imports(b))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def _targets(node: ast.AST, name: str, is_pkg: bool, files: dict) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        anchor = name.split(".")
        anchor = anchor[: len(anchor) - node.level + (1 if is_pkg else 0)]
        base = ".".join([*anchor, base] if base else anchor)
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
            for a in node.names]


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports. ``from a import b`` is
    an edge to ``a.b`` where that is a module, else to ``a``; a submodule's
    implicit import of its parent package is not an edge."""
    graph = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        edges = set()
        for node in _imports(ast.parse(path.read_text())):
            edges.update(t for t in _targets(node, name, is_pkg, files)
                         if t in files and t != name)
        graph[name] = edges
    return graph


def outside_imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports of one file (any depth)."""
    out = set()
    for node in _imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


# The layers -----------------------------------------------------------------------
def layers_of(module: str, layers=LAYERS) -> list[int]:
    """The indices in ``layers`` whose entries hold ``module`` (one, when right)."""
    parts = module.split(".")[1:]
    path = "/".join(parts) + ".py" if parts else "__init__.py"
    return [i for i, (_, entries) in enumerate(layers) for e in entries
            if path == e or (e.endswith("/") and parts and parts[0] + "/" == e)]


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Each import that runs from a lower layer up to a higher one, as text."""
    out = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            la, lb = layers_of(a, layers), layers_of(b, layers)
            if len(la) == 1 and len(lb) == 1 and lb[0] > la[0]:
                out.append(f"{a} ({layers[la[0]][0]}) imports {b} ({layers[lb[0]][0]})")
    return out


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


def _doc_layers() -> list[tuple[str, tuple[str, ...]]]:
    """The layer table of docs/test-service.md: (layer, modules column's entries)."""
    text = (ROOT / "docs" / "test-service.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
            continue
        rows.append((cells[0], tuple(re.findall(r"`([^`]+)`", cells[1]))))
    return rows


def test_the_documented_layer_table_is_this_one() -> None:
    want = [(name, tuple(sorted(es))) for name, es in LAYERS]
    got = [(name, tuple(sorted(es))) for name, es in _doc_layers()]
    assert got == want, (
        "docs/test-service.md's layer table differs from LAYERS in "
        f"tests/launch/test_layering_launch.py:\n doc:    {got}\n LAYERS: {want}")
