"""Per-op time of DTensor random ops, to check that seeding costs nothing per op.

Measures ``dtensor.rand(4, 4)`` and ``F.dropout`` of a 4x4 ``Replicate``
DTensor on a real one-rank Gloo world (a real c10d store, so the seed
agreement runs as it does under torchrun), after ``torch.manual_seed`` and
with nobody seeding. ``--against DIR`` runs the same measurement with the
runtime of another checkout (e.g. a ``git worktree`` of an older commit),
alternating the two ``--rounds`` times, and prints ours/theirs per row.

    python bench/seeding_overhead.py --against /tmp/base --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, tempfile, time
import torch, torch.distributed as dist
import torch.nn.functional as F
torch.set_num_threads(1)
store = dist.FileStore(tempfile.mktemp(), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
import dtensor
from dtensor import DeviceMesh, Replicate, distribute_tensor
mesh = DeviceMesh("cpu", [0])
x = distribute_tensor(torch.ones(4, 4), mesh, [Replicate()])

def per_call(fn, number=2000, repeat=7):
    for _ in range(200):
        fn()
    best = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best.append((time.perf_counter() - t0) / number * 1e6)
    return sorted(best)[len(best) // 2]

rows = {}
rows["rand, nobody seeded"] = per_call(lambda: dtensor.rand(4, 4, device_mesh=mesh, placements=[Replicate()]))
rows["dropout, nobody seeded"] = per_call(lambda: F.dropout(x, 0.5))
torch.manual_seed(0)
rows["rand, torch.manual_seed"] = per_call(lambda: dtensor.rand(4, 4, device_mesh=mesh, placements=[Replicate()]))
rows["dropout, torch.manual_seed"] = per_call(lambda: F.dropout(x, 0.5))
print(json.dumps(rows))
"""


def measure(tree: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                         text=True, check=True, cwd=tempfile.gettempdir())
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="another checkout's root to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours: list[dict] = []
    theirs: list[dict] = []
    for _ in range(args.rounds):
        ours.append(measure(here))
        if args.against:
            theirs.append(measure(args.against))
    print(f"{'op':32} {'ours µs':>9}" + (f" {'theirs µs':>10} {'ratio':>6}" if theirs else ""))
    for name in ours[0]:
        a = statistics.median(r[name] for r in ours)
        line = f"{name:32} {a:9.1f}"
        if theirs:
            b = statistics.median(r[name] for r in theirs)
            line += f" {b:10.1f} {a / b:6.3f}"
        print(line)


if __name__ == "__main__":
    main()
