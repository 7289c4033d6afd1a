"""What every rank process does, in lockstep and server mode alike: join the
process group, keep a log, run one test and agree on its outcome.

Agreement goes over the c10d store, never the process group (a failed test
may have left the group mid-collective): each rank sets one key with its
verdict and reads all ranks' keys with one ``multi_get``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _pytest.runner import runtestprotocol

from launch import agree
from launch.rank.subworld import SubWorld, create
from launch.rank.watchdog import Watchdog
from launch.world import World, timeout_of

LONG = timedelta(hours=24)  # store waits; the watchdog bounds them


def init_process_group(config: pytest.Config) -> str:
    """Join the default group from the torchrun env; returns the backend."""
    torch.set_num_threads(1)
    backend = config.getoption("dist_backend")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if backend is None:
        # NOTE: a GPU host still runs CPU-tensor tests (most property suites):
        # NCCL alone rejects CPU tensors, so CPU collectives go to Gloo.
        gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
        backend = "cpu:gloo,cuda:nccl" if gpus else "gloo"
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if dist.is_initialized():
        return backend
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # NOTE: torchrun keeps one agent store across --max-restarts attempts, and
        # init_process_group's keys from a dead attempt (peer addresses, barrier
        # counts) poison the next one (connection refused / hangs). A prefix per
        # attempt keeps each world's keys apart.
        raw = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                            timeout=timedelta(minutes=30))
        store = dist.PrefixStore(f"attempt{env.get('TORCHELASTIC_RESTART_COUNT', 0)}/", raw)
        dist.init_process_group(backend, store=store, rank=int(env["RANK"]),
                                world_size=int(env["WORLD_SIZE"]))
    else:
        dist.init_process_group(backend)
    return backend


def _accelerator_initialized() -> bool:
    """Whether any torch accelerator has initialised (it then has generators
    that ``torch.manual_seed`` must reseed)."""
    for name in ("cuda", "xpu", "mtia"):
        is_init = getattr(getattr(torch, name, None), "is_initialized", None)
        if is_init is not None and is_init():
            return True
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def store_client(host: str, port: int, prefix: str, timeout: timedelta = LONG) -> Any:
    raw = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return dist.PrefixStore(prefix, raw)


def redirect_terminal(config: pytest.Config, log: Any) -> None:
    """Send this rank's pytest terminal output to ``log``."""
    from _pytest.config import create_terminal_writer

    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr._tw = create_terminal_writer(config, log)
    config.option.color = "no"


def drop_junitxml(config: pytest.Config) -> None:
    """Only rank 0 of a lockstep run (or the parent) writes ``--junitxml``."""
    from _pytest.junitxml import xml_key

    config.option.xmlpath = None
    xml = config.stash.get(xml_key, None)
    if xml is not None:
        del config.stash[xml_key]
        config.pluginmanager.unregister(xml)


class RankCore:
    """One rank: its stores, log, watchdog and per-test agreement."""

    def __init__(self, config: pytest.Config, store: Any, side_store: Any,
                 log: Any, on_fatal: Any, prefix: str = "launch/") -> None:
        self.config = config
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.store, self.log = store, log
        self.seed = config.getoption("dist_seed")
        self.default_timeout = config.getoption("dist_timeout")
        self.watchdog = Watchdog(self.rank, self.size, side_store, log, on_fatal)
        self.prefix = prefix  # keeps sub-worlds' store keys apart per attempt
        self._subworlds: dict[int, SubWorld] = {}

    def start(self) -> None:
        import faulthandler

        faulthandler.enable(file=self.log, all_threads=True)
        torch.manual_seed(self.seed)  # also queued for accelerators not yet initialised
        self.watchdog.start()

    def _seed(self) -> None:
        """Seed Python and torch identically on every rank, before every test."""
        random.seed(self.seed)
        # NOTE: torch.manual_seed records a Python stack per accelerator that is
        # not initialised yet (its lazy-seed queue): ~0.3 ms per test on CPU.
        # The seed is the same for every test, so the queue filled by start()
        # already seeds such an accelerator correctly when a test initialises it.
        if _accelerator_initialized():
            torch.manual_seed(self.seed)
        else:
            torch.default_generator.manual_seed(self.seed)

    def world_for(self, n: int | None) -> World:
        """The test's world, as the test sees it (inside a sub-world, its own)."""
        if not dist.is_initialized():
            return World(0, 1, (0,), None)
        size = dist.get_world_size()
        return World(dist.get_rank(), size, tuple(range(size)), dist.group.WORLD)

    def _subworld(self, n: int) -> SubWorld:
        sub = self._subworlds.get(n)
        if sub is None:
            sub = self._subworlds[n] = create(n, self.prefix)
        return sub

    def run(self, item: pytest.Item | None, nodeid: str, nextitem: pytest.Item | None,
            key: str, n: int, publish: Any = None) -> list[Any]:
        """Run ``item`` on members (ranks < n), agree, return the reports to log.

        ``publish(reports)``, if given, gets this rank's own reports as soon as
        its verdict is posted (server mode: the parent agrees in parallel)."""
        member = self.rank < n
        timeout = timeout_of(item, self.default_timeout) if item is not None else self.default_timeout
        self.watchdog.arm(key, item, timeout)
        reports: list[Any] = []
        if item is None:
            mine = agree.missing_verdict(self.rank, nodeid)
        elif member and n < self.size:
            self._seed()
            try:
                sub = self._subworld(n)
            except Exception as e:
                item.session._setupstate.teardown_exact(nextitem)
                mine = agree.error_verdict("setup", f"launch: could not make the {n}-rank "
                                           f"sub-world on rank {self.rank}: {e!r}")
            else:
                with sub.entered():
                    reports = runtestprotocol(item, nextitem=nextitem, log=False)
                mine = agree.verdict(reports)
        elif member:
            self._seed()
            reports = runtestprotocol(item, nextitem=nextitem, log=False)
            mine = agree.verdict(reports)
        else:
            item.session._setupstate.teardown_exact(nextitem)
            mine = "-"
        st = self.store
        st.set(f"o/{key}/{self.rank}", mine)
        if agree.failed(mine):
            st.compare_set(f"failed/{key}", "", str(self.rank))  # the peers' watchdogs look
        self.watchdog.agreeing()
        if publish is not None:
            publish(reports)
        got = st.multi_get([f"o/{key}/{r}" for r in range(self.size)])
        self.watchdog.disarm()
        if mine == "P" and all(v == b"P" for v in got):
            return reports
        verdicts = [v.decode() for v in got]
        location = item.location if item is not None else (nodeid.split("::")[0], None, nodeid)
        if not member:
            if item is not None and any(agree.failed(v) for v in verdicts[:n]):
                count_failure(item.session)
            return [agree.make_report(nodeid, location, "setup", "skipped",
                                      (location[0], 0, f"Skipped: rank {self.rank} is not in "
                                       f"the {n}-rank sub-world of this test"))]
        decision = agree.decide(verdicts, tuple(range(n)))
        return agree.apply(decision, reports, nodeid, location)

    def collection_errors(self, errors: int) -> str | None:
        """None when no rank had a collection error, else the reason every
        rank stops with (an error in a module with no test on any rank leaves
        the ids equal; the rank with it would stop alone)."""
        st = self.store
        st.set(f"collerr/{self.rank}", str(errors))
        errs = [int(v) for v in st.multi_get([f"collerr/{r}" for r in range(self.size)])]
        bad = [r for r, e in enumerate(errs) if e]
        if not bad:
            return None
        return (f"{max(errs)} errors during collection on rank{'s' if len(bad) > 1 else ''} "
                f"{', '.join(map(str, bad))}")

    def agree_collection(self, ids: list[str]) -> str | None:
        """Compare the ordered test ids of every rank (one set, one multi_get);
        None when they match, else a message naming the first differences."""
        st = self.store
        digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()
        st.set(f"coll/{self.rank}", digest)
        digests = st.multi_get([f"coll/{r}" for r in range(self.size)])
        if len(set(digests)) == 1:
            return None
        st.set(f"ids/{self.rank}", json.dumps(ids))
        all_ids = [json.loads(v) for v in st.multi_get([f"ids/{r}" for r in range(self.size)])]
        return collection_mismatch(all_ids)


def count_failure(session: pytest.Session) -> None:
    """Count a failure that this rank logs as a skip (it is outside the
    test's sub-world) as pytest counts a failed report, so that ``-x`` and
    ``--maxfail`` stop every rank after the same test."""
    session.testsfailed += 1
    maxfail = session.config.getvalue("maxfail")
    if maxfail and session.testsfailed >= maxfail:
        session.shouldfail = f"stopping after {session.testsfailed} failures"


def collection_mismatch(all_ids: list[list[str]]) -> str:
    """The report of ranks whose ordered test ids differ."""
    lines = ["launch: ranks collected different tests; no test was run."]
    base = all_ids[0]
    for r, ids in enumerate(all_ids[1:], start=1):
        if ids == base:
            continue
        k = next((j for j, (a, b) in enumerate(zip(base, ids, strict=False)) if a != b),
                 min(len(base), len(ids)))
        a = base[k] if k < len(base) else "(end of list)"
        b = ids[k] if k < len(ids) else "(end of list)"
        lines.append(f"  first difference at test #{k}: rank 0 has {a}, rank {r} has {b} "
                     f"({len(base)} vs {len(ids)} tests)")
    lines.append("Collection must not depend on the rank (check parametrize and skipif).")
    return "\n".join(lines)
