"""The static import graph of a package folder, for the layer tests of
``dtensor/`` and ``launch/`` and the quick tier's module check (importable by
name: ``tests/`` is on ``sys.path`` while its tests run).

Example:
    >>> graph = import_graph(module_files(ROOT, "launch"))
    >>> find_cycle(graph) is None
    True
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

Layers = tuple[tuple[str, tuple[str, ...]], ...]


def module_name(path: Path, root: Path = ROOT) -> str:
    """``root/a/b/c.py`` -> ``a.b.c``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_files(root: Path = ROOT, package: str = "dtensor") -> dict[str, Path]:
    """Every module of ``package`` (all subpackages) by dotted name."""
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements at any depth (functions too), except under
    ``if TYPE_CHECKING:``, which never runs."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for b in node.orelse for n in runtime_imports(b))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from runtime_imports(node)


def targets(node: ast.Import | ast.ImportFrom, name: str, is_pkg: bool,
            files: dict) -> list[str]:
    """The dotted names one import statement of module ``name`` reaches:
    ``from a import b`` is ``a.b`` where that is in ``files``, else ``a``."""
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
    """Module -> the modules among ``files`` it imports. A submodule's
    implicit import of its parent package is not an edge."""
    graph = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        edges = set()
        for node in runtime_imports(ast.parse(path.read_text())):
            edges.update(t for t in targets(node, name, is_pkg, files)
                         if t in files and t != name)
        graph[name] = edges
    return graph


def outside_imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports of one file (any depth)."""
    out = set()
    for node in runtime_imports(ast.parse(path.read_text())):
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


def layers_of(module: str, layers: Layers) -> list[int]:
    """The indices in ``layers`` whose entries hold ``module`` (one, when
    right). Entries are paths in the package; ``pkg/`` holds all of ``pkg``."""
    parts = module.split(".")[1:]
    path = "/".join(parts) + ".py" if parts else "__init__.py"
    return [i for i, (_, entries) in enumerate(layers) for e in entries
            if path == e or (e.endswith("/") and parts and parts[0] + "/" == e)]


def upward_imports(graph: dict[str, set[str]], layers: Layers) -> list[str]:
    """Each import that runs from a lower layer up to a higher one, as text."""
    out = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            la, lb = layers_of(a, layers), layers_of(b, layers)
            if len(la) == 1 and len(lb) == 1 and lb[0] > la[0]:
                out.append(f"{a} ({layers[la[0]][0]}) imports {b} ({layers[lb[0]][0]})")
    return out


def doc_layers(doc: Path) -> list[tuple[str, tuple[str, ...]]]:
    """The table under ``## Layers`` in ``doc``: (layer, the backquoted
    entries of its second column) a row."""
    section = doc.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
            continue
        rows.append((cells[0], tuple(re.findall(r"`([^`]+)`", cells[1]))))
    return rows
