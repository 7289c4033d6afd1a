"""Property-suite throughput: a simulated world (ranks as threads, ``pytest
--dist-sim``) against a real Gloo world of the same size, and a reduced
64-rank run of every property.

Both runs use the ``ci`` Hypothesis profile (derandomized: the same examples
in both), so the ratio of wall times is the ratio of examples per second;
the example count comes from the simulated run's summary line. Wall times
include starting the world (a real world's start-up is part of its cost).

    python bench/sim_throughput.py                      # 4 ranks, test_redistribute.py
    python bench/sim_throughput.py --files tests/properties   # the whole suite
    python bench/sim_throughput.py --big 64 --examples 2      # every property at 64 ranks
    python bench/sim_throughput.py --files tests/properties --sim-workers 2  # xdist, 2 cores
    python bench/sim_throughput.py --files tests/properties --sim-workers 2 --repeat 3
    python bench/sim_throughput.py --files tests/properties --sim-workers 2 --marginal
    DTENSOR_MUTANT=gather_drops_last_uneven_shard python bench/sim_throughput.py --ranks 2

Only tests that run in a world (``world_size``-marked) are timed, on both
sides: the two self-tests in ``tests/properties/test_lockstep_plugin.py``
start their own 2-rank torchrun world in a subprocess, take the same ~9 s
whatever the mode, hold none of the counted examples and are skipped in the
main job's torchrun world. ``--all-tests`` times the whole files instead.

``--marginal`` splits each side's wall time in two: one more pair runs
every property with one example (profile ``ci-1``: start-up, imports,
collection, each test's set-up and first example, exit), and the rest of
the full run, divided by the rest of the examples, is the cost of one more
example. The ratio of those is what a long session (``fuzz`` profile, many
examples per property) gains per example; the fixed part is what a short
run pays either way.

It also compares every test's verdict (junit) between the two runs: the
simulated world must pass and fail exactly the tests the real one does.

Run it on a quiet machine; it prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pytest(files: list[str], sizes: str, extra: list[str],
            junit: str | None = None, profile: str = "ci") -> tuple[float, str, int]:
    env = dict(os.environ, DTENSOR_WORLD_SIZES=sizes)
    plugin = ["-p", "bench._short_profile"] if profile != "ci" else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin,
           f"--hypothesis-profile={profile}", "--dist-timeout", "600", *files, *extra]
    if junit:
        cmd.append(f"--junitxml={junit}")
    if LOCK:  # wait for a shared machine's lock, then time the run itself
        cmd = ["flock", LOCK[0], "sh", "-c", 'date +%s.%N >&2; exec "$@"', "sh", *cmd]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if LOCK and re.match(r"\d+\.\d+", out.stderr):
        took = time.time() - float(out.stderr.split()[0])
    return took, out.stdout + out.stderr, out.returncode


LOCK: list[str] = []


def verdicts(junit: str) -> dict[str, str]:
    """test id -> passed/failed/skipped from a junit file."""
    import xml.etree.ElementTree as ET

    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = {c.tag for c in case}
        name = f"{case.get('classname')}::{case.get('name')}"
        out[name] = ("failed" if kinds & {"failure", "error"} else
                     "skipped" if "skipped" in kinds else "passed")
    return out


def _summary(text: str) -> str:
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    return lines[-1].strip("= ") if lines else "(no summary)"


def _examples(text: str) -> int | None:
    m = re.search(r"(\d+) hypothesis examples", text)
    return int(m.group(1)) if m else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", nargs="+", default=["tests/properties/test_redistribute.py"])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--big", type=int, default=0, help="also run every property at this size")
    ap.add_argument("--examples", type=int, default=2, help="examples per property at --big")
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--sim-workers", type=int, default=1,
                    help="xdist workers for the simulated run (-n); each hosts its tests' "
                         "simulated worlds. A real 4-rank world already keeps 2 cores busy")
    ap.add_argument("--lock", default=None, help="flock this file around each pytest run")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the pair (simulated, then real) this many times; report the "
                         "median ratio")
    ap.add_argument("--marginal", action="store_true",
                    help="also run both sides at one example per property and split "
                         "the wall time into fixed and per-example parts")
    ap.add_argument("--all-tests", action="store_true",
                    help="also time the tests that run in no world (see the docstring)")
    a = ap.parse_args()
    if a.sim_workers < 1:
        ap.error(f"--sim-workers must be >= 1, got {a.sim_workers}")
    if a.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {a.repeat}")
    if a.marginal and a.skip_real:
        ap.error("--marginal splits both sides' wall times: it needs the real run; "
                 "drop --skip-real")
    only = [] if a.all_tests else ["-m", "world_size"]
    if a.lock:
        LOCK.append(a.lock)
    n = str(a.ranks)
    print("tests timed: " + ("all of them" if a.all_tests else
                             "those that run in a world (-m world_size)") + "\n")
    print("| world | ranks | wall s | examples | examples/s | result |\n|---|---|---|---|---|---|")
    tmp = os.environ.get("SIM_BENCH_DIR") or tempfile.mkdtemp()
    # worksteal: the property files end in long tests (child runs of the
    # lockstep self-tests); plain load scheduling left one worker idle there.
    workers = ["-n", str(a.sim_workers), "--dist", "worksteal"] if a.sim_workers > 1 else []
    label = "simulated" + (f" (-n {a.sim_workers})" if workers else "")
    ratios: list[float] = []
    walls: dict[str, list[float]] = {"sim": [], "real": []}
    examples = None
    for i in range(a.repeat):
        # Alternate the two sides: this shared machine's speed drifts by ~10%
        # over minutes, so each ratio comes from runs seconds apart.
        junit = (lambda side: f"{tmp}/{side}.xml") if i == 0 else (lambda side: None)
        sim_s, sim_out, _ = _pytest(a.files, n, ["--dist-sim", *workers, *only], junit("sim"))
        ex = examples = _examples(sim_out)
        walls["sim"].append(sim_s)
        rate = ex / sim_s if ex else float("nan")
        print(f"| {label} | {n} | {sim_s:.1f} | {ex} | {rate:.1f} | {_summary(sim_out)} |")
        if a.skip_real:
            continue
        real_s, real_out, _ = _pytest(a.files, n, only, junit("real"))
        walls["real"].append(real_s)
        real_rate = ex / real_s if ex else float("nan")
        print(f"| real (Gloo) | {n} | {real_s:.1f} | {ex} | {real_rate:.1f} | "
              f"{_summary(real_out)} |")
        ratios.append(real_s / sim_s)
    if ratios:
        each = ", ".join(f"{r:.2f}x" for r in ratios)
        print(f"\nsimulated / real examples per second: {statistics.median(ratios):.2f}x"
              + (f" (median of {len(ratios)} pairs: {each})" if len(ratios) > 1 else ""))
        sim_v, real_v = verdicts(f"{tmp}/sim.xml"), verdicts(f"{tmp}/real.xml")
        differ = {k: (sim_v.get(k), real_v.get(k)) for k in sim_v.keys() | real_v.keys()
                  if sim_v.get(k) != real_v.get(k)}
        print(f"verdicts: {len(sim_v)} tests, {len(differ)} differ (simulated, real)"
              + "".join(f"\n  {k}: {v}" for k, v in sorted(differ.items())))
    if a.marginal and ratios and examples:
        _marginal(a.files, n, [*workers, *only], only, label, walls, examples)
    if a.big:
        big_s, big_out, rc = _pytest(["tests/properties"], str(a.big),
                                     ["--dist-sim", f"--dist-sim-examples={a.examples}", *only])
        print(f"\n{a.big}-rank simulated run of every property, {a.examples} examples each: "
              f"{big_s:.0f} s, {_examples(big_out)} examples, {_summary(big_out)} (exit {rc})")
        if rc:
            print("\n".join(ln for ln in big_out.splitlines() if ln.startswith("FAIL")))


def _marginal(files: list[str], n: str, sim_extra: list[str], real_extra: list[str],
              label: str, walls: dict[str, list[float]], examples: int) -> None:
    """One example per property on both sides: wall = fixed + examples x each."""
    sim_s, sim_out, _ = _pytest(files, n, ["--dist-sim", *sim_extra], profile="ci-1")
    one = _examples(sim_out)
    real_s, _, _ = _pytest(files, n, real_extra, profile="ci-1")
    if not one or one >= examples:
        print(f"\n--marginal: no example count to split by (one: {one}, full: {examples})")
        return
    sim_full, real_full = (statistics.median(walls[k]) for k in ("sim", "real"))
    more = examples - one
    sim_each, real_each = (sim_full - sim_s) / more, (real_full - real_s) / more
    print(f"\n| split ({more} examples past the first of each property) | {label} | "
          f"real (Gloo) | real / simulated |\n|---|---|---|---|")
    print(f"| one example per property ({one}): wall s | {sim_s:.1f} | {real_s:.1f} | "
          f"{real_s / sim_s:.2f}x |")
    print(f"| each further example: ms | {1e3 * sim_each:.2f} | {1e3 * real_each:.2f} | "
          f"{real_each / sim_each:.2f}x |")


if __name__ == "__main__":
    main()
