"""Lockstep Hypothesis inside world tests: every rank draws the same examples.

Part of the installed service (``launch.plugin`` loads it), so ``@given`` on a
world test works in any repository with no conftest and no ``-p``. While a test
runs on more than one rank, *every* Hypothesis run this rank starts is put in
lockstep with the same run on the test's other ranks: ``@given`` on the test
itself, an inner ``@given`` function the test calls (the ``distributed_inputs``
docstring pattern), ``find()``, stateful machines (all of them are ``@given``
runs underneath). Per run it

- gives every rank the same seed: ``@seed``/``derandomize`` as written (those
  are the same everywhere), else one seed chosen by rank 0 and shared;
- turns off what differs between processes: deadlines, timing health checks,
  the ``explain`` phase; only rank 0 reads and writes the example database,
  and the other ranks replay what rank 0 read from it;
- after every example, compares a digest of Hypothesis' choice sequence and
  of the drawn values' reprs across the test's ranks (a divergence raises ``LockstepDivergence`` on every rank,
  naming the first differing rank and the first differing draw, and is never
  shrunk) and agrees on the outcome: if any rank failed, every rank raises the
  same ``RankFailure``, so Hypothesis shrinks along the same path everywhere.

Exchanges go over a ``PrefixStore`` of the default store, never the process
group (a failed example may have left it mid-collective). ``strategy.example()``
inside a world test draws from the process's own random state, so it raises
on every rank with what to write instead.

The ``ci``/``dev``/``fuzz`` profiles are not registered here (that would change
every repository's Hypothesis settings): ``launch.hypothesis_lockstep`` does,
opt-in. Heavy imports happen inside hooks only; it never imports ``dtensor``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import threading
import traceback
from datetime import timedelta
from typing import Any

import pytest

from launch.lockstep_db import WHERE
from launch.lockstep_db import mirror_db_class as _mirror_db_class

__all__ = ["LockstepDivergence", "RankFailure"]

RUN_NPROC_ENV = "LAUNCH_RUN_NPROC"  # ranks per node of the run (lockstep mode sets it)
LEFT = "LEFT:"  # store value: the rank that should have set this key left the test


class LockstepDivergence(BaseException):
    """Ranks drew different examples: Hypothesis must not shrink this (it is
    a BaseException so Hypothesis lets it through)."""


class RankFailure(AssertionError):
    """An example failed on some rank; raised identically on every rank."""


class ExampleInWorldError(RuntimeError):
    """``strategy.example()`` in a world test: each rank would draw its own value."""


# Options and hooks ---------------------------------------------------------------
class _Hooks:
    @pytest.hookspec
    def pytest_lockstep_replay_args(self, config: pytest.Config) -> list[str]:
        """Extra words for the ``Replay:`` command of a failed property:
        ``NAME=value`` (an environment variable) or a pytest option."""


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(_Hooks)


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("hypothesis-lockstep", "lockstep hypothesis across ranks")
    g.addoption("--lockstep-timeout", type=float, default=300.0,
                help="seconds to wait for the other ranks' verdict on one example")


def pytest_configure(config: pytest.Config) -> None:
    _pin_literal_pool()
    config.pluginmanager.register(_Plugin(config), "hypothesis-lockstep")


def _pin_literal_pool() -> None:
    """Draw the same examples whatever modules this process has imported.

    Hypothesis draws 5 % of its numbers from the literals of the "local"
    (non-test, non-installed) modules in ``sys.modules`` at that moment. So
    one seed gave different examples in a simulated world (which imports
    ``launch.sim*``) and in a real rank (``launch.lockstep``), in an xdist
    worker (the modules of its share of the tests) and in one process, and
    after any literal changed anywhere in the project: a planted bug that a
    real 4-rank world caught passed simulated, because a number added to the
    simulator moved the examples. Only the code under test and the seed
    should choose the examples: the local pool stays empty (Hypothesis' own
    boundary values remain).
    """
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:  # a Hypothesis without a local pool: nothing to pin
        return
    if not callable(getattr(providers, "_get_local_constants", None)):
        return
    empty = Constants()
    providers._get_local_constants = lambda: empty


# The test being run on several ranks ----------------------------------------------
_ACTIVE: _Test | None = None  # set while a multi-rank test runs on this rank


def _members(item: pytest.Item) -> tuple[int, ...] | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    size = dist.get_world_size()  # inside a sub-world: the sub-world's
    m = item.get_closest_marker("world_size")
    n = min(int(m.args[0]) if m and m.args else size, size)
    return tuple(range(n)) if n > 1 and dist.get_rank() < n else None


class _Test:
    """One call of one multi-rank test on this rank: numbers its Hypothesis runs."""

    def __init__(self, item: pytest.Item, members: tuple[int, ...], inv: int,
                 timeout: float) -> None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        self.item, self.members, self.inv, self.timeout = item, members, inv, timeout
        self.runs = 0
        self.rank = dist.get_rank()
        tk = hashlib.sha1(item.nodeid.encode()).hexdigest()[:16]
        self.store = dist.PrefixStore(f"hyplock/{tk}/{inv}/", _get_default_store())

    def new_run(self, test: Any, wrapped_test: Any, settings: Any, stuff: Any) -> _Run:
        self.runs += 1
        return _Run(self, self.runs, test, wrapped_test, settings, stuff)

    def run_store(self, index: int) -> Any:
        import torch.distributed as dist

        return dist.PrefixStore(f"{index}/", self.store)

    def leave(self, how: str) -> None:
        """This rank is done with the test. A rank still in a Hypothesis run
        can only be blocked on the first key of the run after this rank's
        last one (every run ends with an exchange of all ranks): fill this
        rank's keys there with ``LEFT`` so the waiter stops at once, naming
        this rank, instead of waiting out the lockstep timeout."""
        mine = [f"0/{self.rank}"] + (["seed", WHERE, "db/0"] if self.rank == 0 else [])
        note = LEFT + json.dumps({"rank": self.rank, "runs": self.runs, "how": how})
        try:
            self.run_store(self.runs + 1).multi_set(mine, [note] * len(mine))
        except Exception:  # NOTE: the world may be gone; the watchdog reports that
            pass


def _install_patch() -> None:
    """Route every Hypothesis run of this process through ``_ACTIVE`` (once)."""
    from hypothesis import core
    from hypothesis.strategies import SearchStrategy

    cls = core.StateForActualGivenExecution
    if getattr(cls, "_launch_lockstep", False):
        return
    init, run_engine, example = cls.__init__, cls.run_engine, SearchStrategy.example

    @functools.wraps(init)
    def __init__(self, stuff, test, settings, random, wrapped_test, **kw):
        run = None
        active = _ACTIVE
        if active is not None and threading.current_thread() is threading.main_thread():
            run = active.new_run(test, wrapped_test, settings, stuff)
            settings, random, test = run.settings, run.shared_random(random), run.wrap(test)
        init(self, stuff, test, settings, random, wrapped_test, **kw)
        self._launch_run = run

    @functools.wraps(run_engine)
    def _run_engine(self):
        run = getattr(self, "_launch_run", None)
        if run is None:
            return run_engine(self)
        try:
            result = run_engine(self)
        except LockstepDivergence:
            raise  # the ranks are apart; a final exchange could only wait
        except BaseException:
            run.finish()
            raise
        run.finish()
        return result

    @functools.wraps(example)
    def _example(self):
        if _ACTIVE is not None:
            raise ExampleInWorldError(
                f"hypothesis lockstep: {_ACTIVE.item.nodeid}: strategy.example() in a "
                "world test draws from this rank's own random state, so ranks get "
                "different values. Write the test with @given (on the test, or on an "
                "inner function it calls): those draws run in lockstep on every rank.")
        return example(self)

    cls.__init__, cls.run_engine, SearchStrategy.example = __init__, _run_engine, _example
    cls._launch_lockstep = True


# One Hypothesis run in lockstep ---------------------------------------------------------
_TIMING_CHECKS = ("too_slow", "differing_executors", "function_scoped_fixture")


def _lockstep_settings(current: Any, db: Any) -> Any:
    from hypothesis import HealthCheck, Phase, settings

    checks = list(dict.fromkeys([*current.suppress_health_check,
                                 *(HealthCheck[c] for c in _TIMING_CHECKS)]))
    return settings(current, deadline=None, database=db, suppress_health_check=checks,
                    phases=[p for p in current.phases if p != Phase.explain])


class _Run:
    """One Hypothesis run (one ``@given`` call) of a multi-rank test on one rank."""

    def __init__(self, test_: _Test, index: int, fn: Any, wrapped_test: Any,
                 current: Any, stuff: Any) -> None:
        self.t, self.members, self.item = test_, test_.members, test_.item
        self.rank, self.index = test_.rank, index
        self.store = test_.run_store(index)
        self.timeout = timedelta(seconds=test_.timeout)
        self.name = getattr(fn, "__qualname__", repr(fn))
        self.wrapped_test = wrapped_test
        self.given = set(getattr(stuff, "given_kwargs", {}) or {})
        self.current = current
        db = _mirror_db_class()(current.database, self.store, self.rank, self.timeout,
                                self.read)
        self.settings = _lockstep_settings(current, db)
        self.k = 0
        self.seed: int | None = None

    def shared_random(self, random: Any) -> Any:
        """Hypothesis' Random for this run, the same on every rank."""
        from random import Random

        from hypothesis import core

        wt = self.wrapped_test
        if getattr(wt, "_hypothesis_internal_use_seed", None) is not None \
                or self.current.derandomize:
            return random  # from @seed or the test's source digest: equal everywhere
        forced = getattr(core, "global_force_seed", None)
        if forced is not None:  # --hypothesis-seed, given to every rank alike
            self.seed = forced
            return random
        if self.rank == 0:
            self.store.set("seed", str(random.getrandbits(64)))
        self.seed = int(self.read(["seed"], "rank 0's seed")[0])
        wt._hypothesis_internal_use_generated_seed = self.seed  # hypothesis' @seed hint
        return Random(self.seed)

    def wrap(self, inner: Any) -> Any:
        @functools.wraps(inner)
        def lockstep_example(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            return self.example(inner, args, kwargs)

        return lockstep_example

    # -- one example -------------------------------------------------------------------
    def example(self, inner: Any, args: tuple, kwargs: dict) -> Any:
        from hypothesis.control import current_build_context
        from hypothesis.errors import Found, UnsatisfiedAssumption

        __tracebackhide__ = True
        draws = [f"{k}={v!r}"[:300] for k, v in sorted(kwargs.items())
                 if k in self.given and not _is_data(v)]
        for v in kwargs.values():
            _record_draws(v, draws)
        outcome, err, control, result = "pass", "", None, None
        try:
            result = inner(*args, **kwargs)
        except UnsatisfiedAssumption:
            outcome = "reject"
        except Found as e:  # find()'s condition held: its signal, not a failure
            outcome, control = "found", e
        except Exception as e:
            outcome = "fail"
            tb = traceback.format_exception(type(e), e, e.__traceback__, limit=-4)
            err = "".join(tb)[-2500:]
        except BaseException as e:  # skip, exit, hypothesis control flow: re-raised
            outcome, control = "control", e
        try:  # NOTE: the choice sequence is exact; reprs may hide differences
            choices = repr(current_build_context().data.choices)
        except Exception:
            choices = repr(draws)
        # Both: choices catch what a repr abbreviates, reprs catch values that
        # took no choice (st.just of a rank-local value).
        digest = hashlib.sha1(f"{self.name}|{choices}|{draws}".encode()).hexdigest()
        slot = str(self.k)
        self.k += 1
        got = self.exchange(slot, {"h": digest, "o": outcome, "e": err,
                                   "d": [d[:300] for d in draws][:20]})
        self.check_same(got, slot)
        found = [r for r in self.members if got[r]["o"] == "found"]
        if found and len(found) != len(self.members):
            raise LockstepDivergence(
                f"hypothesis lockstep: {self.item.nodeid}: the find() condition held "
                f"for example #{slot} of {self.name} on rank(s) {found} only "
                f"({'; '.join(draws) or 'no draws'}); a find() condition must not "
                f"depend on the rank. {self.replay_hint()}")
        controls = [r for r in self.members if got[r]["o"] == "control"]
        if controls and len(controls) != len(self.members):
            raise LockstepDivergence(
                f"hypothesis lockstep: {self.item.nodeid}: example #{slot} of {self.name} "
                f"stopped the test (skip/exit/interrupt) on rank(s) {controls} only. "
                f"{self.replay_hint()}")
        if control is not None:
            raise control
        failed = [r for r in self.members if got[r]["o"] == "fail"]
        if failed:
            raise RankFailure(self.failure_text(got, failed))
        if any(got[r]["o"] == "reject" for r in self.members):
            raise UnsatisfiedAssumption()
        return result

    def finish(self) -> None:
        """After the run: every rank must stop after the same example."""
        got = self.exchange(str(self.k), {"h": "END", "o": "end", "e": "", "d": []})
        self.check_same(got, str(self.k))

    # -- store exchange ----------------------------------------------------------------
    def exchange(self, slot: str, payload: dict) -> dict[int, dict]:
        self.store.set(f"{slot}/{self.rank}", json.dumps(payload))
        keys = [f"{slot}/{r}" for r in self.members]
        vals = self.read(keys, f"example #{slot}")
        if slot.isdigit() and int(slot) > 0:
            # Every rank has written this slot, so all have read the previous
            # one: drop our key of it (long fuzzing runs would fill the store).
            self.store.delete_key(f"{int(slot) - 1}/{self.rank}")
        return {r: json.loads(v) for r, v in zip(self.members, vals, strict=True)}

    def read(self, keys: list[str], what: str) -> list[bytes]:
        """The values of ``keys`` once every one is set. A ``LEFT`` value (its
        rank left the test) fails this rank at once, naming that rank; a key
        still missing after the lockstep timeout fails it too."""
        try:
            self.store.wait(keys, self.timeout)
        except Exception:
            missing = [k for k in keys if not self.store.check([k])]
            raise LockstepDivergence(
                f"hypothesis lockstep: {self.item.nodeid}: {what} of {self.name} "
                f"({', '.join(missing)}) did not report within "
                f"{self.timeout.total_seconds():.0f}s (rank {self.rank} is waiting). "
                f"{self.replay_hint()}") from None
        vals = self.store.multi_get(keys)
        gone = [json.loads(v[len(LEFT):]) for v in vals if v.startswith(LEFT.encode())]
        if gone:
            how = "; ".join(f"rank {g['rank']} after {g['runs']} Hypothesis run(s): "
                            f"{g['how']}" for g in gone)
            raise LockstepDivergence(
                f"hypothesis lockstep: rank(s) {[g['rank'] for g in gone]} left "
                f"{self.item.nodeid} while rank {self.rank} waits for their {what} of "
                f"{self.name} (Hypothesis run #{self.index} of the test; {how}). Every "
                "rank must make the same Hypothesis runs in the same order: neither a "
                "run nor an assertion between runs may depend on the rank. "
                f"{self.replay_hint()}")
        return vals

    def check_same(self, got: dict[int, dict], slot: str) -> None:
        first = self.members[0]
        ref = got[first]
        bad = [r for r in self.members if got[r]["h"] != ref["h"]]
        if not bad:
            return
        r = bad[0]
        a, b = ref["d"], got[r]["d"]
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))

        def at(d: list[str], who: int) -> str:
            if got[who]["h"] == "END":
                return "(no further example: the run ended)"
            return d[k] if k < len(d) else "(no such draw)"

        raise LockstepDivergence(
            f"hypothesis lockstep: {self.item.nodeid}: ranks diverged at example "
            f"#{slot} of {self.name}; first differing rank is {r}.\n"
            f"  first differing draw (#{k + 1}): rank {first}: {at(a, first)}\n"
            f"                          rank {r}: {at(b, r)}\n"
            f"  rank {first} drew: {'; '.join(a) or '(nothing)'}\n"
            f"  rank {r} drew: {'; '.join(b) or '(nothing)'}\n"
            "Examples must not depend on the rank: draw from strategies only, never "
            "from rank-local state, and call the same @given functions in the same "
            f"order on every rank. {self.replay_hint()}")

    def failure_text(self, got: dict[int, dict], failed: list[int]) -> str:
        lines = [f"example failed on rank(s) {failed} of {list(self.members)}: "
                 f"{'; '.join(got[failed[0]]['d'])}"]
        for r in failed:
            lines.append(f"----- rank {r} -----\n{got[r]['e'].rstrip()}")
        lines.append(self.replay_hint())
        return "\n".join(lines)

    def replay_hint(self) -> str:
        import torch.distributed as dist

        config = self.item.config
        extra = [w for ws in config.hook.pytest_lockstep_replay_args(config=config) for w in ws]
        env = [w for w in extra if "=" in w and not w.startswith("-")]
        nproc = os.environ.get(RUN_NPROC_ENV) or str(dist.get_world_size())
        from hypothesis import settings

        cmd = [*env, "torchrun", f"--nproc_per_node={nproc}", "-m", "pytest",
               "-p", "launch.hypothesis_lockstep", f"'{self.item.nodeid}'",
               f"--hypothesis-profile={settings._current_profile or 'default'}"]
        if self.seed is not None:
            cmd.append(f"--hypothesis-seed={self.seed}")
        cmd += [w for w in extra if w not in env]
        return "Replay: " + " ".join(cmd)


def _is_data(v: Any) -> bool:
    return type(v).__name__ == "DataObject" and hasattr(v, "draw")


def _record_draws(v: Any, out: list[str]) -> None:
    """Record the repr of every ``data.draw`` of an ``st.data()`` argument."""
    if not _is_data(v):
        return
    draw = v.draw

    def recording_draw(strategy: Any, label: Any = None) -> Any:
        value = draw(strategy, label)
        out.append(f"draw {len(out) + 1}: {value!r}"[:300])
        return value

    v.draw = recording_draw


# The pytest side ---------------------------------------------------------------------
class _Plugin:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.calls: dict[str, int] = {}

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item):
        global _ACTIVE
        if "hypothesis" not in sys.modules:  # nothing in this process can draw
            return (yield)
        fn = getattr(getattr(item, "obj", None), "__func__", getattr(item, "obj", None))
        given = getattr(fn, "is_hypothesis_test", False)
        members = _members(item)
        saved = None
        if given and (members is not None or "world" in getattr(item, "fixturenames", ())):
            # NOTE: hypothesis' own pytest hook (inside this wrapper) fails a
            # @given test that takes the function-scoped `world` fixture; that
            # fixture is one value per test, so the check does not apply.
            saved = fn._hypothesis_internal_use_settings
            fn._hypothesis_internal_use_settings = _lockstep_settings(saved, saved.database)
        if members is None:
            try:
                return (yield)
            finally:
                if saved is not None:
                    fn._hypothesis_internal_use_settings = saved
        _install_patch()
        inv = self.calls[item.nodeid] = self.calls.get(item.nodeid, 0) + 1
        _ACTIVE = test_ = _Test(item, members, inv, self.config.getoption("lockstep_timeout"))
        how = "it passed"
        try:
            return (yield)
        except BaseException as e:
            how = f"it raised {type(e).__name__}: {(str(e).strip() or '-').splitlines()[0][:200]}"
            raise
        finally:
            _ACTIVE = None
            test_.leave(how)
            if saved is not None:
                fn._hypothesis_internal_use_settings = saved
