"""Lockstep mode: this process is one rank of ``torchrun -m pytest``.

Every rank collects and runs the same tests in the same order and agrees on
every outcome; rank 0 prints the report, rank k logs to
``<log dir>/rank<k>.log``. Under torchrun's ``--max-restarts`` (what
``python -m launch`` sets) a world killed by a hang or a dead rank is restarted
and continues after the bad test: rank 0 keeps agreed results in
``results.jsonl`` in the run folder and replays them in the next attempt.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from launch import agree
from launch.hypo.lockstep import RUN_NPROC_ENV
from launch.modes.resume import nodes_text, resume_command
from launch.rank.core import (
    LONG,
    RankCore,
    drop_junitxml,
    init_process_group,
    redirect_terminal,
)
from launch.world import world_size_of

STATUS_ENV = "LAUNCH_STATUS_FILE"  # set by `python -m launch`: exit 0, status here
RUN_DIR_ENV = "LAUNCH_RUN_DIR"


class Lockstep:
    name = "lockstep"  # launch.world.Mode
    ranks_here = True  # this process is a rank

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        env = os.environ
        self.attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.max_restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", 0))
        self.managed = env.get(STATUS_ENV)
        self.recover = bool(self.managed) or self.max_restarts > 0  # keep results.jsonl
        self.rank = int(env["RANK"])
        self.size = int(env["WORLD_SIZE"])
        # NOTE: the run's layout, read once: a sub-world swaps RANK/WORLD_SIZE/
        # LOCAL_WORLD_SIZE while its test runs, and a report written from the
        # watchdog thread then must still name the run's own world.
        self.local = int(env.get("LOCAL_WORLD_SIZE", self.size))
        env[RUN_NPROC_ENV] = str(self.local)  # for replay lines written inside sub-worlds
        self.run_dir = _run_dir(config)
        self.session: pytest.Session | None = None
        self.index: dict[str, int] = {}
        self.resume = 0
        self.fatal = False
        self.finished = False
        self.current = 0  # index of the test running (or next to run)
        self.runs = 0  # run() calls (each one's store key)

    # -- configure / session start ---------------------------------------
    def pytest_configure(self, config: pytest.Config) -> None:
        done = self.run_dir / "complete"
        if self.attempt > 0 and done.exists() and not self.managed:
            # An earlier attempt finished (torchrun restarts a world whose rank 0
            # exited non-zero); end with its status.
            os._exit(int(done.read_text() or 1) if self.rank == 0 else 0)
        self.backend = init_process_group(config)
        prefix = f"launch/a{self.attempt}/"
        default = _get_default_store()
        store = dist.PrefixStore(prefix, default)
        side = dist.PrefixStore(prefix, default.clone())  # own connection, same keys
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(self.run_dir / f"rank{self.rank}.log", "a", buffering=1)
        print(f"===== attempt {self.attempt}, pid {os.getpid()} =====", file=self.log)
        self.core = RankCore(config, store, side, self.log, self._on_fatal, prefix)
        if self.rank != 0:
            drop_junitxml(config)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.session = session
        if self.rank != 0:
            redirect_terminal(self.config, self.log)
            cache = getattr(self.config, "cache", None)
            if cache is not None:
                cache.set = lambda key, value: None  # rank 0 writes the cache
        self.core.start()

    def pytest_report_header(self) -> list[str]:
        return [f"launch: lockstep, {self.size} ranks ({self.backend}), "
                f"{nodes_text(self.local, self.size)}attempt "
                f"{self.attempt}; rank logs: {self.run_dir}/rank<k>.log"]

    # -- collection agreement ---------------------------------------------
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            n = world_size_of(item)
            if n is not None and n > self.size:
                item.add_marker(pytest.mark.skip(
                    reason=f"needs world_size({n}); this world has {self.size} ranks"))

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        ids = [i.nodeid for i in session.items]
        self.index = {nid: k for k, nid in enumerate(ids)}
        st = self.core.store
        msg = self.core.agree_collection(ids)
        if msg is not None:
            print(msg, file=self.log, flush=True)
            self._barrier("collect")
            pytest.exit(msg, returncode=pytest.ExitCode.USAGE_ERROR)
        if self.rank == 0:
            self.resume = self._prepare_resume(ids)
            st.set("resume", str(self.resume))
        else:
            self.resume = int(st.get("resume"))

    # -- the test loop ------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        errors = self.core.collection_errors(session.testsfailed)  # on any rank: all stop
        if errors and not session.config.option.continue_on_collection_errors:
            raise session.Interrupted(errors)
        if session.config.option.collectonly:
            return True
        if self.rank == 0 and self.resume:
            self._replay(session)
        items = session.items
        for i in range(self.resume, len(items)):
            item = items[i]
            nextitem = items[i + 1] if i + 1 < len(items) else None
            self.current = i
            self._protocol(item, nextitem, i)
            self.current = i + 1
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
        return True

    def _protocol(self, item: pytest.Item, nextitem: pytest.Item | None, i: int) -> None:
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        reports = self._run(item, world_size_of(item), nextitem, str(i))
        for rep in reports:
            ihook.pytest_runtest_logreport(report=rep)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        if self.rank == 0 and self.recover:
            self._record(i, item.nodeid, reports)

    def pytest_runtest_protocol(self, item: pytest.Item) -> bool:
        return True  # our runtestloop runs items; never the default protocol

    # -- end of session -----------------------------------------------------
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.rank == 0 and self.size > 1:
            local = self.local
            terminalreporter.write_line(
                f"launch: ranks 1..{min(local, self.size) - 1} logged to {self.run_dir}/rank<k>.log"
                if local >= self.size else
                f"launch: ranks 1..{local - 1} logged to {self.run_dir}/rank<k>.log; the other "
                f"nodes' ranks to {self.run_dir.name.split('-node')[0]}-node<n>-*/ on their hosts")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self) -> None:
        self.finished = True

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self.fatal:
            return
        status = int(self.session.exitstatus) if self.session is not None else 1
        self._barrier("exit")
        if self.rank != 0 and self.session is not None:
            # NOTE: outcomes are agreed, so rank 0's status is the run's. A rank
            # that exits non-zero first makes torchrun SIGTERM the others while
            # they finalize (and print a ChildFailedError per rank); exiting 0
            # here leaves rank 0's status the only one that counts.
            self.session.exitstatus = 0
        if self.rank == 0 and self.recover:
            (self.run_dir / "complete").write_text(str(status))
        if self.managed and self.rank == 0:
            Path(self.managed).write_text(str(status))
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        # NOTE: after every test passed, interpreter teardown still aborted
        # about one 4-rank run in three ("terminate called without an active
        # exception": a c10d background thread outlived its owner), and the
        # SIGABRT failed the whole torchrun. Outcomes are agreed and every
        # report is written by now, so leave without that teardown.
        for stream in (sys.stdout, sys.stderr, self.log):
            try:
                stream.flush()
            except Exception:
                pass
        code = 0 if self.managed or self.rank != 0 else status
        self._leave_last_if_failing(code)
        os._exit(code)

    def _leave_last_if_failing(self, code: int) -> None:
        """Rank 0 leaving with a failing status leaves after every other rank.

        torchrun stops the other ranks (SIGTERM, a stack dump in their logs)
        as soon as one exits non-zero; rank 0 leaving first caught peers still
        inside ``destroy_process_group``."""
        st = self.core.store
        try:
            if self.rank != 0:
                st.set(f"gone/{self.rank}", "1")
            elif code != 0:
                st.wait([f"gone/{r}" for r in range(1, self.size)], timedelta(seconds=60))
        except Exception:  # a store that is gone: nobody is left to wait for
            pass

    def _barrier(self, name: str) -> None:
        st = self.core.store
        st.set(f"{name}/{self.rank}", "1")
        st.wait([f"{name}/{r}" for r in range(self.size)], LONG)

    # -- faults and recovery ------------------------------------------------
    def _on_fatal(self, key: str | None, item: Any, text: str) -> int:
        """Rank 0, watchdog thread: log the failure; finish or let torchrun restart."""
        self.fatal = True
        config, session = self.config, self.session
        if self.finished:  # a peer died after the report was written
            return int(session.exitstatus) if session is not None else 1
        capman = config.pluginmanager.get_plugin("capturemanager")
        if capman is not None:
            try:
                capman.suspend_global_capture(in_=True)
            except Exception:
                pass
        tr = config.pluginmanager.get_plugin("terminalreporter")
        if self.core.watchdog.interrupted:
            return self._interrupted(key, item, text, tr)
        if item is not None:
            rep = agree.make_report(item.nodeid, item.location, "call", "failed", text)
            item.ihook.pytest_runtest_logreport(report=rep)
            item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
            if self.recover:
                self._record(int(key), item.nodeid, [rep], fatal=True)
        elif tr is not None:
            tr.write_line(text)
        if self.recover and self.attempt < self.max_restarts:
            if tr is not None:
                tr.write_line(f"\nlaunch: world unusable; torchrun restarts it and the run "
                              f"continues after {item.nodeid if item else 'this point'}")
            return 1
        if session is not None:
            first = int(key) + 1 if key is not None else self.current
            self._not_run(session, tr, session.items[first:],
                          item.nodeid if item is not None else None)
        if session is not None:
            session.shouldfail = "world unusable"
            config.hook.pytest_sessionfinish(session=session, exitstatus=1)
        if self.managed:
            Path(self.managed).write_text("1")
            if self.recover:
                (self.run_dir / "complete").write_text("1")
        return 1

    def _interrupted(self, key: str | None, item: Any, text: str, tr: Any) -> int:
        """torchrun was stopped (SIGTERM, Ctrl-C): not a fault. The running test
        is reported as not run, then the summary, junit, and the command that
        continues with it; torchrun is going down, so nothing restarts."""
        session, config = self.session, self.config
        signame = self.core.watchdog.interrupted
        why = f"not run (interrupted): torchrun got {signame} while this test ran"
        if item is not None:
            rep = agree.make_report(item.nodeid, item.location, "setup", "skipped",
                                    (str(item.path), 0, why))
            item.ihook.pytest_runtest_logreport(report=rep)
            item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        if session is None:
            return int(pytest.ExitCode.INTERRUPTED)
        i = int(key) if key is not None else self.current
        ran, left = session.items[:i], session.items[i:]
        if tr is not None:
            head = text.splitlines()[0] if text else ""
            during = head[head.index(" during "):] if " during " in head else ""
            tr.write_line(f"\nlaunch: interrupted ({signame} to torchrun){during}")
            tr.write_line(f"launch: interrupted ({signame}): {len(ran)} of "
                          f"{len(session.items)} tests ran; {len(left)} not run"
                          + (f", starting with {left[0].nodeid}" if left else ""))
            cmd = resume_command(config, ran[-1].nodeid if ran else None, self.local, self.size)
            tr.write_line(f"launch: continue with:\n  {cmd}")
            try:  # pytest's own "!!! Interrupted !!!" line needs a raised exception
                raise session.Interrupted(f"launch: interrupted by {signame} to torchrun")
            except session.Interrupted:
                tr.pytest_keyboard_interrupt(pytest.ExceptionInfo.from_current())
        code = int(pytest.ExitCode.INTERRUPTED)
        session.exitstatus = code
        config.hook.pytest_sessionfinish(session=session, exitstatus=code)
        if self.managed:
            Path(self.managed).write_text(str(code))
            if self.recover:
                (self.run_dir / "complete").write_text(str(code))
        return code

    def _not_run(self, session: pytest.Session, tr: Any, left: list[pytest.Item],
                  bad: str | None) -> None:
        """Report every test the dead world did not run (terminal and junit:
        each is logged as skipped with the reason) and the resume command."""
        if not left:
            return
        why = (f"launch: not run: the world became unusable at {bad or 'a point between tests'}"
               " (no restarts left)")
        for it in left:
            it.ihook.pytest_runtest_logstart(nodeid=it.nodeid, location=it.location)
            rep = agree.make_report(it.nodeid, it.location, "setup", "skipped",
                                    (str(it.path), 0, why))
            it.ihook.pytest_runtest_logreport(report=rep)
            it.ihook.pytest_runtest_logfinish(nodeid=it.nodeid, location=it.location)
        if tr is None:
            return
        tr.write_line(f"\nlaunch: {len(left)} tests not run: the world is unusable "
                      "(no restarts left):")
        for it in left:
            tr.write_line(f"  {it.nodeid}")
        after = bad or (session.items[self.current - 1].nodeid if self.current else None)
        if after is not None:
            tr.write_line(f"launch: resume after {after} with:\n  {resume_command(self.config, after, self.local, self.size)}")
        tr.write_line("  (or `python -m launch`, which restarts the world by itself)")

    def _record(self, i: int, nodeid: str, reports: list[Any], fatal: bool = False) -> None:
        data = [agree.dump_report(self.config, r) for r in reports]
        with open(self.run_dir / "results.jsonl", "a") as f:
            f.write(json.dumps({"i": i, "id": nodeid, "reports": data, "fatal": fatal}) + "\n")

    def _prepare_resume(self, ids: list[str]) -> int:
        path = self.run_dir / "results.jsonl"
        if self.attempt == 0:
            path.unlink(missing_ok=True)
            (self.run_dir / "complete").unlink(missing_ok=True)
            return 0
        done = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        done = [d for d in done if d["i"] < len(ids) and ids[d["i"]] == d["id"]]
        nxt = max((d["i"] for d in done), default=-1) + 1
        reported = bool(done) and done[-1]["fatal"]
        if nxt < len(ids) and not reported:
            # The previous world died during ids[nxt] without any rank reporting.
            nodeid = ids[nxt]
            item = self.session.items[nxt]
            rep = agree.make_report(nodeid, item.location, "call", "failed",
                                    f"launch: the world died during {nodeid} in attempt "
                                    f"{self.attempt - 1} and no rank could report; "
                                    f"see {self.run_dir}/rank<k>.log")
            self._record(nxt, nodeid, [rep], fatal=True)
            nxt += 1
        self._replay_from = path
        return nxt

    def _replay(self, session: pytest.Session) -> None:
        for line in self._replay_from.read_text().splitlines():
            d = json.loads(line)
            if d["i"] >= self.resume:
                continue
            item = session.items[d["i"]]
            item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
            for data in d["reports"]:
                rep = agree.load_report(self.config, data)
                item.ihook.pytest_runtest_logreport(report=rep)
            item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)

    def world_for(self, n: int | None) -> Any:
        return self.core.world_for(n)

    @property
    def store(self) -> Any:
        return self.core.store

    def run(self, item: pytest.Item, n: int | None) -> list[Any]:
        """``launch.world.Mode.run``: on ranks ``0..n-1`` (a sub-world when
        n is smaller than the world), every rank agreeing."""
        self.runs += 1
        return self._run(item, n, item.parent, f"run{self.runs}")

    def _run(self, item: pytest.Item, n: int | None, nextitem: pytest.Item | None,
             key: str) -> list[Any]:
        return self.core.run(item, item.nodeid, nextitem, key, min(n or self.size, self.size))


def _run_dir(config: pytest.Config) -> Path:
    if os.environ.get(RUN_DIR_ENV):
        return Path(os.environ[RUN_DIR_ENV])
    root = Path(config.getoption("dist_log_dir") or Path(config.rootpath) / ".launch-logs")
    env = os.environ
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    # Per node: each node's ranks log beside their own torchrun agent.
    local, world = int(env.get("LOCAL_WORLD_SIZE", 1)), int(env.get("WORLD_SIZE", 1))
    node = f"-node{env.get('GROUP_RANK', 0)}" if world > local else ""
    return root / f"torchrun-{run_id}{node}-{os.getppid()}"

