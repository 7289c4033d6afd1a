"""Server mode: this process is one rank of a world that a parent pytest
launched (``launch.modes.parent``). It collects the test files the parent named,
then runs the tests the parent sends, in lockstep with its peers.

Protocol (keys under the world's prefix in the parent's store): tests are
numbered 1, 2, ... per world. ``cmd/<k>`` = ``{"tests": [[id, next id], ...]}``
(tests k, k+1, ...; the next command is ``cmd/<k + len>``) or ``{"stop":
true}``; ``o/<seq>/<rank>`` = each rank's verdict (``launch.agree``);
``rep/<seq>`` = rank 0's own reports, serialized with
``pytest_report_to_serializable``. The ranks agree on each test among
themselves (one ``set``, one ``multi_get``) before the next one; the parent
agrees from the same verdicts. After a fatal fault rank 0 overwrites
``rep/<seq>`` with the fault report and fills missing verdicts with ``"X"``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from launch import agree
from launch.rank.core import (
    LONG,
    RankCore,
    drop_junitxml,
    init_process_group,
    redirect_terminal,
    store_client,
)
from launch.world import LOG_ENV, PREFIX_ENV, SERVER_ENV


class Server:
    name = "server"  # launch.world.Mode
    ranks_here = True  # this process is a rank
    store: Any = None  # the parent's store under this world's prefix (once configured)
    runs = 0  # run() calls (each one's store key)

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.items: dict[str, pytest.Item] = {}
        self.seq = 0
        self.done = 0  # the last test agreed on here
        self.planned: dict[int, str] = {}  # seq -> node id, for the tests sent and not done

    def pytest_configure(self, config: pytest.Config) -> None:
        # NOTE: the log opens first, with stack dumps on a fatal signal and on
        # SIGTERM (torchrun's, when a peer died), so a rank that dies while
        # joining or collecting leaves where it was (the parent quotes it).
        prefix = os.environ[PREFIX_ENV]
        rank = int(os.environ.get("RANK", "0"))
        log_dir = Path(os.environ[LOG_ENV])
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(log_dir / f"{prefix}-rank{rank}.log", "a", buffering=1)
        faulthandler.enable(file=self.log, all_threads=True)
        faulthandler.register(signal.SIGTERM, file=self.log, all_threads=True, chain=True)
        print(f"launch: rank {rank} of world {prefix}, pid {os.getpid()}: joining",
              file=self.log)
        init_process_group(config)
        host, port = os.environ[SERVER_ENV].rsplit(":", 1)
        self.store = store_client(host, int(port), prefix)
        side = store_client(host, int(port), prefix)
        print("launch: joined the process group; collecting", file=self.log)
        self.core = RankCore(config, self.store, side, self.log, self._on_fatal)
        self.core.watchdog.pending = self._pending
        drop_junitxml(config)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        redirect_terminal(self.config, self.log)
        self.core.start()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        # NOTE: no collection agreement here: the parent's ids are the reference;
        # a rank that lacks one fails that test ("not collected on rank k").
        self.items = {i.nodeid: i for i in session.items}

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        self.store.set(f"ready/{self.core.rank}", "1")  # started: deaths now are tests'
        # No rank runs a test before every rank collected: a rank that dies in
        # the world's first test while a peer still collects would otherwise
        # read as a world that never started (the parent starts it once more,
        # then fails every later test of that size).
        self.store.wait([f"ready/{r}" for r in range(self.core.size)], LONG)
        while True:
            cmd = json.loads(self.store.get(f"cmd/{self.seq + 1}"))
            if cmd.get("stop"):
                break
            for j, (nodeid, _) in enumerate(cmd["tests"], start=self.seq + 1):
                self.planned[j] = nodeid
            for nodeid, nxt in cmd["tests"]:
                self.seq += 1
                self._one(nodeid, nxt, self.seq)
        return True

    def _pending(self) -> tuple[str, pytest.Item | None] | None:
        """(key, item) of the test this rank runs next, if the parent sent it
        (the watchdog thread calls this, so it reads through its own store)."""
        k = self.done + 1
        nodeid = self.planned.get(k)
        if nodeid is None:
            side = self.core.watchdog.store
            if not side.check([f"cmd/{k}"]):
                return None
            tests = json.loads(side.get(f"cmd/{k}")).get("tests")
            if not tests:
                return None
            nodeid = tests[0][0]
        return str(k), self.items.get(nodeid)

    def _one(self, nodeid: str, nxt: str | None, seq: int) -> None:
        item = self.items.get(nodeid)
        nextitem = self.items.get(nxt or "")
        if item is not None:
            item.ihook.pytest_runtest_logstart(nodeid=nodeid, location=item.location)
        # Rank 0 ships its own reports as soon as it posted its verdict; the
        # parent agrees from the verdicts by itself.
        publish = (lambda reps: self._send(self.store, seq, reps)) if self.core.rank == 0 else None
        reports = self.core.run(item, nodeid, nextitem, str(seq), self.core.size, publish)
        self.done = seq
        self.planned.pop(seq, None)
        if item is not None:
            for rep in reports:
                item.ihook.pytest_runtest_logreport(report=rep)
            item.ihook.pytest_runtest_logfinish(nodeid=nodeid, location=item.location)

    def _send(self, store: Any, seq: int, reports: list[Any], fatal: bool = False) -> None:
        data = [agree.dump_report(self.config, r) for r in reports]
        value = json.dumps({"reports": data, "fatal": fatal})
        if fatal:
            store.set(f"rep/{seq}", value)
        else:
            # The watchdog may have written the fault report already (a peer
            # died while this test was still finishing here): it stays.
            store.compare_set(f"rep/{seq}", "", value)

    def _on_fatal(self, key: str | None, item: Any, text: str) -> int:
        if key is not None:
            nodeid = item.nodeid if item is not None else "?"
            location = item.location if item is not None else (nodeid, None, nodeid)
            side = self.core.watchdog.store
            self._send(side, int(key), [agree.make_report(nodeid, location, "call", "failed", text)],
                       fatal=True)
            for r in range(self.core.size):  # release the parent's wait on verdicts
                side.compare_set(f"o/{key}/{r}", "", "X")
        return 1

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        st = self.store
        st.set(f"exit/{self.core.rank}", "1")
        st.wait([f"exit/{r}" for r in range(self.core.size)], LONG)
        session.exitstatus = 0  # outcomes travel to the parent, not via exit codes
        try:
            dist.destroy_process_group()
        except Exception:
            pass

    def world_for(self, n: int | None) -> Any:
        return self.core.world_for(n)

    def run(self, item: pytest.Item, n: int | None) -> list[Any]:
        """``launch.world.Mode.run`` on this world's ranks (the test loop runs
        the parent's tests through ``RankCore.run`` under the parent's keys)."""
        self.runs += 1
        size = min(n or self.core.size, self.core.size)
        return self.core.run(item, item.nodeid, item.parent, f"run{self.runs}", size)
