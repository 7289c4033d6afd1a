"""Simulated worlds at scale: one scripted scenario at 64 to 1024 ranks, in
our simulated world (``pytest --dist-sim``, ranks as threads) and in
PyTorch's ``LocalTensorMode`` (all ranks in one thread) on PyTorch's DTensor.

The scenario, the same on both sides (n ranks):

1. a 1-D mesh over the n ranks; ``distribute_tensor`` of an uneven
   (2n+3)x8 tensor as ``Shard(0)``; ``* 2 + 1``; a matmul with a replicated
   8x8 weight; ``Shard(0) -> Replicate`` checked against the single-device
   result;
2. a named 3-D mesh ``(dp, cp, tp)`` over the n ranks; a tensor distributed
   as ``[Shard(0), Replicate(), Shard(1)]``; ``full_tensor()`` checked
   against the original.

Ours is one ``world_size(n)`` test under ``pytest --dist-sim`` (its call
time, which includes starting the world's n rank threads, from pytest's
junit report). PyTorch's runs under ``LocalTensorMode`` with a fake process
group and meshes built outside the mode, as PyTorch's own test bases do (its
time covers the process group, the meshes and the scenario, the checks of
every rank's values included, as each rank of ours checks its own). Every
(size, side) is its own process, so its peak memory (``ru_maxrss``, which
includes the interpreter and torch, ~0.3 GB) is its own; each process's whole
wall time is printed too.

Both processes start with glibc's per-thread caches of freed blocks off
(``GLIBC_TUNABLES=glibc.malloc.tcache_count=0``, what ``launch.sim.malloc``
gives pytest-xdist workers and fuzzing worlds, and what plain ``pytest
--dist-sim`` suggests at 256 ranks and more); ``--glibc-tcache`` keeps glibc's
default in both, where each of our rank threads keeps its own cache.

Both sides make the inputs and the single-device result once, before the
timing (``--inputs body`` has every rank of ours make its own, as a test
written for a real world would), and import ``torch.distributed.tensor``
before it (``torch.testing.assert_close`` imports it on first use).

    python bench/sim_scale.py                          # 64, 256, 512, 1024 ranks
    python bench/sim_scale.py --sizes 256 --side ours  # one side, one size
    python bench/sim_scale.py --timeout 300            # give up on a side after 300 s
    python bench/sim_scale.py --sizes 512 --repeat 3   # the median of 3 runs per side
    python bench/sim_scale.py --sizes 1024 --side ours --inputs body
    python bench/sim_scale.py --sizes 1024 --glibc-tcache  # glibc's default caches

Run it on a quiet machine (it runs one process at a time); it prints a
markdown table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The 3-D mesh of each size: (dp, cp, tp).
SHAPES_3D = {8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
             256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16)}

_OURS_TEST = '''
import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (torch.testing.assert_close imports it)

import dtensor as dt
from dtensor import Replicate, Shard

N = {n}
SHAPE = {shape}
{inputs_here}

@pytest.mark.world_size(N)
@pytest.mark.dist_timeout({timeout})
def test_scenario(world):
{inputs_in_body}    mesh = dt.init_device_mesh("cpu", (N,))
    dx = dt.distribute_tensor(x, mesh, [Shard(0)])
    dw = dt.distribute_tensor(w, mesh, [Replicate()])
    out = (dx * 2 + 1) @ dw
    full = out.redistribute(mesh, [Replicate()]).to_local()
    torch.testing.assert_close(full, want)
    mesh3 = dt.init_device_mesh("cpu", SHAPE, mesh_dim_names=("dp", "cp", "tp"))
    dy = dt.distribute_tensor(y, mesh3, [Shard(0), Replicate(), Shard(1)])
    torch.testing.assert_close(dy.full_tensor(), y)
'''

# The inputs and the single-device result: made once, before the test, as the
# LocalTensorMode script makes them (``--inputs module``), or by every rank in
# the test body (``--inputs body``: n copies alive at once, since every rank
# holds its own until the last one is done).
_INPUTS = '''gen = torch.Generator().manual_seed(0)
x = torch.randn(2 * N + 3, 8, generator=gen)
w = torch.randn(8, 8, generator=gen)
y = torch.randn(2 * SHAPE[0] + 1, 3 * SHAPE[2] + 1, generator=gen)
want = (x * 2 + 1) @ w
'''

_TORCH_SCRIPT = '''
import sys, time
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

N, SHAPE = {n}, {shape}
gen = torch.Generator().manual_seed(0)
x = torch.randn(2 * N + 3, 8, generator=gen)
w = torch.randn(8, 8, generator=gen)
y = torch.randn(2 * SHAPE[0] + 1, 3 * SHAPE[2] + 1, generator=gen)
want = (x * 2 + 1) @ w
t0 = time.perf_counter()
dist.init_process_group("fake", rank=0, world_size=N, store=FakeStore())
mesh = init_device_mesh("cpu", (N,))
mesh3 = init_device_mesh("cpu", SHAPE, mesh_dim_names=("dp", "cp", "tp"))
with LocalTensorMode(frozenset(range(N))):
    dx = distribute_tensor(x, mesh, [Shard(0)])
    dw = distribute_tensor(w, mesh, [Replicate()])
    out = (dx * 2 + 1) @ dw
    full = out.redistribute(mesh, [Replicate()]).to_local()
    dy = distribute_tensor(y, mesh3, [Shard(0), Replicate(), Shard(1)])
    back = dy.full_tensor()
# Every rank's value against the single-device result, as every rank of
# ours checks its own: part of the scenario, so inside the timing.
for r, v in full._local_tensors.items():
    torch.testing.assert_close(v, want)
for r, v in back._local_tensors.items():
    torch.testing.assert_close(v, y)
took = time.perf_counter() - t0
print("SCENARIO_S", took)
'''


def _run(cmd: list[str], env: dict, timeout: float) -> tuple[int, float, float, str]:
    """(returncode, wall s, peak RSS GB, output) of one child process."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                text=True)
        deadline = t0 + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                status = -9
                break
            time.sleep(0.05)
        proc.returncode = 0  # reaped by wait4; keep Popen from waiting again
        wall = time.perf_counter() - t0
        log.seek(0)
        out = log.read()
    rc = os.waitstatus_to_exitcode(status) if status != -9 else -9
    return rc, wall, usage.ru_maxrss / 2**20, out  # ru_maxrss is in KiB on Linux


def _env(tcache: bool) -> dict:
    from launch.sim.malloc import without_thread_caches

    return dict(os.environ) if tcache else without_thread_caches(os.environ)


def ours(n: int, timeout: float, inputs: str = "module", tcache: bool = False) -> dict:
    here = _INPUTS if inputs == "module" else ""
    body = textwrap.indent(_INPUTS, "    ") if inputs == "body" else ""
    with tempfile.TemporaryDirectory() as tmp:
        test = Path(tmp) / f"test_sim_scale_{n}.py"
        test.write_text(_OURS_TEST.format(n=n, shape=SHAPES_3D[n], timeout=int(timeout),
                                          inputs_here=here, inputs_in_body=body))
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--dist-sim",
               "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"),
               f"--junitxml={junit}", str(test)]
        rc, wall, peak, out = _run(cmd, _env(tcache), timeout)
        took = None
        if rc == 0 and junit.exists():
            case = next(ET.parse(junit).getroot().iter("testcase"))
            took = float(case.get("time"))
    return {"rc": rc, "wall": wall, "peak": peak, "scenario": took, "out": out}


def theirs(n: int, timeout: float, tcache: bool = False) -> dict:
    script = _TORCH_SCRIPT.format(n=n, shape=SHAPES_3D[n])
    rc, wall, peak, out = _run([sys.executable, "-c", script], _env(tcache), timeout)
    took = None
    for line in out.splitlines():
        if line.startswith("SCENARIO_S "):
            took = float(line.split()[1])
    return {"rc": rc, "wall": wall, "peak": peak, "scenario": took, "out": out}


def _median(runs: list[dict]) -> dict | None:
    """The median run by scenario time (a failed run counts as slowest)."""
    if not runs:
        return None
    ranked = sorted(runs, key=lambda r: (r["scenario"] is None, r["scenario"] or 0.0))
    return ranked[(len(ranked) - 1) // 2]


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if r["scenario"] is None:
        why = "timed out" if r["rc"] == -9 else f"failed (rc {r['rc']})"
        return f"{why} after {r['wall']:.0f} s ({r['peak']:.2f} GB)"
    return f"{r['scenario']:.2f} s ({r['peak']:.2f} GB; process {r['wall']:.1f} s)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64,256,512,1024",
                   help=f"comma-separated world sizes (each in {sorted(SHAPES_3D)})")
    p.add_argument("--side", choices=("both", "ours", "torch"), default="both")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds one side may take at one size before it is killed")
    p.add_argument("--inputs", choices=("module", "body"), default="module",
                   help="ours: make the inputs once at module level, as the "
                        "LocalTensorMode script does (default), or on every rank")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each (size, side) this many times, alternating the sides, "
                        "and keep the median run (a shared machine's speed drifts)")
    p.add_argument("--glibc-tcache", action="store_true",
                   help="start both processes with glibc's per-thread caches of freed "
                        "blocks on (glibc's default) rather than off")
    p.add_argument("-v", "--verbose", action="store_true", help="print failing output")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat: runs per side must be at least 1, got {args.repeat}")
    sizes = [int(s) for s in args.sizes.split(",")]
    bad = [s for s in sizes if s not in SHAPES_3D]
    if bad:
        p.error(f"--sizes: no 3-D mesh shape for {bad}; choose from {sorted(SHAPES_3D)}")
    rows = []
    for n in sizes:
        runs_a, runs_b = [], []
        for _ in range(args.repeat):
            if args.side in ("both", "ours"):
                runs_a.append(ours(n, args.timeout, args.inputs, args.glibc_tcache))
            if args.side in ("both", "torch"):
                runs_b.append(theirs(n, args.timeout, args.glibc_tcache))
        a, b = _median(runs_a), _median(runs_b)
        for name, r in (("ours", a), ("LocalTensorMode", b)):
            if r is not None and r["scenario"] is None and args.verbose:
                print(f"--- {name} at {n} ranks:\n{r['out'][-3000:]}", file=sys.stderr)
        ratio = "-"
        if a and b and a["scenario"] and b["scenario"]:
            ratio = f"{b['scenario'] / a['scenario']:.1f}x"
        rows.append((n, _cell(a), _cell(b), ratio))
        print(f"{n} ranks: ours {_cell(a)}; LocalTensorMode {_cell(b)}", file=sys.stderr,
              flush=True)
    print("| ranks | 3-D mesh | ours (simulated world) | LocalTensorMode | speed-up |")
    print("|---:|---|---:|---:|---:|")
    for n, a, b, ratio in rows:
        print(f"| {n} | {'x'.join(map(str, SHAPES_3D[n]))} | {a} | {b} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
