"""OpInfo sweep: every op in ``op_db`` on a 2-rank Gloo world, ours vs torch's DTensor.

For each op and up to ``--max-samples`` of its float32 CPU samples, tensor
inputs are distributed as Replicate and as Shard(d) for each dim d that some
input has (uneven and empty shards included); the full result is compared
with the plain op. Per op: ``pass`` (every sample and layout right),
``wrong`` (some result differs from the plain op, on any rank), ``error``
(otherwise some layout raised). Random ops, ops without float32 on CPU and
samples without tensor inputs are skipped.

Run (launches its own torchrun worlds; restarts past a hung or crashed op):

    python bench/opinfo_sweep.py                # all ops -> docs/opinfo.{md,json}
    python bench/opinfo_sweep.py --ops add,mm   # a few ops, printed only
    python bench/opinfo_sweep.py --bytes        # fallback bytes audit -> docs/fallback_bytes.md

``--bytes``: only Shard(d) layouts, and per layout the wire bytes each
runtime's collectives move to compute the op and turn its result into a full
tensor (``bench/_comm_bytes.py``, the same counter for both; the result is
included because a runtime may leave it Partial or sharded and pay later). The summary lists every op where ours moves more than torch's
DTensor, over the layouts both get right.

Verdicts travel through the TCP store, not collectives, so a rank that
fails alone cannot pair its next collective with the other rank's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _sweep_inputs import (  # noqa: E402
    _audit_layouts,
    _call,
    _convert,
    _is_random,
    _layout_name,
    _mixed_layouts,
    _name,
    _partial_input,
    _samples,
    _select,
)
from _sweep_summary import summarise, summarise_bytes  # noqa: E402
from _sweep_worlds import free_port, run_worlds  # noqa: E402

RANK_VERDICT_TIMEOUT = 90
# Gloo's words for a world whose connections are gone (after a collective one
# rank never joined timed out): nothing sent on it afterwards arrives.
_TRANSPORT_GONE = ("Timed out waiting", "pair closure", "Connection closed by peer")


# Worker ---------------------------------------------------------------------------
def _worker(args) -> int:
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=RANK_VERDICT_TIMEOUT))
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    from torch.distributed import tensor as theirs
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.utils._pytree import tree_flatten

    import dtensor as ours

    sys.path.insert(0, str(ROOT / "bench"))
    from _comm_bytes import CommBytes

    meshes = {
        "ours": ours.DeviceMesh("cpu", [0, 1]),
        "torch": TorchMesh("cpu", [0, 1]),
    }
    place = {
        "ours": (ours.Replicate, ours.Shard),
        "torch": (theirs.Replicate, theirs.Shard),
    }
    distribute = {"ours": ours.distribute_tensor, "torch": theirs.distribute_tensor}
    dtype_cls = {"ours": ours.DTensor, "torch": theirs.DTensor}

    ops = _select(op_db, args.ops)
    out = open(args.results, "a") if rank == 0 else None
    progress = Path(args.results + ".progress")

    def agree(key: str, verdict: str) -> list[str]:
        store.set(f"{key}/{rank}", verdict)
        keys = [f"{key}/{r}" for r in range(2)]
        store.wait(keys, datetime.timedelta(seconds=RANK_VERDICT_TIMEOUT))
        return [store.get(k).decode() for k in keys]

    def full(x, impl):
        if isinstance(x, dtype_cls[impl]):
            return x.full_tensor()
        if isinstance(x, (list, tuple)):
            return [full(y, impl) for y in x]
        return x

    def same(got, want) -> bool:
        if isinstance(want, torch.Tensor):
            if not isinstance(got, torch.Tensor) or got.dtype != want.dtype:
                return False
            if got.shape != want.shape:
                return False
            try:
                torch.testing.assert_close(
                    got, want, equal_nan=True, atol=1e-4, rtol=1e-4, check_stride=False
                )
            except AssertionError:
                return False
            return True
        if isinstance(want, (list, tuple)):
            return (
                isinstance(got, (list, tuple))
                and len(got) == len(want)
                and all(same(g, w) for g, w in zip(got, want, strict=True))
            )
        if isinstance(want, float) and isinstance(got, float):
            return got == want or abs(got - want) <= 1e-4 * max(1.0, abs(want)) or (
                got != got and want != want
            )
        return got == want

    broken = False  # a collective timed out: Gloo closed the pairs for good
    for index in range(args.start, len(ops)):
        op = ops[index]
        if rank == 0:
            progress.write_text(json.dumps({"index": index, "name": _name(op)}))
        record = {"index": index, "op": _name(op)}
        if args.audit:
            torch.manual_seed(index)  # the same sample values on every rank
        try:
            samples = _samples(op, args.max_samples, torch)
        except Exception as e:
            samples, record["skip"] = [], f"no samples: {type(e).__name__}"
        if any(_is_random(op, s, torch) for s in samples):
            samples, record["skip"] = [], "random"
        cases = []
        for sample in samples:
            leaves = [t for t in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
                      if isinstance(t, torch.Tensor)]
            if not leaves:
                continue
            try:
                want = _call(op, sample, lambda t: t.clone())
            except Exception:
                continue
            if args.audit:
                cases.append((sample, want, _audit_layouts(leaves, args.max_layouts)))
                continue
            if args.mixed:
                if len(leaves) < 2:
                    continue  # one operand: the plain sweep covers its layouts
                cases.append((sample, want, _mixed_layouts(leaves, args.max_layouts)))
                continue
            dims = max(t.ndim for t in leaves)
            cases.append((sample, want, [None, *range(dims)]))
        if not cases:
            record.setdefault("skip", "no runnable float32 samples with tensor inputs")
        else:
            wire: dict = {}  # (sample, dim, impl) -> wire bytes of the op
            ncoll: dict = {}  # (sample, dim, impl) -> collectives of the op
            passed: dict = {}  # (sample, dim, impl) -> right on every rank
            for impl in ("ours", "torch"):
                if rank == 0:  # a crash is then charged to this side only
                    progress.write_text(json.dumps({"index": index, "name": _name(op),
                                                    "impl": impl, "record": record}))
                verdicts = []
                detail = None
                R, S = place[impl]
                for si, (sample, want, layouts) in enumerate(cases):
                    for d in layouts:
                        if args.bytes and d is None:
                            continue  # the audit is about Shard inputs
                        key = f"v/{index}/{impl}/{si}/{d}"

                        def dist_t(t, d=d, impl=impl, R=R, S=S, leaf=iter(range(1 << 30))):
                            if isinstance(d, tuple):  # --mixed: this leaf's own dim
                                d = d[next(leaf)]
                            if isinstance(d, str):  # a Partial kind (--audit)
                                return _partial_input(t, d, rank, impl)
                            p = [R()] if d is None or t.ndim <= d else [S(d)]
                            return distribute[impl](t.detach().clone(), meshes[impl], p)

                        try:
                            # inputs are distributed before counting starts
                            inp, a, kw = _convert(sample, dist_t)
                            # NOTE: the full result is counted too: a runtime
                            # that leaves its result Partial or sharded pays
                            # the collective there instead of in the op.
                            with CommBytes() as cb:
                                got = full(op.op(inp, *a, **kw), impl)
                            v = "pass" if same(got, want) else "wrong"
                            wire[(si, d, impl)] = cb.wire
                            ncoll[(si, d, impl)] = len(cb.records)
                            msg = "" if v == "pass" else "result differs"
                        except Exception as e:
                            v, msg = "error", f"{type(e).__name__}: {str(e)[:160]}"
                            broken = broken or any(m in str(e) for m in _TRANSPORT_GONE)
                        both = agree(key, v)
                        v = "wrong" if "wrong" in both else "error" if "error" in both else "pass"
                        passed[(si, d, impl)] = v == "pass"
                        if v != "pass" and detail is None:
                            detail = f"sample {si}, {_layout_name(d)}: {msg or both}"
                        verdicts.append(v)
                        if v == "error" and both[0] != both[1]:
                            # one rank failed alone: resynchronise via the store
                            agree(key + "/sync", "x")
                verdict = (
                    "wrong" if "wrong" in verdicts else "error" if "error" in verdicts else "pass"
                )
                record[impl] = verdict
                record[impl + "_cases"] = len(verdicts)
                if detail:
                    record[impl + "_detail"] = detail
            if args.audit:
                # Every case both ran: [sample, layout, ours collectives, ours
                # wire B, torch collectives, torch wire B, ours right, torch right].
                record["audit"] = [
                    [si, _layout_name(d), ncoll[(si, d, "ours")], wire[(si, d, "ours")],
                     ncoll[(si, d, "torch")], wire[(si, d, "torch")],
                     bool(passed.get((si, d, "ours"))), bool(passed.get((si, d, "torch")))]
                    for (si, d, i) in wire if i == "ours" and (si, d, "torch") in wire]
            if args.bytes:
                # Over the layouts both got right (the verdicts agreed on every rank).
                both = [(si, d) for (si, d, i) in wire if i == "ours" and (si, d, "torch") in wire
                        and passed.get((si, d, "ours")) and passed.get((si, d, "torch"))]
                record["bytes"] = {
                    "cases": len(both),
                    "ours": sum(wire[(si, d, "ours")] for si, d in both),
                    "torch": sum(wire[(si, d, "torch")] for si, d in both),
                    "more": [f"sample {si}, S({d}): {wire[(si, d, 'ours')]:.0f} vs "
                             f"{wire[(si, d, 'torch')]:.0f}" for si, d in both
                             if wire[(si, d, "ours")] > wire[(si, d, "torch")]][:3],
                }
        if out is not None:
            out.write(json.dumps(record) + "\n")
            out.flush()
        if "1" in agree(f"broken/{index}", "1" if broken else "0"):
            # Every later collective of this world would fail too (each op
            # after it recorded as an error of both runtimes): leave, and the
            # parent starts a fresh world at the next op.
            sys.stdout.flush()
            os._exit(3)
    if rank == 0:
        progress.write_text(json.dumps({"index": len(ops), "name": None}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# Parent ---------------------------------------------------------------------------
def _parent(args) -> int:
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    if args.update:  # re-run some ops; merge into the main results afterwards
        main_results = results
        results = Path(str(results) + ".update")
        args.results = str(results)
    results.write_text("")
    t0 = time.time()

    def command(start: int) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            "--master_port", str(free_port()), __file__, "--worker",
            "--from-index", str(start), "--results", str(results),
            "--max-samples", str(args.max_samples),
        ] + (["--ops", args.ops] if args.ops else []) + (["--bytes"] if args.bytes else []) + (
            ["--audit", "--max-layouts", str(args.max_layouts)] if args.audit else []) + (
            ["--mixed", "--max-layouts", str(args.max_layouts)] if args.mixed else [])

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if run_worlds(results, command, args.world_timeout, env):
        return 1
    records = [json.loads(line) for line in results.read_text().splitlines()]
    if args.update:
        fresh = {r["op"]: r for r in records}
        old = [json.loads(line) for line in main_results.read_text().splitlines()]
        records = [fresh.get(r["op"], r) for r in old]
        main_results.write_text("".join(json.dumps(r) + "\n" for r in records))
        t0 = time.time() - args.minutes * 60
    if args.audit:
        return 0  # bench/comm_audit.py reads the results file
    if args.bytes:
        summary = summarise_bytes(records, time.time() - t0, args)
        print(summary)
        if not args.ops:
            Path(args.bytes_markdown).write_text(summary)
        return 0
    summary = summarise(records, time.time() - t0, args)
    print(summary)
    if not args.ops or args.update:
        Path(args.markdown).write_text(summary)
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--from-index", dest="start", type=int, default=0)
    ap.add_argument("--ops", default="")
    ap.add_argument("--max-samples", type=int, default=3)
    ap.add_argument("--results", default=str(ROOT / "bench" / ".opinfo_results.jsonl"))
    ap.add_argument("--markdown", default=str(ROOT / "docs" / "opinfo.md"))
    ap.add_argument("--json", default=str(ROOT / "docs" / "opinfo.json"))
    ap.add_argument("--world-timeout", type=int, default=3600)
    ap.add_argument("--bytes", action="store_true",
                    help="fallback bytes audit: Shard inputs, wire bytes ours vs torch")
    ap.add_argument("--bytes-markdown", default=str(ROOT / "docs" / "fallback_bytes.md"))
    ap.add_argument("--mixed", action="store_true",
                    help="samples with several tensors: each its own R/S(d) placement "
                         "(every combination up to --max-layouts) -> docs/opinfo_mixed.md")
    ap.add_argument("--max-layouts", type=int, default=24)
    ap.add_argument("--audit", action="store_true",
                    help="communication audit (bench/comm_audit.py): alike, mixed and "
                         "Partial layouts; per case collectives and wire bytes of both")
    ap.add_argument("--update", action="store_true",
                    help="with --ops: re-run those ops and merge into the full results")
    ap.add_argument("--minutes", type=float, default=0.0,
                    help="with --update: the full run's duration, for the summary")
    args = ap.parse_args()
    if args.mixed and args.bytes:
        ap.error("--mixed and --bytes are separate sweeps; pick one")
    if args.max_layouts < 2:
        ap.error(f"--max-layouts must be at least 2 (the first and last combination), "
                 f"got {args.max_layouts}")
    if args.mixed and not args.worker:
        if args.results == ap.get_default("results"):
            args.results = os.path.join(tempfile.gettempdir(), "dtensor_opinfo_mixed.jsonl")
        if args.markdown == ap.get_default("markdown"):
            args.markdown = str(ROOT / "docs" / "opinfo_mixed.md")
        if args.json == ap.get_default("json"):
            args.json = str(ROOT / "docs" / "opinfo_mixed.json")
    if args.audit and (args.mixed or args.bytes):
        ap.error("--audit runs its own layouts; drop --mixed/--bytes")
    if args.bytes and not args.worker and args.results == ap.get_default("results"):
        args.results = os.path.join(tempfile.gettempdir(), "dtensor_fallback_bytes.jsonl")
    return _worker(args) if args.worker else _parent(args)


if __name__ == "__main__":
    sys.exit(main())
