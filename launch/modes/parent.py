"""Parent mode: plain ``pytest`` (also each pytest-xdist worker).

Unmarked tests run here as usual. A ``world_size(n)``-marked test runs in a
world of n ranks that this process starts on the first test needing it and
keeps for the session (one world per size): by forking itself, already
collected, once per rank (``launch.modes.forked``), or where that is refused
through ``torch.distributed.run`` (fresh interpreters that collect the same
files). The parent hosts a TCPStore; the ranks run in server mode
(``launch.modes.server``); the parent sends test ids and
logs the reports it gets back as the item's own, so ids, tracebacks, ``-k``,
``-x``, ``--lf`` and junit work as for any test.

The parent sends a run of consecutive tests of one world at once (up to
``MAX_AHEAD``), so the world runs them back to back, agreeing on each outcome
among its ranks, while the parent logs the results in order. It sends one test
at a time when a failure may stop the session (``-x``, ``--maxfail``,
``--stepwise``) and under pytest-xdist (whose scheduler picks the order).

A world that dies (hang, dead rank) fails the test it was running, with the
ranks' report; the parent then ends it completely (torchrun and every rank
process of it, ``launch.rank.procs``) and the next test of that size gets a fresh
world. A world that dies before answering its first test is started once
more; if that one dies too, its tests fail with both worlds' logs (each rank
logs from its first moment, so a rank that dies while starting says why).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from launch.rank.logs import rank_story, tail
from launch.rank.procs import WORLD_ID_ENV, end_world
from launch.world import (
    LOCAL_WORLD,
    LOG_ENV,
    PREFIX_ENV,
    SERVER_ENV,
    World,
    world_size_of,
)

START_ALLOWANCE = 300.0  # seconds for a world to start and collect (loaded CI machines)
GRACE = 30.0  # seconds past a test's timeout before the parent kills its world
MAX_AHEAD = 50  # tests sent to a world in one command


@dataclass
class _World:
    n: int
    prefix: str
    store: Any  # PrefixStore(prefix, parent's store), as the ranks see it
    proc: subprocess.Popen
    log_path: Path
    world_id: str = ""  # the tag on every process of this world (launch.rank.procs)
    seq: int = 0  # the last test sent (tests are numbered 1, 2, ... per world)
    ahead: dict[str, int] = field(default_factory=dict)  # sent, not yet read: id -> seq
    read: int = 0  # the last seq whose results the parent read
    answered: int = 0
    deadline: float = float("inf")
    lock: threading.Lock = field(default_factory=threading.Lock)


class Parent:
    name = "parent"  # launch.world.Mode
    ranks_here = False  # ranks are other processes
    store = None  # each launched world has its own

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.worlds: dict[int, _World] = {}
        self.broken: dict[int, str] = {}
        self.retried: dict[int, str] = {}  # size -> why its first world did not start
        self.store: Any = None
        self.gen = 0
        self.files: dict[int, list[str]] = {}
        self.next_of: dict[str, str | None] = {}
        self.size_of: dict[str, int] = {}
        self.order: list[pytest.Item] = []
        self.session: pytest.Session | None = None  # collected: worlds fork from it
        self.index: dict[str, int] = {}
        c = config
        self.xdist = hasattr(c, "workerinput")  # the scheduler picks this process's tests
        self.one_at_a_time = bool(c.getoption("maxfail", 0) or c.getoption("stepwise", False)
                                  or self.xdist)
        self.run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        root = Path(config.getoption("dist_log_dir") or Path(config.rootpath) / ".launch-logs")
        self.log_dir = root / self.run_id

    # -- plan ---------------------------------------------------------------
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        last: dict[int, pytest.Item] = {}
        self.session = session
        self.order = list(session.items)
        self.index = {item.nodeid: i for i, item in enumerate(self.order)}
        for item in session.items:
            n = world_size_of(item)
            if n is None:
                continue
            self.size_of[item.nodeid] = n
            path = str(item.path)
            files = self.files.setdefault(n, [])
            if path not in files:
                files.append(path)
            if n in last:
                self.next_of[last[n].nodeid] = item.nodeid
            last[n] = item
            self.next_of.setdefault(item.nodeid, None)

    # -- running one test remotely -------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        n = world_size_of(item)
        if n is None:
            return None
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        for rep in self._run(item, n, nextitem):
            ihook.pytest_runtest_logreport(report=rep)
        # The item never set up here; finish what earlier local items left set up.
        item.session._setupstate.teardown_exact(nextitem)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _run(self, item: pytest.Item, n: int, nextitem: pytest.Item | None = None
             ) -> list[Any]:
        from launch import agree

        if n in self.broken:
            return [agree.make_report(item.nodeid, item.location, "setup", "failed", self.broken[n])]
        w = self.worlds.get(n)
        seq = w.ahead.pop(item.nodeid, None) if w is not None else None
        if seq is None:
            if w is None or w.proc.poll() is not None:
                w = self.worlds[n] = self._start(n)
            seq = self._send(w, self._run_of(item, n), nextitem)
        timeout = _timeout(item, self.config.getoption("dist_timeout"))
        allowance = START_ALLOWANCE if w.answered == 0 else 0.0
        with w.lock:  # NOTE: the world may have started it earlier: a later, safe bound
            w.deadline = time.monotonic() + timeout + GRACE + allowance
        got = w.store.multi_get([f"rep/{seq}"] + [f"o/{seq}/{r}" for r in range(n)])
        with w.lock:
            w.deadline = float("inf")
        w.read = seq
        data = json.loads(got[0])
        verdicts = [v.decode() for v in got[1:]]
        dead = "died" in data or ("X" in verdicts and not data.get("fatal"))
        if (dead or data.get("fatal")) and not self._started(w):
            # A rank died before its test loop (importing, joining, collecting):
            # no test ran on every rank, so this is the world's fault, not the test's.
            return self._start_failed(item, n, w, data, nextitem)
        if dead:
            w.ahead.clear()
            end_world(w.proc, w.world_id, GRACE)
            text = self._death_text(w, item, data)
            return [agree.make_report(item.nodeid, item.location, "call", "failed", text)]
        w.answered += 1
        local = [agree.load_report(self.config, d) for d in data["reports"]]
        if data.get("fatal"):  # the world is going down: end it, so the next test gets a new one
            w.ahead.clear()
            end_world(w.proc, w.world_id, GRACE)
            return local
        decision = agree.decide(verdicts, tuple(range(n)))
        return agree.apply(decision, local, item.nodeid, item.location)

    def _start_failed(self, item: pytest.Item, n: int, w: _World, data: dict[str, Any],
                      nextitem: pytest.Item | None) -> list[Any]:
        """End world ``w`` that died while starting; start it once more (then
        ``item`` runs there), else fail ``item`` and every later test of size n."""
        from launch import agree

        w.ahead.clear()
        end_world(w.proc, w.world_id, GRACE)
        text = self._death_text(w, item, data)
        if n not in self.retried:
            self.retried[n] = text
            self.worlds[n] = self._start(n)
            return self._run(item, n, nextitem)
        text = (f"{self.retried[n]}\n\nlaunch: started the {n}-rank world once more; it "
                f"did not start either:\n{text}")
        self.broken[n] = text
        return [agree.make_report(item.nodeid, item.location, "setup", "failed", text)]

    def _run_of(self, item: pytest.Item, n: int) -> list[pytest.Item]:
        """``item`` and the tests right after it that run in the same world."""
        i = self.index.get(item.nodeid)
        if self.one_at_a_time or i is None or self.order[i] is not item:
            return [item]
        run = [item]
        for nxt in self.order[i + 1:i + MAX_AHEAD]:
            if self.size_of.get(nxt.nodeid) != n:
                break
            run.append(nxt)
        return run

    def _send(self, w: _World, items: list[pytest.Item],
              nextitem: pytest.Item | None) -> int:
        """Send ``items`` to world ``w`` as one command; returns the first's seq."""
        first = w.seq + 1
        hints = [it.nodeid for it in items[1:]] + [self._hint(items[-1], nextitem)]
        w.store.set(f"cmd/{first}", json.dumps(
            {"tests": [[it.nodeid, h] for it, h in zip(items, hints, strict=True)]}))
        for k, it in enumerate(items[1:], start=1):
            w.ahead[it.nodeid] = first + k
        w.seq = first + len(items) - 1
        return first

    def _hint(self, item: pytest.Item, nextitem: pytest.Item | None) -> str | None:
        """The test ``item``'s world runs after it: the ranks keep set up what the
        two share (module, class) and tear down the rest after ``item``.

        Plain pytest runs the collection in order: the next test of the size.
        Under pytest-xdist the scheduler deals this process a share of a class
        (any share, in any order), so only the worker's own next test is
        known; when it needs another world, the ranks tear everything down
        (a class set up again later rather than one left set up)."""
        if not self.xdist:
            return self.next_of.get(item.nodeid)
        n = self.size_of.get(item.nodeid)
        if nextitem is not None and n is not None and world_size_of(nextitem) == n:
            return nextitem.nodeid
        return None

    def _started(self, w: _World) -> bool:
        """Whether every rank of ``w`` got to its test loop (joined, collected)."""
        try:
            return bool(w.store.check([f"ready/{r}" for r in range(w.n)]))
        except Exception:
            return False

    def _death_text(self, w: _World, item: pytest.Item, data: dict[str, Any]) -> str:
        why = data.get("died", "died")
        start = f"during {item.nodeid}" if self._started(w) else "while starting (no test ran in it)"
        lines = [f"launch: the {w.n}-rank world {why} {start}",
                 f"logs: {w.log_path} and {self.log_dir}/{w.prefix}-rank<k>.log"]
        # NOTE: each rank logs from its first moment (launch.modes.server), so a rank
        # that died while starting says why here, not only in torchrun's log.
        for r in range(w.n):
            path = self.log_dir / f"{w.prefix}-rank{r}.log"
            errs = sorted(self.log_dir.glob(f"{w.prefix}-std/*/attempt_0/{r}/stderr.log"))
            lines.append(f"--- rank {r} ({path.name}) ---\n{rank_story(path, errs)}")
        lines.append(f"--- last lines of {w.log_path.name} ---\n{tail(w.log_path, 8)}")
        return "\n".join(lines)

    # -- worlds -------------------------------------------------------------------
    def _start(self, n: int) -> _World:
        import torch.distributed as dist

        if self.store is None:
            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(hours=24))
        self.gen += 1
        prefix = f"w{n}g{self.gen}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{prefix}-torchrun.log"
        env = dict(os.environ)
        pkg_root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        world_id = f"{self.run_id}/{prefix}"
        env.update({SERVER_ENV: f"127.0.0.1:{self.store.port}", PREFIX_ENV: prefix,
                    LOG_ENV: str(self.log_dir), "OMP_NUM_THREADS": "1",
                    WORLD_ID_ENV: world_id})
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS"):
            env.pop(k, None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={n}", "--max-restarts=0",
               # each rank's stdout/stderr in a file of its own, from its first moment
               f"--log-dir={self.log_dir / (prefix + '-std')}", "--redirects=3",
               "-m", "pytest",
               *self._pytest_args(n)]
        proc = self._fork(n, prefix, env) if self.session is not None else None
        if proc is not None:
            log_path = proc.log
        else:
            with open(log_path, "w") as log:
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL,
                                        cwd=str(self.config.invocation_params.dir))
        w = _World(n, prefix, dist.PrefixStore(prefix, self.store), proc, log_path, world_id)
        threading.Thread(target=self._monitor, args=(w,), daemon=True).start()
        return w

    def _fork(self, n: int, prefix: str, env: dict[str, str]) -> Any:
        """The world's ranks forked from this process (``launch.modes.forked``),
        or None where that is refused (torchrun then starts them)."""
        from launch.modes import forked

        if forked.fork_refused(self.config) is not None:
            return None
        keys = (SERVER_ENV, PREFIX_ENV, LOG_ENV, WORLD_ID_ENV)
        return forked.start(self.session, n, prefix, self.store.port,
                            {k: env[k] for k in keys}, self.log_dir,
                            self.log_dir / f"{prefix}-world.log")

    def _pytest_args(self, n: int) -> list[str]:
        c = self.config
        args = ["-p", "launch.plugin", "-p", "no:cacheprovider", "-q", f"--rootdir={c.rootpath}",
                f"--dist-timeout={c.getoption('dist_timeout')}",
                f"--dist-seed={c.getoption('dist_seed')}", f"--tb={c.option.tbstyle}",
                "-o", "addopts=", "--import-mode", c.getoption("importmode")]
        if c.inipath:
            args += ["-c", str(c.inipath)]
        if c.getoption("dist_backend"):
            args.append(f"--dist-backend={c.getoption('dist_backend')}")
        for name, flag in (("hypothesis_profile", "--hypothesis-profile"),
                           ("hypothesis_seed", "--hypothesis-seed")):
            val = getattr(c.option, name, None)
            if val is not None:
                args.append(f"{flag}={val}")
        for w in c.getoption("pythonwarnings") or []:
            args += ["-W", w]
        # Plugins loaded with -p on the command line or in addopts (cleared above).
        inv = [*c.getini("addopts"), *c.invocation_params.args]
        for i, a in enumerate(inv):
            name = inv[i + 1] if a == "-p" and i + 1 < len(inv) else a[2:] if a.startswith("-p") and len(a) > 2 else ""
            if name and "xdist" not in name and name != "launch.plugin":
                args += ["-p", name]
        return args + self.files.get(n, [])

    def _monitor(self, w: _World) -> None:
        """Watch one world: when it exits, or outlives a test's deadline, make
        sure the parent's pending ``rep`` key gets an answer."""
        import torch.distributed as dist

        client = dist.PrefixStore(w.prefix, dist.TCPStore(
            "127.0.0.1", self.store.port, is_master=False, timeout=timedelta(seconds=60)))
        why = None
        while why is None:
            try:
                rc = w.proc.wait(timeout=1.0)
                why = f"exited (code {rc})"
            except subprocess.TimeoutExpired:
                with w.lock:
                    late = time.monotonic() > w.deadline
                if late:
                    end_world(w.proc, w.world_id, GRACE)
                    why = "did not answer in time and was killed"
        try:  # answer the parent's pending waits (no-op for tests that were answered)
            for seq in range(w.read + 1, w.seq + 1):
                client.compare_set(f"rep/{seq}", "", json.dumps({"died": why}))
                for r in range(w.n):
                    client.compare_set(f"o/{seq}/{r}", "", "X")
        except Exception:
            pass

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        for w in self.worlds.values():
            if w.proc.poll() is None:
                if w.ahead:  # the session stopped early (^C): do not let it run them
                    end_world(w.proc, w.world_id, GRACE)
                else:
                    w.store.set(f"cmd/{w.seq + 1}", json.dumps({"stop": True}))
        for w in self.worlds.values():
            try:
                w.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            end_world(w.proc, w.world_id, GRACE)  # and any rank that outlived torchrun

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        for n, why in sorted(self.retried.items()):
            if n not in self.broken:
                terminalreporter.write_line(
                    f"launch: a {n}-rank world died while starting and a fresh one was "
                    f"started: {why.splitlines()[0]} ({why.splitlines()[1]})")
        if self.worlds:
            sizes = ", ".join(str(n) for n in sorted(self.worlds))
            terminalreporter.write_line(f"launch: worlds of {sizes} ranks; logs in {self.log_dir}")

    def run(self, item: pytest.Item, n: int | None) -> list[Any]:
        """``launch.world.Mode.run``: in this process when the item has no
        world size, else on the launched world of its size."""
        n = n or world_size_of(item)
        if n is None:
            from _pytest.runner import runtestprotocol

            return runtestprotocol(item, log=False, nextitem=item.parent)
        return self._run(item, n)

    def world_for(self, n: int | None) -> World:
        return LOCAL_WORLD  # a world_size test never runs here; unmarked ones see one process


def _timeout(item: pytest.Item, default: float) -> float:
    from launch.world import timeout_of

    return timeout_of(item, default)
