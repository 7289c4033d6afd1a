"""Per-op CPU overhead: dtensor vs torch.distributed.tensor vs a plain tensor.

One process, one run, both implementations side by side on a 2-rank *fake*
process group (collectives return at once, so this measures pure overhead),
plus real communication on a 2-rank Gloo world (``--comm``, launched through
torchrun by this script). Prints ratios ours/torch, ours/plain and ours/floor
(a bare Python wrapper subclass: the cost of ``__torch_dispatch__`` itself).
Timing rounds interleave the implementations, so load from other processes
hits them alike; absolute times on shared 2-core machines are noise, ratios
from one run much less so (``--stat min`` where the machine is very busy).

    python bench/overhead.py                 # cached + first-seen table
    python bench/overhead.py --comm          # redistribute vs bare collectives
    python bench/overhead.py --ablate        # our path with each optimisation off
    python bench/overhead.py --all           # all three (docs/overhead.md)
    python bench/overhead.py --profile add   # where our time goes for one op

Instruction counts (``torch._C._instruction_counter``) are printed when the
machine exposes perf events; elsewhere the column says n/a.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from _timing import _STAT, _instructions, _machine, _stat_name, _timeit, _timeit_side_by_side

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


def _first_seen_cases(
    impl, mesh, op: str, n: int, start: int = 0
) -> list[Callable[[], object]]:
    """``n`` calls of ``op``, each on shapes no earlier call has seen."""
    S, R = impl.Shard, impl.Replicate
    sizes = range(5 + start, 5 + start + n)
    xs = [impl.distribute_tensor(torch.randn(4, k), mesh, [S(0)]) for k in sizes]
    rs = [impl.distribute_tensor(torch.randn(k, 3), mesh, [R()]) for k in sizes]
    fns = {
        "add": lambda x, r: lambda: x + x,
        "mm": lambda x, r: lambda: torch.mm(x, r),
        "sum(1)": lambda x, r: lambda: x.sum(1),
    }
    return [fns[op](x, r) for x, r in zip(xs, rs, strict=True)]


def _first_seen(
    calls: dict[str, list[Callable[[], object]]], blocks: int = 10
) -> dict[str, float]:
    """Median µs per first-seen call: blocks of new-shape calls, interleaved."""
    per = min(len(c) for c in calls.values()) // blocks
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for b in range(blocks):
        for name in names[b % len(names):] + names[: b % len(names)]:
            chunk = calls[name][b * per : (b + 1) * per]
            t0 = time.perf_counter()
            for fn in chunk:
                fn()
            times[name].append((time.perf_counter() - t0) / per * 1e6)
    return {name: _STAT[0](t) for name, t in times.items()}


class _Bare(torch.Tensor):
    """The floor: a wrapper subclass whose ``__torch_dispatch__`` only unwraps,
    calls the op and wraps the result (no layouts, no caches, no checks)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def wrap(t: torch.Tensor) -> torch.Tensor:
        r = torch.Tensor._make_wrapper_subclass(
            _Bare, t.shape, t.stride(), None, None, t.dtype, t.layout, t.device, False, False
        )
        r._t = t
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func._op(*[a._t if type(a) is _Bare else a for a in args], **(kwargs or {}))
        return _Bare.wrap(out) if isinstance(out, torch.Tensor) else out


def overhead_table(number: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    impls = _impls()
    meshes = {name: impl.DeviceMesh("cpu", [0, 1]) for name, impl in impls.items()}
    cases = {name: _cases(impl, meshes[name]) for name, impl in impls.items()}
    a = torch.randn(4, 4)
    bare = _Bare.wrap(a)
    print(
        f"# Cached path, 4x4 fp32, fake 2-rank group, {_stat_name()} µs "
        f"({time.strftime('%Y-%m-%d')}, {_machine()})"
    )
    print("floor = a bare Python wrapper subclass (unwrap, call, wrap) doing the same op")
    print()
    print(
        "| op | ours µs | torch µs | plain µs | floor µs | ours/torch | ours/plain "
        "| ours/floor | ours instr | torch instr |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for op in cases["ours"]:
        n = number // 10 if op == "mlp fwd+bwd" else number
        fns = {"ours": cases["ours"][op], "torch": cases["torch"][op]}
        if op in _PLAIN:
            fns["plain"] = _PLAIN[op](a)
            fns["floor"] = _PLAIN[op](bare)
        t = _timeit_side_by_side(fns, n)
        ours, theirs = t["ours"], t["torch"]
        plain, floor = t.get("plain", float("nan")), t.get("floor", float("nan"))
        io = _instructions(cases["ours"][op])
        it = _instructions(cases["torch"][op])
        fmt = lambda v: "n/a" if v is None else f"{v / 1e3:.0f}k"  # noqa: E731
        print(
            f"| {op} | {ours:.2f} | {theirs:.2f} | {plain:.2f} | {floor:.2f} | "
            f"{ours / theirs:.2f} | {ours / plain:.1f} | {ours / floor:.2f} | "
            f"{fmt(io)} | {fmt(it)} |"
        )
    print()
    print(f"# First-seen shapes (every call a new shape), {_stat_name()} µs per call")
    print("| op | ours µs | torch µs | ours/torch |")
    print("|---|---:|---:|---:|")
    for op in ("add", "mm", "sum(1)"):
        t = _first_seen(
            {name: _first_seen_cases(impl, meshes[name], op, 200) for name, impl in impls.items()}
        )
        print(f"| {op} | {t['ours']:.0f} | {t['torch']:.0f} | {t['ours'] / t['torch']:.3f} |")
    dist.destroy_process_group()


def ablation(number: int) -> None:
    """What each optimisation buys: our path with one of them switched off."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import dtensor as ours
    from dtensor.dispatch import cache, fast, general, propagate
    from dtensor.dispatch.op import OpInfo

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = ours.DeviceMesh("cpu", [0, 1])
    cases = _cases(ours, mesh)
    binding, fast_form = OpInfo.binding, general.fast_form

    def no_bindings(info, loc, kwargs):
        return info.func._op

    def no_fast_form(*args, **kwargs):
        return None

    # (call table, binding chooser, fast-form maker) per variant: plans made
    # under one variant must not serve another.
    variants = {
        "all on": ({}, binding, fast_form),
        "no bindings (torch.ops call)": ({}, no_bindings, fast_form),
        "no fast path (plans only)": ({}, binding, no_fast_form),
    }

    def use(variant) -> None:
        fast.TABLE = general.TABLE = cache.TABLE = variant[0]
        OpInfo.binding, general.fast_form = variant[1], variant[2]

    ops = ["detach", "add", "mm S0xR", "sum(1)", "view", "transpose", "mlp fwd+bwd"]
    print(
        f"# Ablation, cached path, {_stat_name()} µs "
        f"({time.strftime('%Y-%m-%d')}, {_machine()})"
    )
    print("| op | " + " | ".join(variants) + " |")
    print("|---|" + "---:|" * len(variants))
    for op in ops:
        n = number // 10 if op == "mlp fwd+bwd" else number
        fns = {}
        for name, variant in variants.items():
            def run(variant=variant, fn=cases[op]):
                use(variant)
                try:
                    return fn()
                finally:
                    use(variants["all on"])

            fns[name] = run
        t = _timeit_side_by_side(fns, n)
        print(f"| {op} | " + " | ".join(f"{t[v]:.2f}" for v in variants) + " |")
    print()
    print(f"# Ablation, first-seen shapes, {_stat_name()} µs per call")
    print("| op | shape math | meta tensors |")
    print("|---|---:|---:|")
    for op in ("add", "mm", "sum(1)"):
        math_calls = _first_seen_cases(ours, mesh, op, 100)
        meta_calls = [
            lambda fn=fn: _without_shape_math(propagate, fn)
            for fn in _first_seen_cases(ours, mesh, op, 100, start=100)  # other shapes
        ]
        t = _first_seen({"math": math_calls, "meta": meta_calls})
        print(f"| {op} | {t['math']:.0f} | {t['meta']:.0f} |")
    dist.destroy_process_group()


def _without_shape_math(propagate, fn):
    saved = propagate.shape_metas
    propagate.shape_metas = lambda *a: None
    try:
        return fn()
    finally:
        propagate.shape_metas = saved


def comm_worker(rounds: int) -> None:
    """Under torchrun (2 ranks): redistribute vs the bare collective on 4 MiB.

    Both ranks time the same calls in the same order (each call is a
    collective); rank 0 prints. Each round is one call of each (ours, torch's,
    the bare collective) after a barrier, over ``rounds`` rounds: a 4 MiB
    collective on a shared machine varies by tens of percent from call to
    call, and neighbouring calls see the same conditions.
    """
    dist.init_process_group("gloo")
    impls = _impls()
    rows = 1024 * 1024 // 4  # 4 MiB of fp32 in total, 2 MiB per shard
    shard = torch.randn(rows // 2, 4)
    full = torch.randn(rows, 4)

    # The bare collectives a user would write for the same *new* tensor: a
    # redistribute returns a fresh tensor and leaves its input alone, so both
    # pay one 4 MiB allocation (all-gather) or copy (all-reduce, in place).
    def bare_gather():
        out = torch.empty(rows, 4)
        dist.all_gather_into_tensor(out, shard)
        return out

    s_to_r = {"bare": bare_gather}
    p_to_r = {"bare": lambda: dist.all_reduce(full.clone())}
    for name, impl in impls.items():
        mesh = impl.DeviceMesh("cpu", [0, 1])
        x = impl.DTensor.from_local(torch.randn(rows // 2, 4), mesh, [impl.Shard(0)])
        p = impl.DTensor.from_local(torch.randn(rows, 4), mesh, [impl.Partial()])
        rep = [impl.Replicate()]
        s_to_r[name] = lambda x=x, mesh=mesh, rep=rep: x.redistribute(mesh, rep)
        p_to_r[name] = lambda p=p, mesh=mesh, rep=rep: p.redistribute(mesh, rep)
    results = {
        "S(0)->R": _timeit_side_by_side(s_to_r, 1, repeat=rounds, sync=dist.barrier),
        "P->R": _timeit_side_by_side(p_to_r, 1, repeat=rounds, sync=dist.barrier),
    }
    if dist.get_rank() == 0:
        print(
            f"# Real Gloo, 2 ranks, 4 MiB, {_stat_name()} µs per redistribute "
            f"({time.strftime('%Y-%m-%d')}, {_machine()})"
        )
        print("| transition | ours | torch | bare c10d | ours/bare | ours/torch |")
        print("|---|---:|---:|---:|---:|---:|")
        for t, r in results.items():
            o, th, b = r["ours"], r["torch"], r["bare"]
            print(f"| {t} | {o:.0f} | {th:.0f} | {b:.0f} | {o / b:.2f} | {o / th:.2f} |")
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


def profile(op: str, number: int) -> None:
    import cProfile
    import pstats

    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    import dtensor as ours

    fn = _cases(ours, ours.DeviceMesh("cpu", [0, 1]))[op]
    for _ in range(max(10, number // 10)):  # warm up: caches filled before profiling
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(number):
        fn()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--number", type=int, default=500, help="calls per timing round")
    ap.add_argument("--comm", action="store_true", help="real Gloo comparison (2 ranks)")
    ap.add_argument("--profile", metavar="OP", help="cProfile our path for one op")
    ap.add_argument("--ablate", action="store_true", help="our path with each optimisation off")
    ap.add_argument("--all", action="store_true", help="table, ablation and --comm in one go")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="statistic over timing rounds (min: for loaded machines)")
    ap.add_argument("--_comm-worker", dest="comm_worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    _STAT[0] = min if args.stat == "min" else statistics.median
    passed = ["--number", str(args.number), "--stat", args.stat]
    if args.comm_worker:
        comm_worker(max(15, args.number // 4))
    elif args.comm:
        sys.exit(_launch_comm(passed))
    elif args.profile:
        profile(args.profile, args.number)
    elif args.ablate:
        ablation(args.number)
    elif args.all:
        overhead_table(args.number)
        print()
        # A fresh process: the table's fake process group is gone, and the
        # ablation must start from empty caches.
        rc = subprocess.call([sys.executable, __file__, "--ablate", *passed])
        print()
        sys.exit(rc or _launch_comm(passed))
    else:
        overhead_table(args.number)


def _launch_comm(passed: list[str]) -> int:
    # NOTE: --master_port=0 hangs in the workers' store rendezvous: pick a port.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={port}", __file__, "--_comm-worker", *passed]
    sys.stdout.flush()
    return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    main()
