"""Lockstep Hypothesis inside world tests: every rank draws the same examples.

Part of the installed service (``launch.plugin`` loads it), so ``@given`` on a
world test works in any repository with no conftest and no ``-p``. While a test
runs on more than one rank, *every* Hypothesis run this rank starts is put in
lockstep with the same run on the test's other ranks: ``@given`` on the test
itself, an inner ``@given`` function the test calls (the ``distributed_inputs``
docstring pattern), ``find()``, stateful machines (all of them are ``@given``
runs underneath). Per run it

- checks that every rank starts it with the same settings (examples, phases,
  database), else raises ``LockstepDivergence`` at once on every rank;
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

After every test, the Hypothesis profiles (the loaded one and every
registered one) are put back as the tests found them after collection.

The ``ci``/``dev``/``fuzz`` profiles are not registered here (that would change
every repository's Hypothesis settings): ``launch.hypo.profiles`` does,
opt-in. Heavy imports happen inside hooks only; it never imports ``dtensor``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import pytest

from launch import hookspecs
from launch.agree import LockstepDivergence, RankFailure
from launch.hypo import engine
from launch.hypo.db import WHERE
from launch.hypo.run import LEFT, RUN_NPROC_ENV, SETTINGS, _Run

__all__ = ["RUN_NPROC_ENV", "ExampleInWorldError", "LockstepDivergence", "RankFailure"]


class ExampleInWorldError(RuntimeError):
    """``strategy.example()`` in a world test: each rank would draw its own value."""


# Options and hooks ---------------------------------------------------------------
def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    hookspecs.register(pluginmanager)


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("hypothesis-lockstep", "lockstep hypothesis across ranks")
    g.addoption("--lockstep-timeout", type=float, default=300.0,
                help="seconds to wait for the other ranks' verdict on one example")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Plugin(config), "hypothesis-lockstep")


def pin_literal_pool() -> None:
    """Draw the same examples whatever modules this process has imported.

    Called by ``launch.plugin`` in the processes whose examples must match
    another process's: a rank (lockstep, server) and a simulated world's
    process. A plain pytest run (a user's own tests beside world tests) keeps
    Hypothesis' pool as it is.

    Hypothesis draws 5 % of its numbers from the literals of the "local"
    (non-test, non-installed) modules in ``sys.modules`` at that moment, so
    one seed would give different examples in a simulated world (which
    imports ``launch.sim.world``) and in a real rank
    (``launch.modes.lockstep``), in an xdist worker and in one process, and
    after any literal changed anywhere in the project: a planted bug caught
    in one mode could pass in another. Only the code under test and the seed
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
        mine = [f"0/{self.rank}", f"{SETTINGS}/{self.rank}"] + (
            ["seed", WHERE, "db/0"] if self.rank == 0 else [])
        note = LEFT + json.dumps({"rank": self.rank, "runs": self.runs, "how": how})
        try:
            self.run_store(self.runs + 1).multi_set(mine, [note] * len(mine))
        except Exception:  # NOTE: the world may be gone; the watchdog reports that
            pass


class _Profiles:
    """The Hypothesis profiles as the tests found them (after collection): the
    loaded one and every registered one, put back after a test that changed
    them.

    A test, or an import it makes, may change them for the rest of the
    process: importing ``torch.testing._internal.common_utils`` registers
    PyTorch's ``dev`` profile (10 examples, no database) over a ``dev`` of
    the user's, and loads it. Every later test would run with it, and in a
    world where only some ranks ran that test (a sub-world), the ranks would
    disagree on their settings.
    """

    def __init__(self) -> None:
        self.name: str | None = None
        self.default: Any = None
        self.registered: dict[str, Any] = {}

    def remember(self) -> None:
        if "hypothesis" not in sys.modules:
            return
        from hypothesis import settings

        self.name, self.default = settings.get_current_profile_name(), settings.default
        # NOTE: Hypothesis lists its profiles only in this private dict; they
        # are read here, and written back through the public API.
        self.registered = dict(getattr(settings, "_profiles", {}))

    def restore(self) -> None:
        if self.name is None:  # no collection seen (or no Hypothesis then)
            self.remember()
            return
        from hypothesis import settings

        for name, kept in self.registered.items():
            if settings.get_profile(name) is not kept:
                settings.register_profile(name, kept)
                self.registered[name] = settings.get_profile(name)
        if settings.default is not self.default or \
                settings.get_current_profile_name() != self.name:
            settings.load_profile(self.name)
            self.default = settings.default


def _start_run(test: Any, wrapped_test: Any, settings: Any, stuff: Any) -> _Run | None:
    """A Hypothesis run began on the main thread: in lockstep while a
    multi-rank test runs here (``launch.hypo.engine.install_run_hook``)."""
    return None if _ACTIVE is None else _ACTIVE.new_run(test, wrapped_test, settings, stuff)


def _no_example_in_a_world() -> None:
    if _ACTIVE is not None:
        raise ExampleInWorldError(
            f"hypothesis lockstep: {_ACTIVE.item.nodeid}: strategy.example() in a "
            "world test draws from this rank's own random state, so ranks get "
            "different values. Write the test with @given (on the test, or on an "
            "inner function it calls): those draws run in lockstep on every rank.")


# The pytest side ---------------------------------------------------------------------
class _Plugin:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.calls: dict[str, int] = {}
        self.profiles = _Profiles()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.profiles.remember()

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        self.profiles.restore()

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item):
        global _ACTIVE
        if "hypothesis" not in sys.modules:  # nothing in this process can draw
            return (yield)
        fn = engine.given_function(item)
        members = _members(item)
        layered = fn is not None and (members is not None
                                      or "world" in getattr(item, "fixturenames", ()))
        if layered:
            # NOTE: hypothesis' own pytest hook (inside this wrapper) fails a
            # @given test that takes the function-scoped `world` fixture; that
            # fixture is one value per test, so the check does not apply.
            engine.push(fn, "lockstep", settings=lambda cur: engine.multi_process_settings(
                cur, database=cur.database))
        if members is None:
            try:
                return (yield)
            finally:
                if layered:
                    engine.pop(fn, "lockstep")
        engine.install_run_hook(_start_run, _no_example_in_a_world)
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
            if layered:
                engine.pop(fn, "lockstep")
