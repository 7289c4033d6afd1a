"""Benchmark: classes of PyTorch's distributed test bases, their own harness
versus the service (launch/torchbases).

One file holds a ``DTensorTestBase`` class (``@with_comms``, a mesh, a
sharded tensor checked with ``assertEqual``) and a ``MultiProcContinuousTest``
class with the same body, K methods each, world size N. The same file runs

- by the bases' own harness: ``pytest -p no:launch.plugin`` (a spawned world
  per ``DTensorTestBase`` method, one per ``MultiProcContinuousTest`` class),
  alone and under ``-n 2``;
- by the service: plain ``pytest`` (worlds launched by the plugin),
  ``torchrun --nproc_per_node=N -m pytest`` and ``pytest -n 2``.

Each method's body records a timestamp on rank 0. Reported per harness and
class: the whole command's wall time, and the steady-state seconds per test
(the spread of the timestamps over the number of gaps: what a further test
costs, start-up excluded). Ratios are the own harness over the service; the
service under ``-n 2`` is also set against the own harness under ``-n 2``.

    python bench/torch_bases.py                     # N=4, K=8, one run each
    python bench/torch_bases.py --tests 12 --reps 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SUITE = '''
import os, time
import torch, torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorTestBase, with_comms)


def _mark(rank, cls):
    if rank == 0:
        with open(os.environ["BENCH_MARKS"] + "." + cls, "a") as f:
            f.write(repr(time.time()) + "\\n")


def _body(self):
    mesh = self.build_device_mesh()
    x = torch.arange(4.0 * self.world_size)
    d = distribute_tensor(x, mesh, [Shard(0)])
    self.assertEqual(d.full_tensor(), x)
    t = torch.ones(1)
    dist.all_reduce(t)
    self.assertEqual(t.item(), float(self.world_size))


class PerTest(DTensorTestBase):
    @property
    def world_size(self):
        return {n}


class PerClass(MultiProcContinuousTest):
    world_size = {n}

    @classmethod
    def backend_str(cls):
        return "gloo"

    def build_device_mesh(self):
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh("cpu", (self.world_size,))


def _per_test(self):
    _mark(self.rank, "PerTest")
    _body(self)


def _per_class(self):
    _mark(self.rank, "PerClass")
    _body(self)


for _i in range({k}):
    setattr(PerTest, f"test_{{_i:02d}}", with_comms(_per_test))
    setattr(PerClass, f"test_{{_i:02d}}", _per_class)
'''


def _env(d: Path) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTEST_ADDOPTS",
            "PYTHONDONTWRITEBYTECODE")
    e = {k: v for k, v in os.environ.items() if k not in drop}
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")]))
    e["OMP_NUM_THREADS"] = "1"
    # NOTE: bytecode cached as on a developer's machine (pytest's rewritten test
    # and plugin modules too), in a folder of this run, never in the tree: without
    # it every pytest process compiles the project's ~200 modules (~2 s here).
    e["PYTHONPYCACHEPREFIX"] = str(d / "pycache")
    return e


def warm(d: Path, cmds: dict[str, list[str]]) -> None:
    """Fill the bytecode cache (one collection per distinct command), untimed."""
    seen = set()
    for cmd in cmds.values():
        plain = tuple(a for a in cmd if a not in ("-n", "2"))
        if plain in seen:
            continue
        seen.add(plain)
        subprocess.run([*plain, "--collect-only"], cwd=d, env=_env(d), capture_output=True,
                       timeout=600)


def commands(n: int) -> dict[str, list[str]]:
    py = sys.executable
    base = ["-q", "-p", "no:cacheprovider", "test_bench_bases.py"]
    return {
        "own harness": [py, "-m", "pytest", "-p", "no:launch.plugin", *base],
        "service, plain pytest": [py, "-m", "pytest", *base],
        f"service, torchrun N={n}": [py, "-m", "torch.distributed.run", "--standalone",
                                     f"--nproc-per-node={n}", "-m", "pytest", *base],
        "service, pytest -n 2": [py, "-m", "pytest", "-n", "2", *base],
        "own harness, pytest -n 2": [py, "-m", "pytest", "-p", "no:launch.plugin", "-n", "2",
                                     *base],
    }


def run_once(d: Path, cmd: list[str], k: int) -> tuple[float, dict[str, float]]:
    """(wall seconds, class -> steady-state seconds per test)."""
    marks = d / "marks"
    for cls in ("PerTest", "PerClass"):
        Path(f"{marks}.{cls}").unlink(missing_ok=True)
    env = dict(_env(d), BENCH_MARKS=str(marks))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if p.returncode != 0 or f"{2 * k} passed" not in p.stdout:
        raise SystemExit(f"benchmark command failed: {' '.join(cmd)}\n"
                         f"{(p.stdout + p.stderr)[-3000:]}")
    per = {}
    for cls in ("PerTest", "PerClass"):
        m = sorted(float(x) for x in Path(f"{marks}.{cls}").read_text().split())
        assert len(m) == k, (cls, len(m))
        per[cls] = (m[-1] - m[0]) / (k - 1)
    return wall, per


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tests", type=int, default=8, help="methods per class (K)")
    p.add_argument("--reps", type=int, default=1, help="runs of each harness (medians)")
    args = p.parse_args()
    n, k = args.ranks, args.tests
    rows: dict[str, list[tuple[float, dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "test_bench_bases.py").write_text(SUITE.format(n=n, k=k))
        cmds = commands(n)
        warm(d, cmds)
        for _ in range(args.reps):  # harnesses take turns: load hits them alike
            for name, cmd in cmds.items():
                rows.setdefault(name, []).append(run_once(d, cmd, k))
    med = statistics.median
    print(f"{2 * k} tests ({k} per class), {n} ranks, {args.reps} run(s) each; "
          f"bytecode cache warmed untimed; load average at the end "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| harness | whole command | per test, DTensorTestBase | "
          "per test, MultiProcContinuousTest |")
    print("|---|---:|---:|---:|")
    summary = {}
    for name, runs in rows.items():
        wall = med(w for w, _ in runs)
        pt = med(r["PerTest"] for _, r in runs)
        pc = med(r["PerClass"] for _, r in runs)
        summary[name] = (wall, pt, pc)
        print(f"| {name} | {wall:.1f} s | {pt * 1e3:.1f} ms | {pc * 1e3:.1f} ms |")
    print()
    for name, (wall, pt, pc) in summary.items():
        if name.startswith("own harness"):
            continue
        # -n 2 is set against the own harness both as it runs alone and under -n 2
        refs = ["own harness"] + (["own harness, pytest -n 2"] if "-n 2" in name else [])
        for ref in refs:
            own = summary[ref]
            print(f"{name} vs {ref}: whole command {own[0] / wall:.1f}x faster; per test "
                  f"{own[1] / pt:.0f}x faster than DTensorTestBase's harness, "
                  f"{own[2] / pc:.2f}x MultiProcContinuousTest's")


if __name__ == "__main__":
    main()
