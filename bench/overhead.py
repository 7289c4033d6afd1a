"""Per-op CPU overhead: dtensor vs torch.distributed.tensor vs a plain tensor.

One process, one run, both implementations side by side on a 2-rank *fake*
process group (collectives return at once, so this measures pure overhead),
plus real communication on a 2-rank Gloo world (``--comm``, launched through
torchrun by this script). Prints ratios ours/torch and ours/plain; absolute
times on shared 2-core machines are noise, ratios from one run are not.

    python bench/overhead.py                 # cached + first-seen table
    python bench/overhead.py --comm          # redistribute vs bare collectives
    python bench/overhead.py --profile add   # where our time goes for one op

Instruction counts (``torch._C._instruction_counter``) are printed when the
machine exposes perf events; elsewhere the column says n/a.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def _timeit(fn: Callable[[], object], number: int, repeat: int = 7) -> float:
    """Median µs per call over ``repeat`` rounds of ``number`` calls."""
    for _ in range(max(10, number // 10)):
        fn()
    rounds = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        rounds.append((time.perf_counter() - t0) / number * 1e6)
    return statistics.median(rounds)


_COUNTER_OK: list[bool] = []


def _instructions(fn: Callable[[], object]) -> int | None:
    """Instructions for one call, or None where perf events are unavailable."""
    ic = torch._C._instruction_counter
    if not _COUNTER_OK:
        probe = ic.start()  # prints one complaint where unsupported
        _COUNTER_OK.append(probe != -1)
        if probe != -1:
            ic.end(probe)
    if not _COUNTER_OK[0]:
        return None
    fn()
    start = ic.start()
    fn()
    return ic.end(start)


def _impls():
    import torch.distributed.tensor as td

    import dtensor as ours

    return {"ours": ours, "torch": td}


def _cases(impl, mesh) -> dict[str, Callable[[], object]]:
    """Closures over prebuilt inputs, one per measured op, for one implementation."""
    S, R, P = impl.Shard, impl.Replicate, impl.Partial
    DT = impl.DTensor
    a = torch.randn(4, 4)
    x = impl.distribute_tensor(a, mesh, [S(0)])
    r = impl.distribute_tensor(a, mesh, [R()])
    p = DT.from_local(torch.randn(4, 4), mesh, [P()])
    local = torch.randn(2, 4)
    w1 = impl.distribute_tensor(torch.randn(4, 8), mesh, [S(1)])
    w2 = impl.distribute_tensor(torch.randn(8, 4), mesh, [S(0)])
    w1.requires_grad_(True)
    w2.requires_grad_(True)
    inp = impl.distribute_tensor(torch.randn(3, 4), mesh, [R()])

    def mlp_step():
        loss = torch.mm(torch.mm(inp, w1).relu(), w2).sum()
        loss.backward()

    return {
        "detach": lambda: x.detach(),
        "alias": lambda: torch.ops.aten.alias.default(x),
        "view_as": lambda: x.view_as(x),
        "add": lambda: x + x,
        "mul": lambda: x * x,
        "mm S0xR": lambda: torch.mm(x, r),
        "sum(1)": lambda: x.sum(1),
        "view": lambda: x.view(4, 2, 2),
        "reshape": lambda: x.reshape(16),
        "transpose": lambda: x.transpose(0, 1),
        "from_local": lambda: DT.from_local(local, mesh, [S(0)]),
        "to_local": lambda: x.to_local(),
        "S(0)->R": lambda: x.redistribute(mesh, [R()]),
        "P->R": lambda: p.redistribute(mesh, [R()]),
        "mlp fwd+bwd": mlp_step,
    }


_PLAIN = {
    "detach": lambda a: a.detach,
    "alias": lambda a: lambda: torch.ops.aten.alias.default(a),
    "view_as": lambda a: lambda: a.view_as(a),
    "add": lambda a: lambda: a + a,
    "mul": lambda a: lambda: a * a,
    "mm S0xR": lambda a: lambda: torch.mm(a, a),
    "sum(1)": lambda a: lambda: a.sum(1),
    "view": lambda a: lambda: a.view(4, 2, 2),
    "reshape": lambda a: lambda: a.reshape(16),
    "transpose": lambda a: lambda: a.transpose(0, 1),
}


def _first_seen(impl, mesh, op: str, n: int) -> float:
    """µs per call when every call sees new shapes (propagation cache misses)."""
    S, R = impl.Shard, impl.Replicate
    xs = [impl.distribute_tensor(torch.randn(4, 5 + i), mesh, [S(0)]) for i in range(n)]
    rs = [impl.distribute_tensor(torch.randn(5 + i, 3), mesh, [R()]) for i in range(n)]
    fns = {
        "add": lambda i: xs[i] + xs[i],
        "mm": lambda i: torch.mm(xs[i], rs[i]),
        "sum(1)": lambda i: xs[i].sum(1),
    }
    fn = fns[op]
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t0) / n * 1e6


def overhead_table(number: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    impls = _impls()
    meshes = {name: impl.DeviceMesh("cpu", [0, 1]) for name, impl in impls.items()}
    cases = {name: _cases(impl, meshes[name]) for name, impl in impls.items()}
    a = torch.randn(4, 4)
    print(f"# Cached path, 4x4 fp32, fake 2-rank group, median µs ({time.strftime('%Y-%m-%d')})")
    print("| op | ours µs | torch µs | plain µs | ours/torch | ours/plain | ours instr | torch instr |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for op in cases["ours"]:
        n = number // 10 if op == "mlp fwd+bwd" else number
        ours = _timeit(cases["ours"][op], n)
        theirs = _timeit(cases["torch"][op], n)
        plain = _timeit(_PLAIN[op](a), number) if op in _PLAIN else float("nan")
        io = _instructions(cases["ours"][op])
        it = _instructions(cases["torch"][op])
        fmt = lambda v: "n/a" if v is None else f"{v / 1e3:.0f}k"  # noqa: E731
        print(
            f"| {op} | {ours:.2f} | {theirs:.2f} | {plain:.2f} | {ours / theirs:.2f} | "
            f"{ours / plain:.1f} | {fmt(io)} | {fmt(it)} |"
        )
    print()
    print("# First-seen shapes (every call a new shape), µs per call")
    print("| op | ours µs | torch µs | ours/torch |")
    print("|---|---:|---:|---:|")
    for op in ("add", "mm", "sum(1)"):
        ours = _first_seen(impls["ours"], meshes["ours"], op, 100)
        theirs = _first_seen(impls["torch"], meshes["torch"], op, 100)
        print(f"| {op} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.3f} |")
    dist.destroy_process_group()


def comm_worker(number: int) -> None:
    """Under torchrun (2 ranks): redistribute vs the bare collective on 4 MiB."""
    dist.init_process_group("gloo")
    impls = _impls()
    rank = dist.get_rank()
    rows = 1024 * 1024 // 4  # 4 MiB of fp32 in total, 2 MiB per shard
    results = {}
    for name, impl in impls.items():
        mesh = impl.DeviceMesh("cpu", [0, 1])
        x = impl.DTensor.from_local(torch.randn(rows // 2, 4), mesh, [impl.Shard(0)])
        p = impl.DTensor.from_local(torch.randn(rows, 4), mesh, [impl.Partial()])
        results[(name, "S(0)->R")] = _timeit(lambda: x.redistribute(mesh, [impl.Replicate()]), number)
        results[(name, "P->R")] = _timeit(lambda: p.redistribute(mesh, [impl.Replicate()]), number)
    shard = torch.randn(rows // 2, 4)
    out = torch.empty(rows, 4)
    full = torch.randn(rows, 4)
    results[("bare", "S(0)->R")] = _timeit(lambda: dist.all_gather_into_tensor(out, shard), number)
    results[("bare", "P->R")] = _timeit(lambda: dist.all_reduce(full.clone()), number)
    if rank == 0:
        print("# Real Gloo, 2 ranks, 4 MiB, median µs per redistribute")
        print("| transition | ours | torch | bare c10d | ours/bare | ours/torch |")
        print("|---|---:|---:|---:|---:|---:|")
        for t in ("S(0)->R", "P->R"):
            o, th, b = results[("ours", t)], results[("torch", t)], results[("bare", t)]
            print(f"| {t} | {o:.0f} | {th:.0f} | {b:.0f} | {o / b:.2f} | {o / th:.2f} |")
    dist.destroy_process_group()


def profile(op: str, number: int) -> None:
    import cProfile
    import pstats

    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    import dtensor as ours

    fn = _cases(ours, ours.DeviceMesh("cpu", [0, 1]))[op]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(number):
        fn()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--number", type=int, default=2000, help="calls per timing round")
    ap.add_argument("--comm", action="store_true", help="real Gloo comparison (2 ranks)")
    ap.add_argument("--profile", metavar="OP", help="cProfile our path for one op")
    ap.add_argument("--_comm-worker", dest="comm_worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.comm_worker:
        comm_worker(max(5, args.number // 200))
    elif args.comm:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--master_port=0", __file__, "--_comm-worker", "--number", str(args.number)]
        sys.exit(subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    elif args.profile:
        profile(args.profile, args.number)
    else:
        overhead_table(args.number)


if __name__ == "__main__":
    main()
