"""The fuzzing loop on every rank (a pytest plugin: ``-p launch.fuzz.rank``).

Active only under ``python -m launch fuzz`` (``LAUNCH_FUZZ_DIR`` set) in
lockstep mode (torchrun), or, with ``--sim N``, in one process under the
simulated mode (``pytest --dist-sim``; see ``_SimWorld`` below). It
replaces the lockstep mode's test loop: rank 0 asks the scheduler for a
slice (a property and a number of examples) and posts it on the c10d
store; every rank runs that property for that many
examples through the lockstep mode's own ``RankCore.run`` (hang watchdog,
sub-worlds for ``world_size(n)`` tests, agreed verdicts) with the lockstep
Hypothesis plugin drawing the same examples everywhere, a fresh shared seed
per slice, and the session's example database (rank 0 reads and writes it).
After each slice rank 0 folds the probe's findings into the session state
(``state.json``), which the launcher shows live and turns into the report.

A failure or a broken world ends the slice; a world that cannot go on ends
this loop, and the launcher starts a fresh world that continues from the
state.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from launch.fuzz.nodedb import per_node
from launch.fuzz.probe import ArcTracer, Probe, classify
from launch.fuzz.replay import from_lockstep
from launch.fuzz.scheduler import Scheduler
from launch.fuzz.session import Session, parse_failure
from launch.hypo import engine
from launch.plugin import mode_of

DIR_ENV = "LAUNCH_FUZZ_DIR"  # the session folder (state.json, inflight.json)
DEADLINE_ENV = "LAUNCH_FUZZ_DEADLINE"  # epoch seconds: no slice starts after it
DB_ENV = "LAUNCH_FUZZ_DB"  # the example database directory
SLICE_ENV = "LAUNCH_FUZZ_SLICE"  # seconds per slice
COVER_ENV = "LAUNCH_FUZZ_COVER"  # package whose lines count as coverage
START_ENV = "LAUNCH_FUZZ_START"  # epoch seconds: this session's start
SIM_ENV = "LAUNCH_FUZZ_SIM"  # ranks of the simulated world (--sim N); unset under torchrun


CHECK_ENV = "LAUNCH_FUZZ_CHECK"  # the launcher's check before a session: count only


def pytest_collection_finish(session: pytest.Session) -> None:
    if os.environ.get(CHECK_ENV):
        n = sum(engine.given_function(it) is not None for it in session.items)
        print(f"\nlaunch fuzz: {n} @given tests of {len(session.items)}", flush=True)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(DIR_ENV):
        config.pluginmanager.register(_Loader(), "launch-fuzz-loader")


class _Loader:
    # NOTE: our loop must be registered after the lockstep mode (registered in
    # launch.plugin's pytest_configure): among tryfirst hooks the later
    # registered runs first.
    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        config.pluginmanager.register(FuzzLoop(config), "launch-fuzz-loop")


class FuzzLoop:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.dir = Path(os.environ[DIR_ENV])
        self.deadline = float(os.environ.get(DEADLINE_ENV, time.time() + 60))
        self.slice_s = float(os.environ.get(SLICE_ENV, 8))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        mode = mode_of(self.config)
        sim_n = int(os.environ.get(SIM_ENV) or 0)
        if mode is None or mode.name != ("simulated" if sim_n else "lockstep"):
            raise pytest.UsageError(
                "launch fuzz: run the ranks under torchrun, or with "
                f"{SIM_ENV} under pytest --dist-sim (python -m launch fuzz [--sim N] does); "
                f"got mode {getattr(mode, 'name', None)}")
        if session.config.option.collectonly:
            return True
        from hypothesis.database import DirectoryBasedExampleDatabase

        if sim_n:
            self.mode, self.rank, self.size = mode, 0, sim_n
            self.store, self.world = None, _SimWorld(sim_n)
        else:
            import torch.distributed as dist

            self.mode, self.rank, self.size = mode, dist.get_rank(), dist.get_world_size()
            self.store, self.world = dist.PrefixStore("fuzz/", mode.store), None
        self.db_path = os.environ.get(DB_ENV, str(self.dir / "db"))
        self.db = DirectoryBasedExampleDatabase(self.db_path)
        items = [it for it in session.items if engine.given_function(it) is not None]
        self.by_id = {it.nodeid: it for it in items}
        tracer = None
        if self.rank == 0:
            root = _package_dir(os.environ.get(COVER_ENV, "dtensor"))
            tracer = ArcTracer(root) if root else None
        self.probe = Probe(self.rank, self.dir, tracer,
                           rank_now=self.world.rank_now if self.world else None,
                           classes=self._classes)
        if self.rank == 0:
            self.state = Session.read(self.dir / "state.json") or Session()
            self.sched = Scheduler(list(self.by_id), slice_seconds=self.slice_s)
            self.sched.load(self.state.props)
            if self.world is not None:
                self.world.skip_too_big(items, self.sched)
            self.known = {f: {tuple(a) for a in arcs} for f, arcs in self.state.arcs.items()}
            self.t0 = float(os.environ.get(START_ENV, time.time() - self.state.elapsed))
        k = 0
        while True:
            plan = self._plan(k)
            if plan is None:
                break
            nodeid, n = plan
            keep_going = self._slice(k, self.by_id[nodeid], n)
            k += 1
            if not keep_going:
                break
        return True

    def _classes(self, values: list[tuple[str, Any]], op: str) -> dict[str, str]:
        """The project's input classes (``pytest_launch_classify``), else ours."""
        got = self.config.hook.pytest_launch_classify(config=self.config, values=values, op=op)
        return got if got is not None else classify(values, op)

    # -- one decision, made by rank 0 -------------------------------------------
    def _plan(self, k: int) -> tuple[str, int] | None:
        key = f"plan/{k}"
        if self.rank == 0:
            left = self.deadline - time.time()
            s = self.sched.choose(left) if left > 1.0 else None
            if self.store is None:  # a simulated world: one process decides for all
                return None if s is None else (s.nodeid, s.examples)
            self.store.set(key, json.dumps(None if s is None else [s.nodeid, s.examples, s.why]))
        got = json.loads(self.store.get(key))
        return None if got is None else (got[0], got[1])

    # -- one slice, on every rank -------------------------------------------------
    def _slice(self, k: int, item: pytest.Item, n: int) -> bool:
        from launch.world import world_size_of

        fn = engine.given_function(item)
        given = set(getattr(fn.hypothesis, "_given_kwargs", {}) or {})
        op = _param_id(item)
        self.probe.begin(item.nodeid, k, op)
        if self.rank == 0:
            self.state.current = {"nodeid": item.nodeid, "slice": k, "examples": n,
                                  "started": time.time()}
            self._save()
        session = item.session
        # NOTE: the stack may hold another module's fixtures from the last
        # slice; tear down what this item does not share, keep the rest.
        session._setupstate.teardown_exact(item)
        t = time.time()
        size = min(world_size_of(item) or self.size, self.size)  # the sub-world that runs it
        with engine.layer(fn, "slice",
                          settings=lambda cur: slice_settings(cur, self.db, item.nodeid, n),
                          inner=lambda inner: self.probe.wrap(inner, given)):
            reports = self.mode.run(item, world_size_of(item))
        dt = time.time() - t
        failed = [r for r in reports if r.failed]
        skipped = [r for r in reports if r.skipped]
        # Every rank posts the last example it ran (the shrunk one after a
        # failure): the report says whether all ranks that ran it (the first
        # ``size`` of a larger world) ended on the same one.
        if self.store is None:
            per_rank = {str(r): _digest(t) for r, t in sorted(self.probe.lasts.items())
                        if r < size}
        else:
            self.store.set(f"last/{k}/{self.rank}", _digest(self.probe.last))
            per_rank = {str(r): v.decode() for r, v in enumerate(
                self.store.multi_get([f"last/{k}/{r}" for r in range(size)]))}
        if self.rank == 0:
            self._fold(item, n, dt, failed, skipped, per_rank)
        fatal = any(w in (r.longreprtext or "") for r in failed
                    for w in ("LockstepDivergence", "launch:"))
        return not fatal

    def _fold(self, item: pytest.Item, n: int, dt: float, failed: list[Any],
              skipped: list[Any], per_rank: dict[str, str]) -> None:
        st, p = self.state, self.probe
        now = time.time() - self.t0
        new_arcs = 0
        if p.tracer is not None:
            for f, arcs in p.tracer.take().items():
                known = self.known.setdefault(f, set())
                fresh = arcs - known
                if fresh:
                    known |= fresh
                    new_arcs += len(fresh)
                    st.arcs[f] = sorted([list(a) for a in known])
        seen = st.classes.setdefault(item.nodeid, {})
        new_classes = 0
        for ex in p.classes:
            for kind, value in ex.items():
                vals = seen.setdefault(kind, [])
                if value not in vals:
                    vals.append(value)
                    new_classes += 1
        new = new_arcs + new_classes
        if skipped and not failed and not p.examples:
            why = skipped[0].longrepr[2] if isinstance(skipped[0].longrepr, tuple) else "skipped"
            self.sched.skip(item.nodeid, str(why))
        else:
            self.sched.record(item.nodeid, p.examples, dt, new, failed=bool(failed))
        for rep in failed:
            f = parse_failure(item.nodeid, rep.longreprtext or "", st.elapsed_before + now)
            f.replay = from_lockstep(f.replay, item.nodeid, self.size, self.db_path)
            # The last example this rank ran is Hypothesis' final replay of the minimal one.
            f.example = f.example or self.probe.last[:2000]
            f.per_rank = per_rank
            st.add_failure(f)
        st.prop_arcs[item.nodeid] = st.prop_arcs.get(item.nodeid, 0) + new_arcs
        if new:
            st.discoveries.append([round(st.elapsed_before + now, 1), item.nodeid, new_arcs,
                                   new_classes])
        arcs, lines = st.coverage()
        total_ex = sum(q.examples for q in self.sched.props.values())
        st.timeline.append([round(st.elapsed_before + now, 1), arcs, lines, total_ex])
        if p.examples:
            st.prop_timeline.setdefault(item.nodeid, []).append(
                [round(st.elapsed_before + now, 1), st.prop_arcs[item.nodeid]])
        st.elapsed = now
        st.current = {}
        self._save()

    def _save(self) -> None:
        self.state.props = self.sched.dump()
        self.state.save(self.dir / "state.json")


def slice_settings(current: Any, db: Any, nodeid: str, n: int) -> Any:
    """One slice of ``nodeid``: ``n`` examples from a fresh seed, no explain
    phase, and the session database in ``nodeid``'s own namespace (variants of
    one test share Hypothesis' key; see ``launch.fuzz.nodedb``)."""
    from hypothesis import Phase, settings

    return settings(current, max_examples=n, database=per_node(db, nodeid), derandomize=False,
                    deadline=None, phases=[p for p in Phase if p != Phase.explain])


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12] if text else ""


class _SimWorld:
    """The slices of a ``--sim N`` session: every rank is a thread of this
    process (``launch.modes.simulated`` runs a ``world_size(n)`` test on n threads,
    one Hypothesis engine fanning each example out to them through
    ``launch.sim.fanout``, which takes the slice's settings: its seed,
    ``max_examples`` and database), so one process plans,
    runs and records; no store, no torchrun."""

    def __init__(self, n: int) -> None:
        self.n = n

    @staticmethod
    def rank_now() -> int:
        # Each rank thread has its own c10d world (threaded process group);
        # the main thread (an unmarked test) counts as rank 0.
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    def skip_too_big(self, items: list[pytest.Item], sched: Scheduler) -> None:
        from launch.world import world_size_of

        for it in items:
            size = world_size_of(it) or 1
            if size > self.n:
                sched.skip(it.nodeid, f"world_size({size}) > --sim {self.n}")


def _param_id(item: pytest.Item) -> str:
    """The test's parametrization minus the world size: the op of an op table."""
    cs = getattr(item, "callspec", None)
    if cs is None:
        return ""
    parts = [p for p in cs.id.split("-") if not p.endswith("ranks")]
    return "-".join(parts)


def _package_dir(name: str) -> str | None:
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(list(spec.submodule_search_locations)[0])
