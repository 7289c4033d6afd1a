"""Benchmark of the test service against torch's own distributed harnesses.

The same 20 trivial distributed tests (all_reduce of one float, check the
sum) run (a) by our service, from plain pytest (worlds launched by the
plugin) and under torchrun (lockstep), (b) as a ``MultiProcessTestCase``
suite (processes spawned per test) and (c) as a ``MultiProcContinuousTest``
suite (one world per class), at 2, 4 and 8 ranks (8 oversubscribes a 2-core
machine), plus ours under torchrun as two "nodes" of N/2 ranks on this
machine (``--nnodes=2``, c10d rendezvous on loopback). Each test body records a
timestamp on rank 0; the steady-state cost per test is the spread of those
timestamps over the number of gaps (start-up excluded), and the whole
command's wall time is reported beside it. It also measures lockstep mode's
per-test agreement overhead: 200 empty tests under torchrun versus the same
tests in one plain process.

    python bench/harness.py                  # markdown tables on stdout
    python bench/harness.py --sizes 2 --reps 1
    python bench/harness.py --sizes 8 --reps 1 --skip-overhead   # the N=8 rows

MultiProcessTestCase and MultiProcContinuousTest live in
``torch.testing._internal``, which needs ``numpy`` and ``expecttest``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
N_TESTS = 20

MARK = """
import os, time

def _mark(rank):
    if rank == 0:
        with open(os.environ["BENCH_MARKS"], "a") as f:
            f.write(repr(time.monotonic()) + "\\n")
"""

OURS = MARK + """
import pytest, torch, torch.distributed as dist
{tests}
"""
OURS_TEST = """
@pytest.mark.world_size({n})
def test_{i:02d}(world):
    _mark(world.rank)
    t = torch.ones(1); dist.all_reduce(t, group=world.group); assert t.item() == {n}
"""

MPTC = MARK + """
import torch, torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.common_utils import run_tests

class Bench(MultiProcessTestCase):
    @property
    def world_size(self):
        return {n}

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _check(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        _mark(self.rank)
        t = torch.ones(1); dist.all_reduce(t); assert t.item() == {n}
        dist.destroy_process_group()

for _i in range({count}):
    setattr(Bench, f"test_{{_i:02d}}", lambda self: self._check())

if __name__ == "__main__":
    run_tests()
"""

MPCT = MARK + """
import torch, torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import run_tests

class Bench(MultiProcContinuousTest):
    world_size = {n}

    @classmethod
    def backend_str(cls):
        return "gloo"

    def _check(self):
        _mark(self.rank)
        t = torch.ones(1); dist.all_reduce(t); assert t.item() == {n}

for _i in range({count}):
    setattr(Bench, f"test_{{_i:02d}}", lambda self: self._check())

if __name__ == "__main__":
    run_tests()
"""

LOOP_TIMER = """
import os, time, pytest
pytest_plugins = ["launch.plugin"]

@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session):
    t0 = time.perf_counter()
    try:
        return (yield)
    finally:
        if os.environ.get("RANK", "0") == "0" and "BENCH_LOOP_FILE" in os.environ:
            with open(os.environ["BENCH_LOOP_FILE"], "w") as f:
                f.write(str(time.perf_counter() - t0))
"""


TWO_NODES = "ours, torchrun lockstep, 2 nodes"


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> float:
    """Wall seconds of ``cmd``; a ``TWO_NODES`` command is started twice
    (two "nodes" meeting at one rendezvous) and timed until both end."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")]))
    e["OMP_NUM_THREADS"] = "1"
    e.update(env or {})
    copies = 2 if any(a == "--nnodes=2" for a in cmd) else 1
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd, cwd=cwd, env=e, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(copies)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    dt = time.perf_counter() - t0
    for p, out in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"benchmark command failed: {' '.join(cmd)}\n{out[-3000:]}")
    return dt


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(d: Path) -> None:
    (d / "conftest.py").write_text(textwrap.dedent(LOOP_TIMER))
    (d / "pytest.ini").write_text("[pytest]\nmarkers =\n    world_size(n): ranks\n")


def _harness_cmds(n: int, d: Path, count: int, mptc_count: int) -> dict[str, list[str]]:
    py = sys.executable
    base = ["-q", "-p", "no:cacheprovider"]
    tests = "".join(OURS_TEST.format(n=n, i=i) for i in range(count))
    (d / "test_ours.py").write_text(OURS.format(tests=tests))
    (d / "mpct.py").write_text(MPCT.format(n=n, count=count))
    (d / "mptc.py").write_text(MPTC.format(n=n, count=mptc_count))
    cmds = {
        "ours, plain pytest": [py, "-m", "pytest", *base, "test_ours.py"],
        "ours, torchrun lockstep": [py, "-m", "torch.distributed.run", "--standalone",
                                    f"--nproc-per-node={n}", "-m", "pytest", *base,
                                    "test_ours.py"],
        "MultiProcContinuousTest": [py, "mpct.py"],
        "MultiProcessTestCase": [py, "mptc.py"],
    }
    if n >= 4 and n % 2 == 0:
        cmds[TWO_NODES] = [py, "-m", "torch.distributed.run", "--nnodes=2",
                           f"--nproc-per-node={n // 2}", "--rdzv-backend=c10d",
                           f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "-m", "pytest",
                           *base, "test_ours.py"]
    return cmds


def _marks(path: Path) -> list[float]:
    return sorted(float(x) for x in path.read_text().split())


def bench_sizes(n: int, mptc_count: int, reps: int, mptc_reps: int
                ) -> dict[str, list[tuple[float, float]]]:
    """name -> [(wall s of the whole command, s per test)] at n ranks, one
    entry per repetition; the harnesses take turns, so load hits them alike.

    Per test is the steady-state cost: the time between the first and the
    last test body's start on rank 0, divided by the number of gaps, so it
    holds everything a harness does between two tests (agreement, report
    shipping, or a new world for MultiProcessTestCase) but not start-up."""
    out: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        _setup(d)
        cmds = _harness_cmds(n, d, N_TESTS, mptc_count)
        for rep in range(reps):
            for name, cmd in cmds.items():
                count = mptc_count if name == "MultiProcessTestCase" else N_TESTS
                if count < 2 or (name == "MultiProcessTestCase" and rep >= mptc_reps):
                    continue
                marks = d / "marks.txt"
                marks.unlink(missing_ok=True)
                wall = _run(cmd, d, {"BENCH_MARKS": str(marks)})
                m = _marks(marks)
                assert len(m) == count, (name, len(m))
                out.setdefault(name, []).append((wall, (m[-1] - m[0]) / (count - 1)))
    return out


def agreement_overhead(n: int, count: int = 200, reps: int = 3) -> tuple[float, float]:
    """Seconds per test that lockstep agreement adds: 200 empty tests under
    torchrun versus the same tests in one plain process (steady state; min and
    median over reps of the difference)."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        _setup(d)
        body = MARK + "import os\n" + "".join(
            f"def test_{i:03d}():\n    _mark(int(os.environ.get('RANK', 0)))\n"
            for i in range(count))
        (d / "test_empty.py").write_text(body)
        marks = d / "marks.txt"
        env = {"BENCH_MARKS": str(marks)}
        py = sys.executable
        base = ["-q", "-p", "no:cacheprovider", "test_empty.py"]
        diffs = []
        for _ in range(reps):
            pair = []
            for cmd in ([py, "-m", "pytest", *base],
                        [py, "-m", "torch.distributed.run", "--standalone",
                         f"--nproc-per-node={n}", "-m", "pytest", *base]):
                marks.unlink(missing_ok=True)
                _run(cmd, d, env)
                m = _marks(marks)
                pair.append((m[-1] - m[0]) / (len(m) - 1))
            diffs.append(pair[1] - pair[0])
        return min(diffs), statistics.median(diffs)


def _check_torch_test_deps() -> None:
    try:
        import expecttest  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"{e}: torch's MultiProcessTestCase/MultiProcContinuousTest "
                         "(torch.testing._internal) need numpy and expecttest; "
                         "pip install numpy expecttest (or put them on PYTHONPATH)") from e


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--reps", type=int, default=3,
                   help="runs of each harness (medians are reported)")
    p.add_argument("--mptc-tests", type=int, default=5,
                   help="tests for MultiProcessTestCase (it spawns a world per test: slow)")
    p.add_argument("--mptc-reps", type=int, default=1, help="runs of MultiProcessTestCase")
    p.add_argument("--skip-overhead", action="store_true",
                   help="leave out the 200-empty-test agreement overhead runs")
    args = p.parse_args()
    _check_torch_test_deps()
    rows = {n: bench_sizes(n, args.mptc_tests, args.reps, args.mptc_reps) for n in args.sizes}
    over = {} if args.skip_overhead else {n: agreement_overhead(n, reps=args.reps)
                                          for n in args.sizes}
    med = statistics.median
    print(f"load average at the end: {os.getloadavg()[0]:.1f}; {args.reps} runs each "
          f"({args.mptc_reps} of MultiProcessTestCase), medians (min in brackets)\n")
    print("| harness | N | tests | whole command | per test (steady state) |")
    print("|---|---|---|---|---|")
    for n in args.sizes:
        for name, runs in rows[n].items():
            count = args.mptc_tests if name == "MultiProcessTestCase" else N_TESTS
            walls, pers = [w for w, _ in runs], [t for _, t in runs]
            print(f"| {name} | {n} | {count} | {med(walls):.1f} s | {med(pers) * 1e3:.1f} ms "
                  f"({min(pers) * 1e3:.1f}) |")
    for n in args.sizes:
        r = {name: med([t for _, t in runs]) for name, runs in rows[n].items()}
        for ours in ("ours, plain pytest", "ours, torchrun lockstep", TWO_NODES):
            if ours not in r:
                continue
            parts = [f"MultiProcContinuousTest / ours = {r['MultiProcContinuousTest'] / r[ours]:.2f}x"]
            if "MultiProcessTestCase" in r:
                parts.insert(0, f"MultiProcessTestCase / ours = {r['MultiProcessTestCase'] / r[ours]:.0f}x")
            print(f"\nN={n}, per test, {ours}: " + "; ".join(parts))
    if not over:
        return
    print("\n| lockstep agreement overhead per test | " + " | ".join(f"N={n}" for n in args.sizes) + " |")
    print("|---|" + "---|" * len(args.sizes))
    print("| 200 empty tests, torchrun vs one process, median (min) | "
          + " | ".join(f"{over[n][1] * 1e3:.2f} ms ({over[n][0] * 1e3:.2f})" for n in args.sizes)
          + " |")



if __name__ == "__main__":
    main()
