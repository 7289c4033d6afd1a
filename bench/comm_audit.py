"""Communication audit: collectives and wire bytes, dtensor vs torch.distributed.tensor.

Two parts, both counted by the same dispatch mode for both runtimes
(``bench/_comm_bytes.py``: every c10d and functional collective; a runtime
that forgot to report one of its collectives cannot look cheaper):

- **ops**: every OpInfo sample of ``bench/opinfo_sweep.py --audit`` on a
  2-rank Gloo world, in these layouts: all inputs alike (Replicate, Shard(d)
  for each dim), each input its own layout (as ``--mixed``), and every input
  a piece of ``Partial(kind)`` for kind in sum/avg/max/min (with two or more
  inputs also the first partial, the others replicated). Counted: the op
  and turning its result into a full tensor (a runtime that leaves its
  result Partial or sharded pays there). Compared where both results equal
  the plain op.
- **redistribute**: every source -> target pair over {R, S(0), S(1),
  P(sum), P(max)} on a 4-rank 1-D mesh and a 2x2 mesh, and over {R, S(0),
  S(1), P(sum)} on a 2x2x2 mesh, for an even and an uneven 2-D tensor, on a
  fake process group (rank 0's collectives; nothing but the plan is
  measured). Compared where neither raises (PyTorch refuses targets with
  Partial).

A case where ours sends more wire bytes, or the same bytes in more
collectives, is an *excess*. ``--record`` writes every case's numbers to
``bench/comm_audit.json``; ``tests/test_comm_audit.py`` re-runs a subset of
the cases and fails where ours sends more than recorded.

    python bench/comm_audit.py                     # table; excesses listed
    python bench/comm_audit.py --record            # ... and bench/comm_audit.json
    python bench/comm_audit.py --ops add,mm        # a few ops only
    python bench/comm_audit.py --skip-ops          # redistribute pairs only
    python bench/comm_audit.py --ops rsub --skip-pairs --merge --record
                                # re-run a few ops into the recorded table

Where PyTorch sends less only by computing something else (a wrong value
on inputs the sample does not have), the case is an *accepted difference*
(``ACCEPTED``, with the reason), counted apart from the excesses.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's dtensor, not an installed one
sys.path.insert(0, str(ROOT / "bench"))
RECORD = ROOT / "bench" / "comm_audit.json"
EPS = 1e-6

# (mesh shape, placement kinds) of the redistribute part.
PAIR_MESHES = [((4,), ("R", "S0", "S1", "P", "Pmax")),
               ((2, 2), ("R", "S0", "S1", "P", "Pmax")),
               ((2, 2, 2), ("R", "S0", "S1", "P"))]
PAIR_SHAPES = {"even": (8, 8), "uneven": (7, 5)}

# The remaining excesses by reason, and the accepted differences.
from _audit_reasons import ACCEPTED, EXCEPTIONS, accepted  # noqa: E402, F401


def excess(oc: int, ow: float, tc: int, tw: float) -> bool:
    """Ours sends more: more wire bytes, or as many bytes in more collectives."""
    return ow > tw + EPS or (abs(ow - tw) <= EPS and oc > tc)


# Redistribute pairs --------------------------------------------------------------
def _placements(lib, state):
    out = []
    for p in state:
        if p == "R":
            out.append(lib.Replicate())
        elif p.startswith("P"):
            out.append(lib.Partial(p[1:] or "sum"))
        else:
            out.append(lib.Shard(int(p[1])))
    return out


def pair_counts(lib, mesh, src, dst, shape):
    """(collectives, wire bytes) rank 0 spends on ``src -> dst``, or the error's name."""
    import torch

    from _comm_bytes import CommBytes

    import dtensor
    from dtensor.spec import local_block

    mesh_shape = tuple(mesh.shape) if hasattr(mesh, "shape") else tuple(mesh.mesh.shape)
    block, _ = local_block(shape, mesh_shape, _placements(dtensor, src), (0,) * len(src))
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    try:
        x = lib.DTensor.from_local(torch.ones(block), mesh, _placements(lib, src),
                                   run_check=False, shape=torch.Size(shape), stride=stride)
        with CommBytes() as cb:
            x.redistribute(mesh, _placements(lib, dst))
    except Exception as e:  # noqa: BLE001 - a refusal is a result here
        return type(e).__name__
    return len(cb.records), cb.wire


def pair_cases(meshes=None, libs=("ours", "torch")):
    """Yield ``[mesh, shape, src, dst, {lib: (count, wire) or error}]`` for every pair.

    Needs a process group of at least 8 ranks whose rank is 0 (a fake one)."""
    import torch
    import torch.distributed.tensor as tdt

    import dtensor

    for mesh_shape, kinds in meshes or PAIR_MESHES:
        ranks = torch.arange(math.prod(mesh_shape)).reshape(mesh_shape)
        made = {"ours": (dtensor, dtensor.DeviceMesh("cpu", ranks)),
                "torch": (tdt, tdt.DeviceMesh("cpu", ranks))}
        states = list(itertools.product(kinds, repeat=len(mesh_shape)))
        for (sname, shape), src, dst in itertools.product(PAIR_SHAPES.items(), states, states):
            if src == dst:
                continue
            got = {k: pair_counts(*made[k], src, dst, shape) for k in libs}
            yield ["x".join(map(str, mesh_shape)), sname, " ".join(src), " ".join(dst), got]


def _run_pairs() -> list:
    import logging

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        rows = []
        for mesh, shape, src, dst, got in pair_cases():
            o, t = got["ours"], got["torch"]
            rows.append([mesh, shape, src, dst,
                         *(o if isinstance(o, tuple) else (o, None)),
                         *(t if isinstance(t, tuple) else (t, None))])
        return rows
    finally:
        dist.destroy_process_group()


# OpInfo samples ------------------------------------------------------------------
def _run_ops(ops: str, max_samples: int, max_layouts: int) -> dict:
    results = Path(tempfile.gettempdir()) / f"dtensor_comm_audit_{os.getpid()}.jsonl"
    cmd = [sys.executable, str(ROOT / "bench" / "opinfo_sweep.py"), "--audit",
           "--results", str(results), "--max-samples", str(max_samples),
           "--max-layouts", str(max_layouts)] + (["--ops", ops] if ops else [])
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    out = {}
    for line in results.read_text().splitlines():
        r = json.loads(line)
        if r.get("audit"):
            out[r["op"]] = r["audit"]
    return out


def ours_op_counts(name: str, max_samples: int, max_layouts: int, rank: int) -> dict:
    """``{(sample, layout): (collectives, wire bytes)}`` of dtensor alone for
    OpInfo entry ``name``, as ``--audit`` measures it (same seed, samples and
    layouts; a 2-rank world over ranks 0 and 1 must be running). Cases where
    ours raises are left out."""
    import torch
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.utils._pytree import tree_flatten

    import dtensor
    import _sweep_inputs as sweep
    from _comm_bytes import CommBytes

    ops = sweep._select(op_db, "")
    index = next(i for i, o in enumerate(ops) if sweep._name(o) == name)
    op = ops[index]
    mesh = dtensor.DeviceMesh("cpu", [0, 1])
    torch.manual_seed(index)
    out = {}
    for si, sample in enumerate(sweep._samples(op, max_samples, torch)):
        leaves = [t for t in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
                  if isinstance(t, torch.Tensor)]
        if not leaves:
            continue
        for d in sweep._audit_layouts(leaves, max_layouts):
            def dist_t(t, d=d, leaf=iter(range(1 << 30))):
                if isinstance(d, tuple):
                    d = d[next(leaf)]
                if isinstance(d, str):
                    return sweep._partial_input(t, d, rank, "ours")
                p = [dtensor.Replicate()] if d is None or t.ndim <= d else [dtensor.Shard(d)]
                return dtensor.distribute_tensor(t.detach().clone(), mesh, p)

            try:
                inp, a, kw = sweep._convert(sample, dist_t)
                with CommBytes() as cb:
                    _full(op.op(inp, *a, **kw), dtensor.DTensor)
            except Exception:  # noqa: BLE001 - raised on every rank alike
                continue
            out[(si, sweep._layout_name(d))] = (len(cb.records), cb.wire)
    return out


def _full(x, cls):
    """Full tensors of ``x``'s DTensors, as the sweep makes them."""
    if isinstance(x, cls):
        return x.full_tensor()
    if isinstance(x, (list, tuple)):
        return [_full(y, cls) for y in x]
    return x


# Summary -------------------------------------------------------------------------
def summarise(ops: dict, pairs: list, accepted_out: list | None = None
              ) -> tuple[str, list[str]]:
    """Markdown tables, and one line per excess. Accepted differences
    (``ACCEPTED``) are not excesses; their lines go to ``accepted_out``."""
    lines, excesses = [], []
    accepted_out = [] if accepted_out is None else accepted_out
    rows = []
    for group, pred in (("alike", lambda lay: not lay.startswith("(") and "P(" not in lay),
                        ("mixed", lambda lay: lay.startswith("(") and "P(" not in lay),
                        ("partial", lambda lay: "P(" in lay)):
        n = both = more = fewer = agreed = 0
        ow = tw = oc = tc = 0.0
        for op, cases in ops.items():
            for si, lay, c_o, w_o, c_t, w_t, ok_o, ok_t in cases:
                if not pred(lay):
                    continue
                n += 1
                if not (ok_o and ok_t):
                    continue
                both += 1
                ow, tw, oc, tc = ow + w_o, tw + w_t, oc + c_o, tc + c_t
                if excess(c_o, w_o, c_t, w_t):
                    line = (f"op `{op}` sample {si} {lay}: ours {c_o} coll / "
                            f"{w_o:.0f} B, torch {c_t} / {w_t:.0f} B")
                    if accepted(op, lay):
                        agreed += 1
                        accepted_out.append(line)
                    else:
                        more += 1
                        excesses.append(line)
                elif excess(c_t, w_t, c_o, w_o):
                    fewer += 1
        rows.append((f"ops, {group}", n, both, more, agreed, fewer, oc, ow, tc, tw))
    for mesh in sorted({r[0] for r in pairs}, key=len):
        n = both = more = fewer = 0
        ow = tw = oc = tc = 0.0
        for m, shape, src, dst, c_o, w_o, c_t, w_t in pairs:
            if m != mesh:
                continue
            n += 1
            if w_o is None or w_t is None:
                continue
            both += 1
            ow, tw, oc, tc = ow + w_o, tw + w_t, oc + c_o, tc + c_t
            if excess(c_o, w_o, c_t, w_t):
                more += 1
                excesses.append(f"redistribute {mesh} {shape} `{src}` -> `{dst}`: ours "
                                f"{c_o} coll / {w_o:.0f} B, torch {c_t} / {w_t:.0f} B")
            elif excess(c_t, w_t, c_o, w_o):
                fewer += 1
        rows.append((f"redistribute {mesh}", n, both, more, 0, fewer, oc, ow, tc, tw))
    lines += ["| part | cases | both right | ours sends more | accepted difference "
              "| ours sends less | collectives ours / torch | wire bytes ours / torch |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, n, both, more, agreed, fewer, oc, ow, tc, tw in rows:
        lines.append(f"| {name} | {n} | {both} | {more} | {agreed} | {fewer} "
                     f"| {oc:.0f} / {tc:.0f} | {ow:.0f} / {tw:.0f} |")
    return "\n".join(lines), excesses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="", help="comma-separated OpInfo names (default all)")
    ap.add_argument("--max-samples", type=int, default=3)
    ap.add_argument("--max-layouts", type=int, default=24)
    ap.add_argument("--skip-ops", action="store_true", help="redistribute pairs only")
    ap.add_argument("--skip-pairs", action="store_true", help="OpInfo samples only")
    ap.add_argument("--record", action="store_true", help=f"write {RECORD.name}")
    ap.add_argument("--merge", action="store_true",
                    help=f"with --ops: the other cases from {RECORD.name}")
    ap.add_argument("--from-results", metavar="JSON",
                    help="summarise a recorded file instead of running")
    args = ap.parse_args()
    if args.from_results:
        data = json.loads(Path(args.from_results).read_text())
        ops, pairs = data["ops"], data["pairs"]
    else:
        ops = {} if args.skip_ops else _run_ops(args.ops, args.max_samples, args.max_layouts)
        pairs = [] if args.skip_pairs else _run_pairs()
    if args.merge:  # the listed ops re-run, every other case as recorded
        data = json.loads(RECORD.read_text())
        ops, pairs = {**data["ops"], **ops}, pairs or data["pairs"]
    agreed: list[str] = []
    table, excesses = summarise(ops, pairs, agreed)
    print(table)
    print()
    print(f"excesses ({len(excesses)}):")
    for line in excesses:
        print(" -", line)
    print(f"accepted differences ({len(agreed)}):")
    for line in agreed:
        print(" -", line)
    if args.record:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip()
        command = " ".join(["python bench/comm_audit.py", *sys.argv[1:]])
        meta = {"date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}",
                "commit": commit, "command": command,
                "max_samples": args.max_samples, "max_layouts": args.max_layouts}
        if args.merge:  # the full run the listed ops were merged into
            meta["merged_into"] = data["meta"]
        RECORD.write_text(json.dumps({"meta": meta, "ops": ops, "pairs": pairs}, indent=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
