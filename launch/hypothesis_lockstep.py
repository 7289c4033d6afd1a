"""Lockstep Hypothesis: every rank of a distributed test draws the same examples.

A pytest plugin (load it with ``-p launch.hypothesis_lockstep`` or from the root
conftest's ``pytest_plugins``). For each ``@given`` test that runs on more than
one rank it:

- gives every rank the same seed: the source digest under ``derandomize``
  (the ``ci`` profile), else one seed chosen by rank 0 (or
  ``--hypothesis-seed``) and shared over the c10d store;
- turns off what differs between processes: deadlines, timing health checks,
  the ``explain`` phase; only rank 0 reads and writes the example database,
  and the other ranks replay what rank 0 read from it;
- after every example, compares a digest of the drawn arguments across the
  test's ranks (a divergence raises on every rank, naming the first differing
  rank and both examples, and is never shrunk) and agrees on the outcome, over
  a ``PrefixStore`` of the default store, never the process group (a failed
  example may have left the group mid-collective). If any rank failed, every
  rank raises the same ``RankFailure``, so Hypothesis shrinks along the same
  path everywhere; the failure names the ranks, their errors, and the command
  that replays it.

It also registers the profiles ``ci``, ``dev`` and ``fuzz`` (pick one with
``--hypothesis-profile``). Other plugins add to the ``Replay:`` line through
the ``pytest_lockstep_replay_args(config)`` hook (``NAME=value`` entries go
before the command, others after it). Heavy imports happen inside hooks
only; it never imports ``dtensor`` (the property suite's own glue is
``tests/properties/conftest.py``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import traceback
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import ExampleDatabase

__all__ = ["LockstepDivergence", "RankFailure"]

_TIMING_CHECKS = [HealthCheck.too_slow, HealthCheck.differing_executors,
                  HealthCheck.function_scoped_fixture]
_PHASES = tuple(p for p in Phase if p != Phase.explain)

settings.register_profile(
    "ci", derandomize=True, deadline=None, database=None, print_blob=True,
    max_examples=25, suppress_health_check=_TIMING_CHECKS, phases=_PHASES)
settings.register_profile(
    "dev", deadline=None, print_blob=True, max_examples=40,
    suppress_health_check=_TIMING_CHECKS, phases=_PHASES)
settings.register_profile(
    "fuzz", deadline=None, print_blob=True, max_examples=2000,
    suppress_health_check=_TIMING_CHECKS, phases=_PHASES)


class LockstepDivergence(BaseException):
    """Ranks drew different examples: Hypothesis must not shrink this (it is
    a BaseException so Hypothesis lets it through)."""


class RankFailure(AssertionError):
    """An example failed on some rank; raised identically on every rank."""


# Options and hooks --------------------------------------------------------------
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
    config.pluginmanager.register(_Lockstep(config), "hypothesis-lockstep")


# The lockstep wrapper ------------------------------------------------------------
def _members(item: pytest.Item) -> tuple[int, ...] | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    size = dist.get_world_size()
    m = item.get_closest_marker("world_size")
    n = (m.args[0] if m and m.args else size) if m else size
    n = min(int(n), size)
    return tuple(range(n)) if n > 1 else None


class _MirrorDB(ExampleDatabase):
    """Rank 0: the real database, publishing every fetch to the store.
    Other ranks: replay rank 0's fetches in order; never write."""

    def __init__(self, real: ExampleDatabase | None, store: Any, rank: int,
                 timeout: timedelta) -> None:
        super().__init__()
        self.real, self.store, self.rank, self.timeout = real, store, rank, timeout
        self.n = 0

    def fetch(self, key: bytes):
        slot = f"db/{self.n}"
        self.n += 1
        if self.rank == 0:
            values = list(self.real.fetch(key)) if self.real is not None else []
            self.store.set(slot, json.dumps([v.hex() for v in values]))
            return iter(values)
        self.store.wait([slot], self.timeout)
        return iter(bytes.fromhex(v) for v in json.loads(self.store.get(slot)))

    def save(self, key: bytes, value: bytes) -> None:
        if self.rank == 0 and self.real is not None:
            self.real.save(key, value)

    def delete(self, key: bytes, value: bytes) -> None:
        if self.rank == 0 and self.real is not None:
            self.real.delete(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        if self.rank == 0 and self.real is not None:
            self.real.move(src, dest, value)


class _Run:
    """One call of one ``@given`` test on one rank."""

    def __init__(self, item: pytest.Item, members: tuple[int, ...], inv: int,
                 timeout: float) -> None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        self.item, self.members = item, members
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        tk = hashlib.sha1(item.nodeid.encode()).hexdigest()[:16]
        self.store = dist.PrefixStore(f"hyplock/{tk}/{inv}/", _get_default_store())
        self.timeout = timedelta(seconds=timeout)
        self.fn = getattr(item.obj, "__func__", item.obj)
        self.handle = self.fn.hypothesis
        self.given = set(getattr(self.handle, "_given_kwargs", {}) or {})
        self.k = 0
        self.seed: int | None = None
        self.profile = settings._current_profile or "default"

    # -- setup / teardown --------------------------------------------------------
    def install(self) -> None:
        fn = self.fn
        self._saved = (self.handle.inner_test, fn._hypothesis_internal_use_seed,
                       fn._hypothesis_internal_use_settings)
        current = fn._hypothesis_internal_use_settings
        forced = _forced_seed()
        if fn._hypothesis_internal_use_seed is None and (forced is not None
                                                         or not current.derandomize):
            if self.rank == 0:
                seed = forced if forced is not None else random.SystemRandom().getrandbits(64)
                self.store.set("seed", str(seed))
            self.store.wait(["seed"], self.timeout)
            self.seed = int(self.store.get("seed"))
            fn._hypothesis_internal_use_seed = self.seed
        db = _MirrorDB(current.database, self.store, self.rank, self.timeout)
        checks = list(dict.fromkeys([*current.suppress_health_check, *_TIMING_CHECKS]))
        fn._hypothesis_internal_use_settings = settings(
            current, deadline=None, database=db, suppress_health_check=checks,
            phases=[p for p in current.phases if p != Phase.explain])
        inner = self.handle.inner_test

        @functools.wraps(inner)
        def lockstep_inner(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            return self.example(inner, args, kwargs)

        self.handle.inner_test = lockstep_inner

    def uninstall(self) -> None:
        inner, seed, st = self._saved
        self.handle.inner_test = inner
        self.fn._hypothesis_internal_use_seed = seed
        self.fn._hypothesis_internal_use_settings = st

    # -- one example -----------------------------------------------------------------
    def example(self, inner: Any, args: tuple, kwargs: dict) -> Any:
        from hypothesis.errors import UnsatisfiedAssumption

        __tracebackhide__ = True
        drawn = {k: v for k, v in kwargs.items() if k in self.given}
        draws: list[str] = []
        for v in drawn.values():
            _record_draws(v, draws)
        text = ", ".join(f"{k}={v!r}" for k, v in sorted(drawn.items())
                         if not _is_data(v))
        outcome, err, control, result = "pass", "", None, None
        try:
            result = inner(*args, **kwargs)
        except UnsatisfiedAssumption:
            outcome = "reject"
        except Exception as e:
            outcome = "fail"
            tb = traceback.format_exception(type(e), e, e.__traceback__, limit=-4)
            err = "".join(tb)[-2500:]
        except BaseException as e:  # skip, exit, hypothesis control flow: re-raised
            outcome, control = "control", e
        # The example is what was drawn: the given arguments and every
        # data.draw() of an st.data() argument.
        text = "; ".join([t for t in (text, *draws) if t])
        digest = hashlib.sha1(text.encode()).hexdigest()
        slot = str(self.k)
        self.k += 1
        got = self.exchange(slot, {"h": digest, "o": outcome, "e": err, "x": text[:1500]})
        self.check_same(got, slot, digest, text)
        controls = [r for r in self.members if got[r]["o"] == "control"]
        if controls and len(controls) != len(self.members):
            raise LockstepDivergence(
                f"hypothesis lockstep: {self.item.nodeid}: example #{slot} stopped the "
                f"test (skip/exit/interrupt) on rank(s) {controls} only. "
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
        """After the test: every rank must stop after the same example."""
        got = self.exchange(str(self.k), {"h": "END", "o": "end", "e": "", "x": ""})
        self.check_same(got, str(self.k), "END", "(no further example)")

    # -- store exchange ----------------------------------------------------------------
    def exchange(self, slot: str, payload: dict) -> dict[int, dict]:
        self.store.set(f"{slot}/{self.rank}", json.dumps(payload))
        keys = [f"{slot}/{r}" for r in self.members]
        try:
            self.store.wait(keys, self.timeout)
        except Exception:
            missing = [r for r in self.members if not self.store.check([f"{slot}/{r}"])]
            raise LockstepDivergence(
                f"hypothesis lockstep: {self.item.nodeid}: rank(s) {missing} did not "
                f"report example #{slot} within {self.timeout.total_seconds():.0f}s "
                f"(rank {self.rank} did). {self.replay_hint()}") from None
        vals = self.store.multi_get(keys)
        if slot.isdigit() and int(slot) > 0:
            # Every rank has written this slot, so all have read the previous
            # one: drop our key of it (long fuzzing runs would fill the store).
            self.store.delete_key(f"{int(slot) - 1}/{self.rank}")
        return {r: json.loads(v) for r, v in zip(self.members, vals, strict=True)}

    def check_same(self, got: dict[int, dict], slot: str, digest: str, text: str) -> None:
        ref = got[self.members[0]]
        bad = [r for r in self.members if got[r]["h"] != ref["h"]]
        if not bad:
            return
        r = bad[0]
        raise LockstepDivergence(
            f"hypothesis lockstep: {self.item.nodeid}: ranks diverged at example "
            f"#{slot}; first differing rank is {r}.\n"
            f"  rank {self.members[0]}: {ref['x'] or '(test ended)'}\n"
            f"  rank {r}: {got[r]['x'] or '(test ended)'}\n"
            "Examples must not depend on the rank (draw from strategies only, never "
            f"from rank-local state). {self.replay_hint()}")

    def failure_text(self, got: dict[int, dict], failed: list[int]) -> str:
        lines = [f"example failed on rank(s) {failed} of {list(self.members)}: "
                 f"{got[failed[0]]['x']}"]
        for r in failed:
            lines.append(f"----- rank {r} -----\n{got[r]['e'].rstrip()}")
        lines.append(self.replay_hint())
        return "\n".join(lines)

    def replay_hint(self) -> str:
        config = self.item.config
        extra = [w for ws in config.hook.pytest_lockstep_replay_args(config=config) for w in ws]
        env = [w for w in extra if "=" in w and not w.startswith("-")]
        cmd = [*env, "torchrun", f"--nproc_per_node={self.world}", "-m", "pytest",
               "-p", "launch.hypothesis_lockstep", f"'{self.item.nodeid}'",
               f"--hypothesis-profile={self.profile}"]
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
        out.append(f"draw {len(out) + 1}: {value!r}")
        return value

    v.draw = recording_draw


def _forced_seed() -> int | None:
    from hypothesis import core

    seed = getattr(core, "global_force_seed", None)
    if seed is None:
        return None
    try:
        return int(seed)
    except (TypeError, ValueError):
        return int(hashlib.sha1(str(seed).encode()).hexdigest()[:16], 16)


class _Lockstep:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.calls: dict[str, int] = {}

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        fn = getattr(getattr(item, "obj", None), "__func__", getattr(item, "obj", None))
        if not getattr(fn, "is_hypothesis_test", False):
            return (yield)
        members = _members(item)
        if members is None:
            return (yield)
        import torch.distributed as dist

        if dist.get_rank() not in members:
            return (yield)
        inv = self.calls[item.nodeid] = self.calls.get(item.nodeid, 0) + 1
        run = _Run(item, members, inv, self.config.getoption("lockstep_timeout"))
        run.install()
        try:
            result = yield
        except BaseException:
            run.uninstall()
            run.finish()
            raise
        run.uninstall()
        run.finish()
        return result

