"""Covers: the quick tier, ``pytest tests/ -m quick``: every module of
``dtensor/`` and ``launch/`` is imported by code it runs.

Statically, from what the quick tier runs: test files' module-level code,
helpers and the one test each file gives the tier, the modules tests import from their own folders, the
conftests, child suites and ``-m``/``-p`` module names that quick tests hand
to subprocesses, and the plugins ``pyproject.toml`` registers; then all those
modules import (``pytest_plugins`` included), their parent packages too. A
module reached only from ``slow`` tests is named in the failure: give it a
quick test. Importing is not running every line; this check is a floor.
"""

from __future__ import annotations

import ast
import re
from itertools import pairwise
from pathlib import Path

from _graph import ROOT, import_graph, module_files, runtime_imports, targets

PACKAGES = ("dtensor", "launch")


def _marked_slow(node: ast.AST) -> bool:
    """``pytest.mark.slow`` (or a name bound to it, ``slow``) in a decorator
    or a ``pytestmark`` value."""
    return any((isinstance(n, ast.Attribute) and n.attr == "slow")
               or (isinstance(n, ast.Name) and n.id == "slow") for n in ast.walk(node))


def _file_is_slow(tree: ast.Module) -> bool:
    return any(isinstance(s, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "pytestmark" for t in s.targets)
        and _marked_slow(s.value) for s in tree.body)


def _quick_parts(tree: ast.Module) -> list[ast.AST]:
    """The statements of a test file the quick tier runs (``-m quick``, one
    test per file: tests/conftest.py picks the test a file names in
    ``QUICK = "..."`` (or a tuple of names), else its first test not marked ``slow``): module-level
    code, helpers and fixtures, and that one test (nothing when the module is
    marked ``slow``)."""
    if _file_is_slow(tree):
        return []
    named = next((s.value for s in tree.body if isinstance(s, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "QUICK" for t in s.targets)),
                 None)
    quick = None if named is None else set(ast.literal_eval(named)) \
        if isinstance(named, ast.Tuple) else {ast.literal_eval(named)}
    parts: list[ast.AST] = []
    chosen = False
    for s in tree.body:
        is_def = isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        is_test = is_def and s.name.startswith(("test", "Test"))
        if not is_test:
            parts.append(s)
        elif any(_marked_slow(d) for d in s.decorator_list):
            continue
        elif (quick is None and not chosen) or (quick is not None and s.name in quick):
            parts.append(s)
            chosen = True
    return parts


def _named_in_strings(parts: list[ast.AST], files: dict) -> set[str]:
    """Modules that code hands to a subprocess: the imports of a child suite
    written as a string, ``-m pkg`` (its ``__main__``) and ``-p module``."""
    out: set[str] = set()
    for part in parts:
        consts = [n.value for n in ast.walk(part)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        for prev, s in pairwise(["", *consts]):
            if prev == "-m" and f"{s}.__main__" in files:
                out.add(f"{s}.__main__")
            elif s in files:  # -p NAME, pytest_plugins, import_module
                out.add(s)
            elif "\n" in s:
                try:
                    suite = ast.parse(s)
                except SyntaxError:
                    continue
                out |= _named_in_strings([suite], files)
                for node in runtime_imports(suite):
                    out.update(targets(node, "__child__", False, files))
    return out


def _local_module(name: str, near: Path, test_root: Path) -> Path | None:
    for folder in (near, test_root):
        path = folder / (name.replace(".", "/") + ".py")
        if path.exists():
            return path
    return None


def reached_from(test_root: Path, root: Path = ROOT,
                 roots: set[str] = frozenset()) -> tuple[set[str], dict[str, Path]]:
    """(modules of ``PACKAGES`` the quick tier under ``test_root`` imports,
    all modules of ``PACKAGES``). ``roots``: modules loaded by every run."""
    files = {m: p for pkg in PACKAGES if (root / pkg).exists()
             for m, p in module_files(root, pkg).items()}
    start: set[str] = set(roots)
    seen: set[Path] = set()
    todo = [(p, True) for p in sorted(test_root.rglob("test_*.py"))]
    todo += [(p, False) for p in sorted(test_root.rglob("conftest.py"))]
    while todo:
        path, is_test_file = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        tree = ast.parse(path.read_text())
        parts = _quick_parts(tree) if is_test_file else [tree]
        start |= _named_in_strings(parts, files)
        for part in parts:
            for node in [part] if isinstance(part, (ast.Import, ast.ImportFrom)) \
                    else runtime_imports(part):
                for t in targets(node, "__test__", False, files):
                    while t and t not in files and "." in t:
                        t = t.rsplit(".", 1)[0]
                    if t in files:
                        start.add(t)
                    elif not getattr(node, "level", 0) and (
                            local := _local_module(t, path.parent, test_root)):
                        todo.append((local, False))
    graph = import_graph(files)
    for m, path in files.items():  # plugins a module names (pytest_plugins)
        graph[m] |= _named_in_strings([ast.parse(path.read_text())], files) - {m}
    reached: set[str] = set()
    todo_m = list(start)
    while todo_m:
        m = todo_m.pop()
        if m in reached:
            continue
        reached.add(m)
        parents = [m.rsplit(".", i)[0] for i in range(1, m.count(".") + 1)]
        todo_m += [*graph.get(m, ()), *parents]
    return reached, files


def _registered_plugins() -> set[str]:
    """Modules every pytest run loads: pyproject's pytest11 entry points and
    the simulated world's rank hook."""
    text = (ROOT / "pyproject.toml").read_text()
    block = text.split("[project.entry-points.pytest11]", 1)[1].split("\n[", 1)[0]
    names = set(re.findall(r'^"[^"]+"\s*=\s*"([\w.]+)"', block, re.M))
    names |= set(re.findall(r'dist_sim_rank_init\s*=\s*"([\w.]+)', text))
    return names


def test_the_walk_takes_one_test_per_file_and_follows_children_and_local_modules(
    tmp_path: Path,
) -> None:
    pkg = tmp_path / "dtensor"
    pkg.mkdir()
    for name in ("__init__", "a", "b", "c", "d", "e", "f", "g", "h", "i", "__main__"):
        (pkg / f"{name}.py").write_text("")
    (pkg / "a.py").write_text("pytest_plugins = ['dtensor.b']\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "local.py").write_text("import dtensor.e\n")
    (tests / "test_fast.py").write_text(
        "import pytest, local\nfrom dtensor import a\n"
        "@pytest.mark.slow\ndef test_s():\n    import dtensor.c\n"
        "def test_q():\n    run('-m', 'dtensor')\n"
        "def test_second():\n    import dtensor.g\n"
        "CHILD = '''\nimport dtensor.f\nprint(1)\n'''\n")
    (tests / "test_named.py").write_text(
        "QUICK = 'test_b'\ndef test_a():\n    import dtensor.h\n"
        "def test_b():\n    import dtensor.i\n")
    (tests / "test_slow.py").write_text(
        "import pytest\nimport dtensor.d\npytestmark = pytest.mark.slow\n")
    reached, files = reached_from(tests, tmp_path)
    # slow tests, a file's later tests and those its QUICK does not name
    assert set(files) - reached == {"dtensor.c", "dtensor.d", "dtensor.g", "dtensor.h"}


def test_every_module_of_dtensor_and_launch_is_reached_by_the_quick_tier() -> None:
    reached, files = reached_from(ROOT / "tests", ROOT, _registered_plugins())
    assert len(files) > 100, sorted(files)  # both packages, every subpackage
    missing = sorted(set(files) - reached)
    assert not missing, (
        "modules that only slow tests (or none) import; give each a test the "
        f"quick tier (pytest tests/ -m quick) runs: {missing}")


def test_collection_marks_the_named_tests_or_the_first_one_quick() -> None:
    """The conftest's choice at collection agrees with the walk above: the
    tests a file names in ``QUICK``, else its first test not marked slow."""
    import subprocess
    import sys

    files = ["tests/launch/test_old_spellings.py", "tests/test_rules.py"]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", *files, "-m", "quick", "--collect-only", "-q",
         "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    chosen = [line.split("::", 1)[1] for line in out.stdout.splitlines() if "::" in line]
    first = next(s.name for s in ast.parse((ROOT / files[1]).read_text()).body
                 if isinstance(s, ast.FunctionDef) and s.name.startswith("test")
                 and not any(_marked_slow(d) for d in s.decorator_list))
    assert sorted(chosen) == sorted([
        "test_p_hypothesis_lockstep_loads_the_profiles",
        "test_given_lockstep_in_pytest_plugins_loads_the_lockstep_plugin", first,
    ]), out.stdout + out.stderr
