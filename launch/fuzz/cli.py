"""``python -m launch fuzz``: a time-boxed, coverage-guided fuzzing session
of every collected ``@given`` test, in lockstep on N ranks.

    python -m launch fuzz tests/properties --minutes 10 --nproc 4
    python -m launch fuzz tests/properties --minutes 10 --sim 4   # simulated ranks

It starts a torchrun world whose ranks run ``launch.fuzz.rank`` (the loop)
under the lockstep mode (with ``--sim N``: one ``pytest --dist-sim``
process whose simulated worlds run the ranks as threads), shows progress
live, and restarts the world when a hang or a dead rank ends it: the
example that was running is recorded as a failure and the session goes on
until the budget. At the end it writes a
report folder (Markdown, JSON, HTML) and keeps the session state beside the
example database, so the next session over the same database resumes.
Failures go to the example database (``--db``, default ``.fuzz-db``), which
``launch.fuzz.replay`` makes every later pytest run (the ``ci`` profile
included) replay first.

Before any world starts, one plain pytest process collects the tests with
the session's plugins: a path that does not exist, a plugin or Hypothesis
profile that is missing, a collection error or no ``@given`` test at all
ends the command there, with pytest's own reason. Exit status: 0 no new
failure, 1 the session found a failure, 3 no example ran (the worlds'
reason is printed), 4 the session cannot start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from launch.fuzz import rank as R
from launch.fuzz.replay import DEFAULT_DB, replay_line
from launch.fuzz.session import STATE_NAME, Failure, Session
from launch.sim.malloc import without_thread_caches

GRACE = 20.0  # seconds a world may run past the budget (its last slice) before it is stopped


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m launch fuzz",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="time budget (default 10)")
    p.add_argument("--nproc", "--nproc-per-node", type=int, default=2, dest="nproc")
    p.add_argument("--nnodes", default=None, help="torchrun --nnodes (with --rdzv-endpoint)")
    p.add_argument("--rdzv-endpoint", default=None, help="torchrun --rdzv-endpoint HOST:PORT")
    p.add_argument("--db", default=DEFAULT_DB, help=f"example database folder ({DEFAULT_DB})")
    p.add_argument("--report", default=None, help="report folder (default: in the session folder)")
    p.add_argument("--log-dir", default=".launch-logs", help="root of session folders")
    p.add_argument("--slice", type=float, default=8.0, help="seconds per slice (default 8)")
    p.add_argument("--hang", type=float, default=120.0,
                   help="seconds without a new example before a world counts as hung")
    p.add_argument("--cover", default="dtensor", help="package whose coverage guides (dtensor)")
    p.add_argument("--fresh", action="store_true", help="do not resume the database's state")
    p.add_argument("--sim", type=int, default=None, metavar="N",
                   help="simulated worlds of up to N ranks (threads of one pytest "
                        "--dist-sim process) instead of torchrun ranks")
    args, rest = p.parse_known_args(argv)
    # Checked before any world starts: a budget or a world that cannot run
    # must not end in an empty session that looks like a clean one.
    for name, value, least in (("--minutes", args.minutes, None), ("--nproc", args.nproc, 1),
                               ("--sim", args.sim, 1), ("--slice", args.slice, None),
                               ("--hang", args.hang, None)):
        if value is None and name == "--sim":
            continue
        if (least is None and not value > 0) or (least is not None and value < least):
            p.error(f"{name} must be {'> 0' if least is None else f'>= {least}'}, got {value}"
                    + (" (leave --sim out for real torchrun ranks)" if name == "--sim" else ""))
    args.sim = args.sim or 0
    if "--" in rest:
        rest.remove("--")
    return args, rest or ["tests/properties"]


def main(argv: list[str]) -> int:
    args, pytest_args = parse(argv)
    bad = _preflight(args, pytest_args)
    if bad:
        print(bad, file=sys.stderr, flush=True)
        return 4
    start = time.time()
    deadline = start + args.minutes * 60
    run_dir = Path(args.log_dir).resolve() / f"fuzz-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    db = Path(args.db).resolve()
    db.mkdir(parents=True, exist_ok=True)
    old = None if args.fresh else Session.read(db / STATE_NAME)
    state = old.resumed() if old is not None else Session()
    state.budget_s, state.nproc, state.args = args.minutes * 60, args.sim or args.nproc, pytest_args
    known = {f.key for f in state.failures}
    state.save(run_dir / "state.json")
    ranks = f"{args.sim} simulated ranks" if args.sim else f"{args.nproc} ranks"
    print(f"launch fuzz: {ranks}, {args.minutes:g} min, database {db}"
          + (f" (resuming session {old.sessions}: {old.total:.0f} s, "
             f"{len(old.failures)} known failures)" if old else "")
          + f"; logs in {run_dir}", flush=True)
    from launch.fuzz.live import Live

    live = Live()
    failed_starts = 0
    try:
        while time.time() < deadline - 5 and failed_starts < 3:
            k = len(state.worlds)
            t0 = time.time() - start
            rc, why = _world(args, pytest_args, run_dir, db, start, deadline, k, live)
            state = Session.read(run_dir / "state.json") or state
            state.elapsed = time.time() - start
            world = {"start": round(t0, 1), "end": round(state.elapsed, 1), "rc": rc, "why": why}
            if state.current:  # the world ended inside a slice: hang or dead rank
                f = _world_failure(state, run_dir, k, why, rc, db)
                state.add_failure(f)
                for p in state.props:
                    if p["nodeid"] == f.nodeid:
                        p["failed"] = True
                world["failure"] = f.nodeid
                state.current = {}
                failed_starts = 0
            elif rc != 0 and time.time() < deadline - 5:
                failed_starts += 1  # died outside any slice (start-up, collection)
            state.worlds.append(world)
            state.save(run_dir / "state.json")
            live_props = [p for p in state.props if not p["failed"] and not p.get("skipped")]
            if rc == 0 and not why and (time.time() >= deadline - 5 or not live_props):
                break  # the loop ended by itself: budget reached or nothing left to run
    finally:
        live.stop()
    state.elapsed = time.time() - start
    state.save(run_dir / "state.json")
    state.save(db / STATE_NAME)
    from launch.fuzz import report

    folder = Path(args.report).resolve() if args.report else run_dir / "report"
    page = report.write(state, folder)
    new = [f for f in state.failures if f.key not in known]
    examples = sum(p["examples"] for p in state.props)
    why = _nothing_ran(state, run_dir) if not examples and not new else ""
    print(f"launch fuzz: {state.elapsed:.0f}s, "
          f"{sum(p['examples'] for p in state.props)} examples, "
          f"{len(new)} new failures ({len(state.failures)} known in all); report {page}",
          flush=True)
    for f in new:
        print(f"  FAILED {f.nodeid}: {f.kind} {f.exc_type} at {f.location}\n"
              f"    example: {f.example[:300]}\n    {f.replay}", flush=True)
    if why:
        print(f"launch fuzz: FAILED: no example ran: {why}", file=sys.stderr, flush=True)
        return 3
    return 1 if new else 0


# The plugins every session needs, whatever the repository's conftest loads:
# the loop, and the lockstep Hypothesis profiles (``fuzz``). Loading a module
# that a conftest names too is harmless: pytest registers a name once.
PLUGINS = ["-p", "launch.fuzz.rank", "-p", "launch.hypo.profiles"]


def _preflight(args: argparse.Namespace, pytest_args: list[str]) -> str:
    """Collect the session's tests in one plain pytest process before any
    world starts; returns why the session cannot run ("" when it can): a
    path that does not exist, a plugin or profile that is missing, a
    collection error, no ``@given`` test at all."""
    cmd = [sys.executable, "-m", "pytest", *PLUGINS, "-p", "no:cacheprovider",
           "--hypothesis-profile=fuzz", "--collect-only", "-q", *pytest_args]
    env = {k: v for k, v in os.environ.items() if k != R.DIR_ENV}
    env["LAUNCH_FUZZ_CHECK"] = "1"  # launch.fuzz.rank prints the @given count
    p = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                       text=True)
    out = (p.stdout + p.stderr).strip()
    if p.returncode == 0:
        counts = re.search(r"launch fuzz: (\d+) @given tests of (\d+)", out)
        if counts and counts.group(1) == "0":
            return (f"launch fuzz: cannot start: no @given test among the "
                    f"{counts.group(2)} tests collected from {shlex.join(pytest_args)}")
        return ""
    said = [ln for ln in out.splitlines() if ln.startswith(("ERROR", "E ", "INTERNALERROR> E"))
            or "Error" in ln or "error" in ln or "not found" in ln]
    head = "\n  ".join(dict.fromkeys(said[-8:] or out.splitlines()[-8:]))
    what = {5: "no test collected", 4: "pytest refused the arguments",
            3: "pytest failed inside (a plugin or profile?)",
            2: "collecting the tests failed"}.get(p.returncode, f"exit {p.returncode}")
    return (f"launch fuzz: cannot start: {what}: {shlex.join(pytest_args)}\n  {head}\n"
            f"  (checked with: {shlex.join(cmd[1:])})")


def _nothing_ran(state: Session, run_dir: Path) -> str:
    """Why a session ran no example (its worlds' logs), for the terminal."""
    if state.props and all(p.get("skipped") for p in state.props):
        return "every @given test was skipped: " + "; ".join(
            f"{p['nodeid']}: {p.get('skipped')}" for p in state.props[:3])
    if not state.props and not any(w["rc"] for w in state.worlds):
        return f"no @given test among the collected tests ({shlex.join(state.args)})"
    logs = sorted(run_dir.glob("world*.log"))
    # The newest world that said why: the last one may have been stopped at
    # the session's end before its ranks got as far as the error.
    said, log = [], (logs[-1] if logs else run_dir)
    for candidate in reversed(logs):
        said = [ln.strip() for ln in _tail(candidate, 400).splitlines()
                if ("Error" in ln or "error:" in ln)
                and "elastic/errors.html" not in ln and "ChildFailedError" not in ln]
        if said:
            log = candidate
            break
    reason = "; ".join(dict.fromkeys(said[-3:])) or "(no error line in the logs)"
    return (f"{len(state.worlds)} world(s) exited without running a slice: {reason}; "
            f"log {log}")


def _world(args: argparse.Namespace, pytest_args: list[str], run_dir: Path, db: Path,
           start: float, deadline: float, k: int, live: Any) -> tuple[int, str]:
    """Run one torchrun world until it exits; returns (exit code, why it was
    stopped: "" when it ended by itself)."""
    env = dict(os.environ)
    env.update({R.DIR_ENV: str(run_dir), R.DEADLINE_ENV: str(deadline), R.DB_ENV: str(db),
                R.START_ENV: str(start), R.SLICE_ENV: str(args.slice),
                R.COVER_ENV: args.cover, "OMP_NUM_THREADS": "1",
                "LAUNCH_RUN_DIR": str(run_dir / f"world{k}")})
    env.pop("LAUNCH_STATUS_FILE", None)
    pytest_cmd = ["-m", "pytest", *PLUGINS, "-p", "no:cacheprovider", "-q",
                  "--hypothesis-profile=fuzz", f"--dist-timeout={max(600.0, args.hang * 2)}"]
    if args.sim:  # one process; the launcher's hang watch below still applies
        env = without_thread_caches(env)  # one rank thread each: see launch.sim.malloc
        env[R.SIM_ENV] = str(args.sim)
        cmd = [sys.executable, *pytest_cmd, "--dist-sim", *pytest_args]
    else:
        topo = ([f"--nnodes={args.nnodes}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={args.rdzv_endpoint}"] if args.nnodes else ["--standalone"])
        cmd = [sys.executable, "-m", "torch.distributed.run", *topo,
               f"--nproc-per-node={args.nproc}", "--max-restarts=0", "--monitor-interval=0.1",
               *pytest_cmd, f"--lockstep-timeout={args.hang}", *pytest_args]
    log = run_dir / f"world{k}.log"
    with open(log, "w") as out:
        out.write(shlex.join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    (run_dir / f"world{k}.pid").write_text(str(proc.pid))
    why = ""
    while proc.poll() is None:
        time.sleep(0.5)
        state = Session.read(run_dir / "state.json")
        inflight = _read_json(run_dir / "inflight.json")
        if state is not None:
            state.elapsed = time.time() - start
            live.update(state, inflight)
            if state.current:
                last = max(float(state.current.get("started", 0)),
                           float((inflight or {}).get("t", 0)))
                if time.time() - last > args.hang:
                    why = f"hang: no new example for {args.hang:.0f} s"
                    break
        if time.time() > deadline + GRACE:
            why = "stopped at the end of the budget"
            break
    if proc.poll() is None:
        _stop(proc)
    return proc.wait(), why


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the world's process group (torchrun and its ranks), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _world_failure(state: Session, run_dir: Path, k: int, why: str, rc: int,
                   db: Path) -> Failure:
    """The failure record of a world that ended inside a slice."""
    cur = state.current
    inflight = _read_json(run_dir / "inflight.json") or {}
    example = inflight.get("example", "") if inflight.get("slice") == cur.get("slice") else ""
    kind = "hang" if why.startswith("hang") else "dead rank"
    tail = _tail(run_dir / f"world{k}.log", 400)
    dead = [ln.strip() for ln in tail.splitlines()
            if "exitcode" in ln or "Signal" in ln or "launch:" in ln][-4:]
    message = why or f"the world exited with code {rc} during the slice"
    if dead:
        message += " | " + " | ".join(dead)
    # NOTE: an example that never finished has no complete choice sequence, so
    # it is not in the database: the replay reruns the property from the start.
    replay = (replay_line(cur.get("nodeid", "?"), state.nproc, db, _env_words())
              + "  # the example above is not in the database (it never finished)")
    return Failure(cur.get("nodeid", "?"), kind, kind, "world", message[:600],
                   example[-2000:], replay, round(state.total, 1))


def _env_words() -> str:
    """Environment that changes what the properties test (a planted mutant)."""
    return " ".join(f"{k}={os.environ[k]}" for k in ("DTENSOR_MUTANT", "DTENSOR_TEST_IMPL")
                    if os.environ.get(k))


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
