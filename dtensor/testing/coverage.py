"""Which input kinds each registered sharding rule was exercised with.

``install()`` wraps dispatch's propagation step (it runs once per new call
key: a new op, layout, shape, dtype, plain operand or keyword value) from
the outside, so the runtime never imports this module. Each call records,
for its op overload, the kinds of its inputs:

- ``in<i>:<placement>`` for tensor operand ``i`` on each mesh axis (``S(d)``,
  ``R``, ``P(sum)`` ...), ``in<i>:plain`` for a plain tensor operand;
- ``mesh<k>d``; ``even`` / ``uneven`` (a sharded dim not divisible by its
  pieces); ``empty`` (this rank's block of an operand holds nothing);
  ``outsider`` (this rank is not in the mesh);
- ``plain-other-dtype`` / ``0d-other-dtype`` (a plain operand whose dtype is
  not the first DTensor's), ``kwarg:<name>``, ``alias`` (one tensor passed
  twice).

The property suite's conftest installs it and ``dump``s each rank's record to
``build/rule-coverage/``; ``python -m dtensor.testing.coverage`` prints the
table per registered rule, the kinds its schema admits that no run drew, and
the rules with no entry at all.

Example:
    torchrun --nproc_per_node=4 -m pytest tests/properties -q --hypothesis-profile=ci
    python -m dtensor.testing.coverage            # the table
    python -m dtensor.testing.coverage --missing  # only what is missing
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

__all__ = ["DEFAULT_DIR", "NO_SCHEMA_CALL", "RECORD", "admitted", "dump", "install",
           "kinds_of", "load", "main", "missing", "reason"]

DEFAULT_DIR = Path("build") / "rule-coverage"
PARTIAL_KINDS = ("P(sum)", "P(avg)", "P(max)", "P(min)")
#: op overload name -> kinds seen (this process)
RECORD: dict[str, set[str]] = {}
#: Kinds a rule's schema admits that the suite leaves out, with the reason.
REASONS = {
    "outsider": "drawn by test_outsiders.py for its op families only",
    "mesh3d": "3-D meshes need 4+ ranks with a size-1 axis; drawn rarely",
    "mesh2d": "the schema sweep is 1-D; the schema-drawn property draws one op per "
    "example, so an op meets few meshes",
    "mesh1d": "the op's properties draw meshes over the world; no 1-D one drawn",
    "empty": "the schema calls' sides are 4 (schema_calls._N): a block is empty only "
    "under nested shards; the op-family properties draw sides 0-5 for their ops",
    "uneven": "sides of 4 split evenly over 2- and 4-rank axes; the op-family "
    "properties draw sides 0-5 for their ops",
    "even": "no even split drawn for this op",
    "alias": "one tensor passed twice: drawn by the alias-family and foreach "
    "properties for their ops only",
    "plain-other-dtype": "plain operands of another dtype: test_caches.py draws them "
    "for its ops only; the schema calls pass DTensors",
}
#: Rules no schema call reaches, with the reason (the property suite cannot
#: draw them: they have no entry, and the table says why).
NO_SCHEMA_CALL = {
    "aten._conj.default": "complex tensors only; the suite's dtypes are real",
    "aten.native_layer_norm_backward.default": "mean/rstd shapes depend on "
    "normalized_shape; covered by tests/test_ops_dist.py (layer_norm rows)",
    "aten.as_strided.default": "sizes and strides must fit the storage; no schema default",
    "aten.max_pool2d_with_indices_backward.default": "needs the forward's indices",
    "aten.avg_pool2d_backward.default": "grad_output shape follows kernel and stride",
    "aten.max_pool3d_with_indices.default": "5-D input with a 3-D kernel",
    "aten.avg_pool3d.default": "5-D input with a 3-D kernel",
    "aten._adaptive_avg_pool3d.default": "5-D input with a 3-D output size",
    "aten._fft_c2c.default": "complex input; the suite's dtypes are real; covered by "
    "tests/test_comm_audit_spatial_dist.py",
    "aten._fft_c2r.default": "complex input; the suite's dtypes are real; covered by "
    "tests/test_comm_audit_spatial_dist.py",
    "aten.grid_sampler_2d.default": "grid's last dim must be 2 (every schema-call side "
    "is 4); covered by tests/test_comm_audit_spatial_dist.py",
    "aten.grid_sampler_3d.default": "grid's last dim must be 3 (every schema-call side "
    "is 4); covered by tests/test_comm_audit_spatial_dist.py",
    "aten.linalg_cross.default": "the crossed dim must be 3 (every schema-call side "
    "is 4); covered by tests/test_comm_audit_misc_dist.py",
    "aten._native_batch_norm_legit.default": "1-D running statistics beside an N-d "
    "input (no ndim pattern gives it); covered by tests/test_comm_audit_norm_dist.py",
    "aten._native_batch_norm_legit_no_training.default": "1-D running statistics beside "
    "an N-d input (no ndim pattern gives it); covered by tests/test_comm_audit_norm_dist.py",
    "aten._batch_norm_with_update.default": "1-D running statistics beside an N-d input "
    "(no ndim pattern gives it); covered by tests/test_comm_audit_norm_dist.py",
    "aten.max_unpool3d.default": "5-D input with a 3-D output size; covered by "
    "tests/test_comm_audit_norm_dist.py",
}
#: Reasons for kinds named per operand or keyword (prefix or suffix match).
_PATTERN_REASONS = (
    ("kwarg:", "the schema calls leave keyword-only arguments at their defaults"),
    (":P(", "the schema-drawn property draws Partial for floating operands only, one "
     "op per example (4x the profile's examples over every overload); the fuzz "
     "profile draws more"),
    (":", "placements per operand: one op per example in the schema-drawn property; "
     "the fuzz profile draws more"),
)


def reason(kind: str) -> str:
    """Why the main job may leave ``kind`` out (every missing kind has one)."""
    if kind in REASONS:
        return REASONS[kind]
    for pattern, why in _PATTERN_REASONS:
        if pattern in kind:
            return why
    return "not drawn in this run"


def _pstr(p) -> str:
    name = type(p).__name__
    if name == "Shard":
        return f"S({p.dim})"
    if name == "Replicate":
        return "R"
    if name == "Partial":
        return f"P({p.reduce_op})"
    return str(p)


def kinds_of(call) -> set[str]:
    """The input kinds of one dispatch ``Call`` (see the module docstring)."""
    kinds: set[str] = set()
    mesh = None
    first_dtype = None
    seen: dict[int, int] = {}
    for i, (spec, o) in enumerate(zip(call.specs, call.operands, strict=True)):
        local = getattr(o, "_local_tensor", o)
        key = id(local)
        if key in seen:
            kinds.add("alias")
        seen[key] = i
        if spec is None:
            kinds.add(f"in{i}:plain")
            continue
        mesh = spec.mesh
        first_dtype = first_dtype or spec.tensor_meta.dtype
        for p in spec.placements:
            kinds.add(f"in{i}:{_pstr(p)}")
        for axis, p in enumerate(spec.placements):
            if type(p).__name__ == "Shard":
                size = spec.tensor_meta.shape[p.dim]
                kinds.add("uneven" if size % mesh.shape[axis] else "even")
        if local.numel() == 0 and spec.tensor_meta.shape.numel() > 0:
            kinds.add("empty")
    for spec, o in zip(call.specs, call.operands, strict=True):
        if spec is None and first_dtype is not None and o.dtype != first_dtype:
            kinds.add("0d-other-dtype" if o.dim() == 0 else "plain-other-dtype")
    if mesh is not None:
        kinds.add(f"mesh{mesh.ndim}d")
        if mesh.get_coordinate() is None:
            kinds.add("outsider")
    for name in call.kwargs:
        kinds.add(f"kwarg:{name}")
    return kinds


def install() -> None:
    """Record every propagated call's input kinds in ``RECORD`` (idempotent)."""
    from dtensor.dispatch import general

    if getattr(general.propagate, "_records_coverage", False):
        return
    original = general.propagate

    def propagate(call, info):
        try:
            RECORD.setdefault(str(call.func), set()).update(kinds_of(call))
        except Exception:  # noqa: BLE001 - recording must never change a result
            pass
        return original(call, info)

    propagate._records_coverage = True
    general.propagate = propagate


def dump(directory: Path | str = DEFAULT_DIR, name: str | None = None,
         run: str | None = None) -> Path:
    """Write ``RECORD`` as ``<directory>/<name>.json`` (default: the rank).

    Rank 0 also writes ``run`` (the command line) to ``run.txt``, which the
    table names: a run of one file records only what that file drew."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if name is None:
        rank = int(os.environ.get("RANK", "0"))
        name = f"rank{rank}"
        if rank == 0 and run is not None:
            (directory / "run.txt").write_text(run + "\n")
    path = directory / f"{name}.json"
    path.write_text(json.dumps({k: sorted(v) for k, v in sorted(RECORD.items())}))
    return path


def load(directory: Path | str = DEFAULT_DIR) -> dict[str, set[str]]:
    """Every rank's record under ``directory``, merged."""
    out: dict[str, set[str]] = {}
    for path in sorted(Path(directory).glob("*.json")):
        for op, kinds in json.loads(path.read_text()).items():
            out.setdefault(op, set()).update(kinds)
    return out


def admitted(func, seen: set[str]) -> set[str]:
    """The kinds ``func``'s schema admits: per tensor operand position seen,
    R, Shard of each dim seen there, every Partial kind; meshes of 1-3 axes;
    even and uneven shards; empty blocks; outsiders; plain operands of
    another dtype and aliasing where it takes two tensors; its keywords."""
    args = func._schema.arguments
    n_tensors = sum(1 for a in args if "Tensor" in str(a.type))
    positions = {k.split(":")[0] for k in seen if k.startswith("in")}
    out = {"mesh1d", "mesh2d", "mesh3d", "even", "uneven", "empty", "outsider"}
    for pos in positions:
        dims = {int(k.split("(")[1][0]) for k in seen if k.startswith(f"{pos}:S(")}
        out |= {f"{pos}:R", *(f"{pos}:{p}" for p in PARTIAL_KINDS)}
        out |= {f"{pos}:S({d})" for d in range(max(dims, default=-1) + 1)}
    if n_tensors >= 2 or any("Tensor[]" in str(a.type) for a in args):
        out |= {"plain-other-dtype", "alias"}
    out |= {f"kwarg:{a.name}" for a in args if a.kwarg_only}
    return out


def missing(func, seen: set[str]) -> set[str]:
    """Admitted kinds not seen (``in<i>:plain`` counts for that position's R)."""
    return admitted(func, seen) - seen


def _rows(record: dict[str, set[str]]):
    from dtensor.testing.schema_calls import overloads
    from dtensor.rules import RULES

    for key in RULES:
        for func in overloads(key):
            yield key, func, record.get(str(func))


def _by_reason(kinds):
    """``(reason, kinds)`` groups, in the order the kinds sort."""
    groups: dict[str, list[str]] = {}
    for k in kinds:
        groups.setdefault(reason(k), []).append(k)
    return list(groups.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Input kinds per registered rule, from the "
                                             "last property-suite run.")
    ap.add_argument("--dir", default=str(DEFAULT_DIR), help=f"records (default {DEFAULT_DIR})")
    ap.add_argument("--missing", action="store_true", help="only the kinds missing")
    args = ap.parse_args(argv)
    record = load(args.dir)
    if not record:
        print(f"no records under {args.dir}: run the property suite first", file=sys.stderr)
        return 2
    run = Path(args.dir) / "run.txt"
    if run.exists():
        print(f"records of: {run.read_text().strip()}\n")
    no_entry = []
    for key, func, seen in _rows(record):
        if seen is None:
            no_entry.append(str(func))
            continue
        miss = sorted(missing(func, seen))
        if args.missing and not miss:
            continue
        print(f"{func}")
        if not args.missing:
            print(f"    seen:    {' '.join(sorted(seen))}")
        if miss:
            print("    missing:")
            for why, kinds in _by_reason(miss):
                print(f"      {' '.join(kinds)}: {why}")
    packets = {}
    for key, func, seen in _rows(record):
        packets.setdefault(str(key), []).append(seen is not None)
    dead = sorted(k for k, v in packets.items() if not any(v))
    explained = [k for k in dead if k in NO_SCHEMA_CALL]
    dead = [k for k in dead if k not in NO_SCHEMA_CALL]
    print(f"\n{len(packets) - len(dead) - len(explained)}/{len(packets)} registered rules "
          f"have an entry; {len(no_entry)} overloads not reached: {', '.join(no_entry) or '-'}")
    for k in explained:
        print(f"no entry, no schema call: {k}: {NO_SCHEMA_CALL[k]}")
    if dead:
        print(f"rules with no entry at all: {', '.join(dead)}")
    return 1 if dead else 0


if __name__ == "__main__":
    sys.exit(main())
