"""Covers: package layering. ``LAYERS`` is the layer table of ``dtensor/``
(docs/architecture.md shows the same table; a test compares them): every
runtime module sits in exactly one layer and imports only from its own layer
or the ones below. The runtime never imports the test service or
``dtensor.testing``, only ``dtensor/_comm.py`` calls collectives, and neither
``dtensor/`` nor ``launch/`` has an import cycle (imports inside functions
count: a lazy import that closes a loop, or runs up, is still one)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import _graph
import pytest
from _graph import find_cycle

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


_FIRST_USE = r"""
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
from dtensor import DeviceMesh, Replicate, Shard, distribute_tensor
mesh = DeviceMesh("cpu", [0])
print("after a mesh:", sorted(m for m in ("sympy", "torch._dynamo") if m in sys.modules))
x = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
((x + 1).detach() * 2).sum(0).redistribute(mesh, [Replicate()])
print("after ops:", "torch._dynamo" in sys.modules)
"""


def test_first_mesh_and_ops_import_neither_sympy_nor_dynamo(fresh_process) -> None:
    """A fresh process's first mesh imported sympy (torch.unravel_index,
    ~0.6 s) and its first op torch._dynamo (the binding probe's dispatch mode,
    ~0.8 s). (The first op on any tensor subclass still imports
    torch.distributed.tensor, and with it sympy: torch does that itself.)"""
    out = fresh_process(_FIRST_USE, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "after a mesh: []" in out.stdout, out.stdout
    assert "after ops: False" in out.stdout, out.stdout


# Import cycles -------------------------------------------------------------------
def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (at any depth of the file)."""
    return _graph.import_graph(_graph.module_files(ROOT, package))


def test_find_cycle_names_the_loop() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("package", ["dtensor", "launch"])
def test_no_import_cycles(package: str) -> None:
    cycle = find_cycle(import_graph(package))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The layer table ----------------------------------------------------------------
# Bottom to top; paths relative to dtensor/ ("pkg/": the package and all in it).
# A new module goes into the layer of what it serves; then add it to the table
# in docs/architecture.md too.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("values", ("errors.py", "placement.py")),
    ("layout math", (
        "spec.py", "_philox.py", "_random_blocks.py", "random.py", "_plan_cost.py",
        "_persist.py", "_norm_wire.py",
    )),
    ("comm", (
        "_comm.py", "_async.py", "_groups.py", "_rank_state.py", "_seeding.py", "mesh.py",
        "_mesh_build.py",
        "_mesh_layout.py",
        "_compile.py", "_local_check.py",
    )),
    ("redistribute", ("redistribute.py", "strided.py")),
    ("sharding", ("sharding.py", "rules/")),
    ("dispatch", ("dispatch/",)),
    ("tensor", (
        "tensor.py", "distribute.py", "factories.py", "interop.py", "experimental.py",
        "checkpoint.py", "debug.py", "_module_tracker.py", "module.py", "_tensor_grad.py",
        "_arith.py", "_optim.py",
    )),
    ("parallel", ("parallel/",)),
    ("fsdp", ("fsdp/",)),
    ("package", ("__init__.py",)),
    ("testing", ("testing/",)),
)


def layer_of(module: str, layers=LAYERS) -> int | None:
    """The index in ``layers`` of a module of ``dtensor`` (None: in no layer)."""
    return next(iter(_graph.layers_of(module, layers)), None)


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    return _graph.upward_imports(graph, layers)


def test_upward_imports_are_found() -> None:
    layers = (("low", ("a.py",)), ("high", ("b.py", "pkg/")))
    graph = {"dtensor.a": {"dtensor.pkg.x"}, "dtensor.b": {"dtensor.a"}, "dtensor.pkg.x": set()}
    assert upward_imports(graph, layers) == [
        "dtensor.a (low) imports dtensor.pkg.x (high)"
    ]


def test_every_module_has_one_layer_and_every_entry_a_module() -> None:
    graph = import_graph("dtensor")
    missing = sorted(m for m in graph if layer_of(m) is None)
    assert not missing, f"modules in no layer of LAYERS (add them): {missing}"
    entries = [e for _, es in LAYERS for e in es]
    assert len(entries) == len(set(entries)), "an entry stands in two layers"
    gone = [e for e in entries if not (ROOT / "dtensor" / e).exists()]
    assert not gone, f"LAYERS names files that do not exist: {gone}"


def test_no_import_runs_up_the_layers() -> None:
    up = upward_imports(import_graph("dtensor"))
    assert not up, "imports that run up the layers:\n" + "\n".join(up)


def _doc_layers() -> list[tuple[str, tuple[str, ...]]]:
    """The layer table of docs/architecture.md: (layer, files column's entries)."""
    return _graph.doc_layers(ROOT / "docs" / "architecture.md")


def test_the_documented_layer_table_is_this_one() -> None:
    doc = _doc_layers()
    want = [(name, tuple(sorted(es))) for name, es in LAYERS]
    got = [(name, tuple(sorted(es))) for name, es in doc]
    assert got == want, (
        "docs/architecture.md's layer table differs from tests/test_layering.py's "
        f"LAYERS:\n doc:   {got}\n LAYERS: {want}"
    )
