"""Where a simulated world's time goes: ``bench/sim_scale.py``'s scenario, step
by step, on one world of n rank threads (no pytest around it).

Prints the time to start the world (its first, empty task: a thread and a
default group per rank), then for each run of the scenario its wall time
and, per step, the CPU time of all rank threads together
(``time.thread_time``: waits for the other ranks excluded). The first run
is what a test pays; later runs show what stays once caches are warm.

    python bench/sim_scale_phases.py --ranks 512 --runs 2
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES_3D = {64: (4, 4, 4), 256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=512, choices=sorted(SHAPES_3D))
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args(argv)
    import torch
    import torch.distributed.tensor  # assert_close imports it on first use

    import dtensor as dt
    from dtensor import Replicate, Shard
    from dtensor._rank_state import enter_rank
    from launch.sim.threaded import entered
    from launch.sim.world import SimWorld

    n, shape = args.ranks, SHAPES_3D[args.ranks]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2 * n + 3, 8, generator=gen)
    w = torch.randn(8, 8, generator=gen)
    y = torch.randn(2 * shape[0] + 1, 3 * shape[2] + 1, generator=gen)
    want = (x * 2 + 1) @ w
    spent: collections.Counter = collections.Counter()
    lock = threading.Lock()

    def scenario(rank: int) -> None:
        steps, last = {}, time.thread_time()

        def step(name: str) -> None:
            nonlocal last
            now = time.thread_time()
            steps[name], last = now - last, now

        mesh = dt.init_device_mesh("cpu", (n,)); step("1-D mesh")  # noqa: E702
        dx = dt.distribute_tensor(x, mesh, [Shard(0)]); step("distribute x")  # noqa: E702
        dw = dt.distribute_tensor(w, mesh, [Replicate()]); step("distribute w")  # noqa: E702
        out = (dx * 2 + 1) @ dw; step("ops")  # noqa: E702
        full = out.redistribute(mesh, [Replicate()]).to_local(); step("S(0)->R")  # noqa: E702
        torch.testing.assert_close(full, want); step("assert_close 1")  # noqa: E702
        mesh3 = dt.init_device_mesh("cpu", shape, mesh_dim_names=("dp", "cp", "tp"))
        step("3-D mesh")
        dy = dt.distribute_tensor(y, mesh3, [Shard(0), Replicate(), Shard(1)])
        step("distribute y")
        back = dy.full_tensor(); step("full_tensor")  # noqa: E702
        torch.testing.assert_close(back, y); step("assert_close 2")  # noqa: E702
        with lock:
            spent.update(steps)

    world = SimWorld(n, enter_rank)
    with entered():
        t0 = time.perf_counter()
        world.run(lambda rank: None)
        print(f"{n} ranks: start {time.perf_counter() - t0:.3f} s")
        for i in range(args.runs):
            spent.clear()
            t0 = time.perf_counter()
            outs = world.run(scenario)
            wall = time.perf_counter() - t0
            bad = [o for o in outs if o.error is not None]
            if bad:
                print(f"run {i + 1}: rank {bad[0].rank} failed: {bad[0].error!r}")
                return 1
            parts = ", ".join(f"{k} {v:.3f}" for k, v in spent.items())
            print(f"run {i + 1}: {wall:.3f} s wall, {sum(spent.values()):.3f} s CPU ({parts})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
