"""Benchmark: counter-based Philox (dtensor.random) vs torch's CPU generator.

Run: ``python bench/rng.py [--sizes 1e3,1e4,1e5,1e6,1e7] [--reps 7] [--threads N]
[--clock wall|cpu]``. Prints a markdown table (median time per call, ratio
ours/torch). Runs of ours and torch are interleaved so machine noise hits both
alike. ``--clock cpu`` measures this process's CPU time with one intra-op
thread: on a shared machine other jobs then stretch neither side.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import dtensor.random as R


def _machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"{name} ({os.cpu_count()} cores), torch {torch.__version__}, "
            f"{torch.get_num_threads()} intra-op threads")


_clock = time.perf_counter


def _time(fn: Callable[[], object]) -> float:
    t0 = _clock()
    fn()
    return _clock() - t0


def _column_blocks(n: int, parts: int = 8) -> None:
    """The float32 uniform tensor [1000, n/1000] generated as `parts` column shards."""
    rows, cols = 1000, max(n // 1000, 1)
    step = -(-cols // parts)
    for c0 in range(0, cols, step):
        width = min(step, cols - c0)
        R.uniform_block(0, 1, (rows, cols), (0, c0), (rows, width))


def _cases(n: int) -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    x = torch.ones(n)
    return [
        ("rand f32, 8 column shards", lambda: _column_blocks(n), lambda: torch.rand(1000 * max(n // 1000, 1))),
        ("rand f32", lambda: R.rand(n), lambda: torch.rand(n)),
        ("rand f64", lambda: R.rand(n, dtype=torch.float64), lambda: torch.rand(n, dtype=torch.float64)),
        ("randn f32", lambda: R.randn(n), lambda: torch.randn(n)),
        ("dropout f32 p=0.1", lambda: R.dropout(x, 0.1), lambda: F.dropout(x, 0.1)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1e3,1e4,1e5,1e6,1e7")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: perf_counter; cpu: process CPU time, one thread")
    args = ap.parse_args()
    global _clock
    if args.clock == "cpu":
        _clock = time.process_time
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    R.manual_seed(0)
    torch.manual_seed(0)
    print(f"{datetime.date.today().isoformat()}, {_machine()}, {args.clock} clock\n")
    print("| op | n | torch ms | ours ms | ours/torch |")
    print("|---|---:|---:|---:|---:|")
    for name_idx in range(len(_cases(1))):
        for n in sizes:
            name, ours, ref = _cases(n)[name_idx]
            ours(), ref()  # warm up
            reps = args.reps if n < 10**7 else max(3, args.reps // 2)
            t_ours, t_ref = [], []
            for _ in range(reps):
                t_ours.append(_time(ours))
                t_ref.append(_time(ref))
            mo, mr = statistics.median(t_ours), statistics.median(t_ref)
            print(f"| {name} | {n:.0e} | {mr * 1e3:.3f} | {mo * 1e3:.3f} | {mo / mr:.2f} |", flush=True)


if __name__ == "__main__":
    main()
