"""Simulated mode (``pytest --dist-sim``): ``world_size(n)`` tests run with n
ranks as n threads of this process (``launch.sim.world``), not n processes.

Unmarked tests run as usual. For a marked test, setup and teardown (fixtures)
run once on the main thread, which is no rank; the test function itself runs
on every rank thread, each with its own ``world`` (rank, size, group). A
``@given`` test runs one Hypothesis engine on the main thread and every
example on all rank threads (``launch.sim.fanout``). The ranks' outcomes are
combined as in a real world: all pass, or the test fails with every failing
rank's error, or all skip.

Where it runs: plain ``pytest`` and each pytest-xdist worker (``-n 2``: each
worker hosts the simulated worlds of the tests it gets; it starts with
glibc's per-thread caches off, ``launch.sim.malloc``). Not under torchrun: a
simulated world lives in one process (``--dist-sim`` there is a usage error).

A failure prints two ``Replay:`` lines, simulated and real (``torchrun`` at
the same world size). ``--dist-sim-confirm`` re-runs each simulated failure
on a real world of that size (up to ``--dist-sim-confirm-max`` ranks) before
reporting it: a failure the real world does not reproduce is labelled a
simulator fault.

The ini option ``dist_sim_rank_init`` (``module:function``) is called as
``function(rank, size)`` on every rank thread as it starts: a runtime's
per-rank state (here ``dtensor._rank_state:enter_rank``; the service never
imports the runtime).
"""

from __future__ import annotations

import gc
import importlib
import os
import random
import subprocess
import sys
from typing import Any

import pytest

from launch.agree import RankFailure
from launch.sim import world as sim
from launch.sim.inner_given import refusing
from launch.sim.malloc import one_malloc_arena, thread_cache_hint, without_thread_caches
from launch.sim.threaded import entered
from launch.world import World, timeout_of, world_size_of

__all__ = ["SimMode", "SimTally", "add_options"]

CONFIRM_ENV = "LAUNCH_SIM_CONFIRMING"  # set in the real-world re-run of a failure


def add_options(parser: pytest.Parser) -> None:
    g = parser.getgroup("launch")
    g.addoption("--dist-sim", action="store_true", default=False,
                help="run world_size(n) tests with n ranks as threads of this process "
                     "(PyTorch's threaded process group) instead of n processes")
    g.addoption("--dist-sim-confirm", action="store_true", default=False,
                help="re-run each simulated failure on a real world of the same size "
                     "before reporting it (labels simulator faults)")
    g.addoption("--dist-sim-confirm-max", type=int, default=8,
                help="largest real world --dist-sim-confirm launches (default 8)")
    g.addoption("--dist-sim-examples", type=int, default=None,
                help="max_examples of every @given test in a simulated world (e.g. a "
                     "reduced count for 64-rank runs)")
    parser.addini("dist_sim_rank_init", default="",
                  help="module:function called as function(rank, size) on each "
                       "simulated rank thread (per-rank runtime state)")


class SimMode:
    name = "simulated"  # launch.world.Mode
    ranks_here = False  # the process is no rank: only world_size tests are distributed
    store = None  # the ranks are threads of this process

    def __init__(self, config: pytest.Config) -> None:
        one_malloc_arena()  # before torch or pytest start threads of their own
        os.environ.update(without_thread_caches(os.environ))  # for re-runs it starts
        self.config = config
        spec = config.getini("dist_sim_rank_init")
        self.rank_init = _load(spec) if spec else None
        self.seed = config.getoption("dist_seed")
        self.sizes: set[int] = set()
        self.examples = 0  # @given examples run (rank 0's count), for the summary

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        _freeze_heap()

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        if nextitem is not None and getattr(nextitem, "module", None) is not getattr(item, "module", None):
            _freeze_heap(young_only=True)

    def world_for(self, n: int | None) -> World:
        # The main thread is no rank; the test's ranks get theirs in _call.
        import torch.distributed as dist

        if n is not None and dist.is_initialized():
            return World(dist.get_rank(), n, tuple(range(n)), dist.group.WORLD)
        return World(0, n or 1, tuple(range(n or 1)), None)

    def run(self, item: pytest.Item, n: int | None) -> list[Any]:
        """``launch.world.Mode.run``: the item's own ``world_size`` on threads
        (``n`` must be that size or None)."""
        from _pytest.runner import runtestprotocol

        own = world_size_of(item)
        if n is not None and n != (own or 1):
            raise ValueError(f"simulated run of {item.nodeid}: n={n}, but the test is "
                             f"world_size({own}); pass n=None or {own}")
        return runtestprotocol(item, log=False, nextitem=item.parent)

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> bool | None:
        n = world_size_of(pyfuncitem)
        if n is None:
            return None
        self._call(pyfuncitem, n)
        return True

    def _call(self, item: pytest.Function, n: int) -> None:
        __tracebackhide__ = True
        import torch

        self.sizes.add(n)
        names = item._fixtureinfo.argnames
        base = {k: item.funcargs[k] for k in names}
        timeout = sim.sim_deadline(timeout_of(item, self.config.getoption("dist_timeout")), n)
        fn = getattr(item.obj, "__func__", item.obj)
        given = getattr(fn, "is_hypothesis_test", False) and n > 1
        # Python's and torch's generators are the process's, shared by the
        # ranks: seeded once here, as a real world seeds each rank's.
        random.seed(self.seed)
        torch.manual_seed(self.seed)
        w = sim.world(n, self.rank_init)

        worlds: dict[int, World] = {}  # a rank's World, made on its first example
        ranks = tuple(range(n))  # one for all ranks (1,024 copies at 1,024 ranks: ~30 MB)

        def rank_kwargs(rank: int, kw: dict) -> dict:
            kw = dict(kw)
            if "world" in kw:
                world = worlds.get(rank)
                if world is None:
                    import torch.distributed as dist

                    world = worlds[rank] = World(rank, n, ranks, dist.group.WORLD)
                kw["world"] = world
            return kw

        if given:
            from launch.sim.fanout import SimFanout

            fan = SimFanout(item, w, timeout, replay=self.replay(item, n),
                            rank_kwargs=rank_kwargs,
                            max_examples=self.config.getoption("dist_sim_examples"))
            with entered(), fan, refusing(item.nodeid):
                try:
                    item.obj(**base)  # the engine here; every example on every rank
                except Exception as err:
                    err.add_note(self.real_replay(item, n))
                    if self.config.getoption("dist_sim_confirm") and \
                            not os.environ.get(CONFIRM_ENV):
                        err.add_note(self.confirm(item, n))
                    raise
                finally:
                    self.examples += fan.examples
            return
        with entered(), refusing(item.nodeid):
            outs = w.run(lambda rank: item.obj(**rank_kwargs(rank, base)), timeout)
        self._combine(item, n, outs)

    def _combine(self, item: pytest.Item, n: int, outs: list[sim.Outcome]) -> None:
        __tracebackhide__ = True
        from _pytest.outcomes import Skipped

        errors = [o for o in outs if o.error is not None]
        if not errors:
            return
        skips = [o for o in errors if isinstance(o.error, Skipped)]
        if len(skips) == n:
            raise skips[0].error
        real = [o for o in errors if not o.aborted and not isinstance(o.error, Skipped)]
        first = (real or errors)[0]
        if all(isinstance(o.error, RankFailure) for o in errors):
            lines = [f"simulated {n}-rank world: every rank raised the lockstep failure above"]
        else:
            lines = [f"simulated {n}-rank world: failed on rank(s) "
                     f"{[o.rank for o in real] or [o.rank for o in errors]} of {n}"]
        for o in errors:
            if o is first or isinstance(o.error, RankFailure):
                continue  # lockstep raised the same failure on every rank
            why = ("hung (no return by the deadline)" if o.hung else
                   "released from a collective after another rank failed" if o.aborted else
                   f"{type(o.error).__name__}: {o.error}"[:300])
            lines.append(f"  rank {o.rank}: {why}")
        if skips and len(skips) < n:
            lines.append(f"  skipped on rank(s) {[o.rank for o in skips]} only: a skip must "
                         "happen on every rank")
        if not any(ln.startswith("Replay:") for ln in str(first.error).splitlines()):
            lines.append(self.replay(item, n))
        lines.append(self.real_replay(item, n))
        if self.config.getoption("dist_sim_confirm") and not os.environ.get(CONFIRM_ENV):
            lines.append(self.confirm(item, n))
        err = first.error
        if isinstance(err, Skipped):
            raise AssertionError("\n".join(lines))
        for ln in lines:
            err.add_note(ln)
        raise err

    # -- replay and confirmation ------------------------------------------------
    def _extra(self) -> list[str]:
        config = self.config
        hook = getattr(config.hook, "pytest_lockstep_replay_args", None)
        extra = [w for ws in hook(config=config) for w in ws] if hook is not None else []
        if config.getoption("dist_sim_examples"):
            extra.append(f"--dist-sim-examples={config.getoption('dist_sim_examples')}")
        profile = config.getoption("hypothesis_profile", None)
        if profile:
            extra.append(f"--hypothesis-profile={profile}")
        return extra

    def _command(self, head: str, *run: str, env: dict | None = None) -> str:
        extra = self._extra()  # VAR=value words go before the command
        words = dict(w.split("=", 1) for w in extra if "=" in w and not w.startswith("-"))
        words.update(env or {})  # a smaller world's own settings win
        return " ".join([head, *(f"{k}={v}" for k, v in words.items()), *run,
                         *(w for w in extra if "=" not in w or w.startswith("-"))])

    def replay(self, item: pytest.Item, n: int) -> str:
        return self._command("Replay:", "pytest", "--dist-sim", f"'{item.nodeid}'")

    def real_replay(self, item: pytest.Item, n: int) -> str:
        return self._command("Replay (real world):", "torchrun", f"--nproc_per_node={n}",
                             "-m", "pytest", f"'{item.nodeid}'")

    def _rerun(self, nodeid: str, more_env: dict, sim: bool) -> subprocess.CompletedProcess:
        extra = self._extra()
        env = dict(os.environ, **{CONFIRM_ENV: "1"})
        for w in extra:
            if "=" in w and not w.startswith("-"):
                k, v = w.split("=", 1)
                env[k] = v
        env.update(more_env)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--dist-timeout", str(self.config.getoption("dist_timeout")),
               *(["--dist-sim"] if sim else []),
               nodeid, *[w for w in extra if w.startswith("-")]]
        return subprocess.run(cmd, cwd=self.config.rootpath, env=env, capture_output=True,
                              text=True, timeout=600)

    def smallest(self, item: pytest.Item, n: int) -> tuple[int, str, dict] | None:
        """The smallest world (simulated re-runs, smallest first) in which the
        same test still fails; None if no smaller one does or none is known."""
        variants = self._variants(item, n)
        for m, nodeid, env in sorted(variants, key=lambda v: v[0]):
            if m >= n:
                continue
            try:
                if self._rerun(nodeid, env, sim=True).returncode == 1:
                    return m, nodeid, env
            except subprocess.TimeoutExpired:
                continue
        return None

    def _variants(self, item: pytest.Item, n: int) -> list[tuple[int, str, dict]]:
        """The hook's answer, checked: a project's mistake there names the
        hook and what it returned, not an unpacking error deep in here."""
        got = self.config.hook.pytest_dist_sim_smaller_worlds(item=item, size=n) or []
        ok = isinstance(got, (list, tuple)) and all(
            isinstance(v, (list, tuple)) and len(v) == 3 and isinstance(v[0], int)
            and not isinstance(v[0], bool) and isinstance(v[1], str) and isinstance(v[2], dict)
            for v in got
        )
        if not ok:
            raise pytest.UsageError(
                f"pytest_dist_sim_smaller_worlds(item={item.nodeid!r}, size={n}) must "
                f"return None or a list of (world size: int, node id: str, env: dict), "
                f"got {got!r}"
            )
        return [tuple(v) for v in got]

    def confirm(self, item: pytest.Item, n: int) -> str:
        """Find the smallest world that still fails (simulated), then re-run
        the failure on a real world of that size; lines saying what it found."""
        lines, nodeid, env = [], item.nodeid, {}
        try:
            offered = bool(self._variants(item, n))
            found = self.smallest(item, n)
        except pytest.UsageError as e:  # the failure itself still gets reported
            lines.append(f"Smallest-world search skipped: {e}")
            offered, found = False, None
        if found is not None:
            m, nodeid, env = found
            lines.append(self._command(
                f"Replay (smallest real world that reproduces it in simulation, {m} ranks):",
                "torchrun", f"--nproc_per_node={m}", "-m", "pytest", f"'{nodeid}'", env=env))
            n = m
        elif offered:
            lines.append(f"Smallest world: {n} ranks (no smaller simulated world failed it "
                         "at this example budget)")
        lines.append(self._confirm_real(nodeid, env, n))
        return "\n".join(lines)

    def _confirm_real(self, nodeid: str, more_env: dict, n: int) -> str:
        cap = self.config.getoption("dist_sim_confirm_max")
        if n > cap:
            return (f"Confirmation: not attempted (a real {n}-rank world is over "
                    f"--dist-sim-confirm-max={cap}); unconfirmed simulated failure")
        try:
            out = self._rerun(nodeid, more_env, sim=False)
        except subprocess.TimeoutExpired:
            return f"Confirmation: the real {n}-rank re-run timed out (600 s)"
        if out.returncode == 1:
            return f"Confirmation: reproduced on a real {n}-rank world (a runtime bug)"
        if out.returncode == 0:
            return (f"Confirmation: SIMULATOR FAULT? the real {n}-rank world passes "
                    "this test; the failure may be the simulation's, not the runtime's")
        tail = (out.stdout + out.stderr).strip().splitlines()[-3:]
        return f"Confirmation: the real re-run could not decide (exit {out.returncode}): " + \
            " | ".join(tail)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        _summary_line(terminalreporter, self.sizes, self.examples, "threads of this process",
                      thread_cache_hint(max(self.sizes, default=0)))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        for w in list(sim._worlds.values()):
            with entered():
                w.close()
        out = getattr(self.config, "workeroutput", None)
        if out is not None:  # an xdist worker: its controller sums the workers'
            out["dist_sim_sizes"] = sorted(self.sizes)
            out["dist_sim_examples"] = self.examples


class SimTally:
    """The xdist controller's side of ``--dist-sim``: it runs no tests, and
    sums its workers' simulated worlds and examples into one summary line
    (what ``bench/sim_throughput.py --sim-workers`` reads)."""

    def __init__(self) -> None:
        os.environ.update(without_thread_caches(os.environ))  # before the workers start
        self.sizes: set[int] = set()
        self.examples = 0

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        out = getattr(node, "workeroutput", None) or {}
        self.sizes.update(out.get("dist_sim_sizes", ()))
        self.examples += out.get("dist_sim_examples", 0)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        _summary_line(terminalreporter, self.sizes, self.examples,
                      "threads of each xdist worker")


def _summary_line(terminalreporter: Any, sizes: set[int], examples: int, where: str,
                  hint: str | None = None) -> None:
    if sizes:
        terminalreporter.write_line(
            f"launch: simulated worlds of {', '.join(str(n) for n in sorted(sizes))} ranks "
            f"({where}); {examples} hypothesis examples")
    if hint:
        terminalreporter.write_line(hint)


def _freeze_heap(young_only: bool = False) -> None:
    """Collect, then keep what survived out of the cyclic collector's scans.

    A simulated world's process holds every rank's long-lived objects and the
    imports the examples pull in (torch.distributed.tensor, sympy: ~200k
    objects), which every full collection would walk again (about a tenth
    of a 4-rank property run). Frozen objects are still freed by
    reference counting; only a cycle among them that becomes garbage later is
    kept, so this runs where little is alive but the process's own state: after
    collection (a full collection first) and between test modules (the young
    generations only, not the previous module's survivors: a cycle that died
    in the old generation since the last full pass stays, a bounded leak).
    """
    gc.collect(1 if young_only else 2)
    gc.freeze()
    # With most objects frozen, a full collection comes due whenever the few
    # unfrozen survivors grow by a quarter; collecting the young every
    # 10,000 allocations rather than Python's default 700 cuts a worker's
    # collections about tenfold.
    gc.set_threshold(10_000, 10, 10)


def _load(spec: str) -> Any:
    mod, _, name = spec.partition(":")
    if not name:
        raise pytest.UsageError(f"dist_sim_rank_init = {spec!r}: expected module:function")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise pytest.UsageError(f"dist_sim_rank_init = {spec!r}: {e}") from None
