"""Thread switches per collective in a simulated world (``pytest --dist-sim``).

The simulated world runs one rank thread at a time and hands the turn from
thread to thread (``launch/sim/turn.py``): a rank that waits in a collective
sleeps until the turn reaches it, once. This counts each rank thread's
voluntary context switches (Linux's per-thread ``getrusage``) and CPU time
over a run of small all-reduces, so a change to the turn shows what it costs
per collective:

    python bench/sim_turn_switches.py                 # 4 ranks, 200 all-reduces
    python bench/sim_turn_switches.py --ranks 8 --rounds 500

With the hand-to-hand turn a 4-rank all-reduce costs about 5 switches in all
on a quiet machine (the 3 ranks that wait, woken once each, plus the turn's
hand-offs; more when other processes take the cores); a turn that wakes
every waiter to race for it costs about 17.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import torch
import torch.distributed as dist


def _body(rounds: int):
    def body(rank: int) -> tuple[float, int, float]:
        t = torch.ones(4)
        dist.all_reduce(t)  # settle: the first collective of a world does more
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        switches, cpu = usage.ru_nvcsw, time.thread_time()
        for _ in range(rounds):
            t = torch.ones(4)
            dist.all_reduce(t)
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        return t[0].item(), usage.ru_nvcsw - switches, time.thread_time() - cpu

    return body


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4, help="simulated ranks (default 4)")
    ap.add_argument("--rounds", type=int, default=200, help="all-reduces per rank")
    args = ap.parse_args()
    if not hasattr(resource, "RUSAGE_THREAD"):
        print("per-thread context switch counts need Linux (resource.RUSAGE_THREAD)",
              file=sys.stderr)
        return 2
    if args.ranks < 2 or args.rounds < 1:
        ap.error(f"--ranks must be >= 2 and --rounds >= 1; "
                 f"got {args.ranks}, {args.rounds}")

    from launch.sim.threaded import entered
    from launch.sim.world import SimWorld

    world = SimWorld(args.ranks)
    try:
        with entered():
            outs = world.run(_body(args.rounds), 300.0)
    finally:
        with entered():
            world.close()
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        print(f"a rank failed: {errors[0]!r}", file=sys.stderr)
        return 1
    if any(o.value[0] != float(args.ranks) for o in outs):
        print(f"wrong all-reduce result: {[o.value[0] for o in outs]}", file=sys.stderr)
        return 1
    switches = sum(o.value[1] for o in outs)
    cpu = sum(o.value[2] for o in outs)
    print(f"{args.ranks} simulated ranks, {args.rounds} all-reduces of 4 floats")
    print("| per all-reduce | value |\n|---|---:|")
    print(f"| voluntary thread switches, all ranks | {switches / args.rounds:.2f} |")
    print(f"| CPU time, all ranks | {cpu / args.rounds * 1e6:.0f} µs |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
