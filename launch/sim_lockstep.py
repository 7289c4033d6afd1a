"""Lockstep Hypothesis across the threads of a simulated world.

Each rank thread runs its own Hypothesis engine over the same test function,
as each rank process does in a real world (``launch.given_lockstep``), and the
same rules keep them together: one seed for all ranks, no deadlines, timing
health checks or ``explain`` phase; after every example the ranks compare a
digest of what they drew and agree on the outcome, so a failure on any rank
is raised on every rank and all shrink along the same path; rank 0 reads the
example database and the others replay its reads.

The exchanges go through memory (a condition variable), not a store: the
ranks share the process. The test function's Hypothesis attributes are one
object for all threads, so they are set once per call (``with lock:``) and
the installed example wrapper finds the calling rank's state thread-locally.
"""

from __future__ import annotations

import functools
import hashlib
import random
import threading
import time
import traceback
from typing import Any

import pytest

__all__ = ["SimDivergence", "SimLockstep", "SimRankFailure"]

_TIMING_CHECKS = ("too_slow", "differing_executors", "function_scoped_fixture")


class SimDivergence(BaseException):
    """Ranks drew different examples (a BaseException: never shrunk)."""


class SimRankFailure(AssertionError):
    """An example failed on some rank; raised identically on every rank."""


class _Rendezvous:
    """Per-slot exchange of one payload per rank, in memory."""

    def __init__(self, n: int, timeout: float) -> None:
        self.n, self.timeout = n, timeout
        self.cond = threading.Condition()
        self.slots: dict[str, dict[int, Any]] = {}

    def post(self, slot: str, rank: int, payload: Any) -> None:
        with self.cond:
            self.slots.setdefault(slot, {})[rank] = payload
            self.cond.notify_all()

    def wait(self, slot: str, ranks: range | tuple, who: str) -> dict[int, Any]:
        end = time.monotonic() + self.timeout
        with self.cond:
            while True:
                got = self.slots.get(slot, {})
                if all(r in got for r in ranks):
                    return dict(got)
                left = end - time.monotonic()
                if left <= 0:
                    missing = [r for r in ranks if r not in got]
                    raise SimDivergence(f"simulated lockstep: {who}: rank(s) {missing} did "
                                        f"not report {slot} within {self.timeout:.0f}s")
                self.cond.wait(min(left, 1.0))


class _RankRun:
    """One rank's side of one lockstep call."""

    def __init__(self, lock: SimLockstep, rank: int) -> None:
        self.lock, self.rank, self.k, self.fetches = lock, rank, 0, 0

    def example(self, inner: Any, args: tuple, kwargs: dict) -> Any:
        from hypothesis.errors import UnsatisfiedAssumption

        __tracebackhide__ = True
        lock = self.lock
        drawn = {k: v for k, v in kwargs.items() if k in lock.given}
        draws: list[str] = []
        for v in drawn.values():
            _record_draws(v, draws)
        outcome, err, control, result = "pass", "", None, None
        try:
            result = inner(*args, **kwargs)
        except UnsatisfiedAssumption:
            outcome = "reject"
        except Exception as e:
            outcome = "fail"
            err = "".join(traceback.format_exception(type(e), e, e.__traceback__,
                                                     limit=-4))[-2500:]
        except BaseException as e:  # skip, exit, hypothesis control flow: re-raised
            outcome, control = "control", e
        text = "; ".join(t for t in (", ".join(f"{k}={v!r}" for k, v in sorted(drawn.items())
                                               if not _is_data(v)), *draws) if t)
        slot = f"ex{self.k}"
        self.k += 1
        got = lock.exchange(slot, self.rank, {"h": hashlib.sha1(text.encode()).hexdigest(),
                                              "o": outcome, "e": err, "x": text[:1500]})
        lock.check_same(got, slot)
        controls = [r for r in got if got[r]["o"] == "control"]
        if controls and len(controls) != lock.n:
            raise SimDivergence(f"simulated lockstep: {lock.item.nodeid}: {slot} stopped the "
                                f"test on rank(s) {controls} only. {lock.replay}")
        if control is not None:
            raise control
        failed = [r for r in sorted(got) if got[r]["o"] == "fail"]
        if failed:
            lines = [f"example failed on rank(s) {failed} of {list(range(lock.n))} "
                     f"(simulated world): {got[failed[0]]['x']}"]
            for r in failed[:4]:
                lines.append(f"----- rank {r} -----\n{got[r]['e'].rstrip()}")
            if len(failed) > 4:
                lines.append(f"(and {len(failed) - 4} more ranks)")
            lines.append(lock.replay)
            raise SimRankFailure("\n".join(lines))
        if any(got[r]["o"] == "reject" for r in got):
            raise UnsatisfiedAssumption()
        return result

    def fetch(self, key: bytes) -> Any:
        lock, slot = self.lock, f"db{self.fetches}"
        self.fetches += 1
        if self.rank == 0:
            values = list(lock.real_db.fetch(key)) if lock.real_db is not None else []
            lock.rv.post(slot, 0, values)
            return iter(values)
        return iter(lock.rv.wait(slot, (0,), lock.item.nodeid)[0])


_tls = threading.local()


def _db_class() -> type:
    from hypothesis.database import ExampleDatabase

    class ThreadDB(ExampleDatabase):
        """Rank 0: the real database; other ranks replay rank 0's reads, never write."""

        def __init__(self, real: Any) -> None:
            super().__init__()
            self.real = real

        def fetch(self, key: bytes):
            return _tls.run.fetch(key)

        def save(self, key: bytes, value: bytes) -> None:
            if _tls.run.rank == 0 and self.real is not None:
                self.real.save(key, value)

        def delete(self, key: bytes, value: bytes) -> None:
            if _tls.run.rank == 0 and self.real is not None:
                self.real.delete(key, value)

        def move(self, src: bytes, dest: bytes, value: bytes) -> None:
            if _tls.run.rank == 0 and self.real is not None:
                self.real.move(src, dest, value)

    return ThreadDB


class SimLockstep:
    """Lockstep for one call of a ``@given`` test on all rank threads.

    Example::

        lock = SimLockstep(item, n, timeout=300, replay="Replay: ...")
        with lock:
            world.run(lambda rank: lock.call_on_rank(rank, lambda: item.obj(**kw)))
    """

    def __init__(self, item: pytest.Item, n: int, timeout: float, replay: str,
                 max_examples: int | None = None) -> None:
        self.item, self.n, self.replay = item, n, replay
        self.max_examples = max_examples
        self.fn = getattr(item.obj, "__func__", item.obj)
        self.handle = self.fn.hypothesis
        self.given = set(getattr(self.handle, "_given_kwargs", {}) or {})
        self.rv = _Rendezvous(n, timeout)
        self.seed: int | None = None
        self.real_db: Any = None
        self.examples = 0  # examples rank 0 ran (all ranks run the same)

    def __enter__(self) -> SimLockstep:
        from hypothesis import HealthCheck, Phase, settings

        fn = self.fn
        self._saved = (self.handle.inner_test, fn._hypothesis_internal_use_seed,
                       fn._hypothesis_internal_use_settings)
        current = fn._hypothesis_internal_use_settings
        self.real_db = current.database
        forced = _forced_seed()
        if fn._hypothesis_internal_use_seed is None and (forced is not None
                                                         or not current.derandomize):
            self.seed = forced if forced is not None else random.SystemRandom().getrandbits(64)
            fn._hypothesis_internal_use_seed = self.seed
        checks = list(dict.fromkeys([*current.suppress_health_check,
                                     *(getattr(HealthCheck, c) for c in _TIMING_CHECKS)]))
        more = {"max_examples": self.max_examples} if self.max_examples else {}
        fn._hypothesis_internal_use_settings = settings(
            current, **more, deadline=None, database=_db_class()(self.real_db),
            suppress_health_check=checks,
            phases=[p for p in current.phases if p != Phase.explain])
        inner = self.handle.inner_test

        @functools.wraps(inner)
        def lockstep_inner(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            return _tls.run.example(inner, args, kwargs)

        self.handle.inner_test = lockstep_inner
        return self

    def __exit__(self, *exc: Any) -> None:
        inner, seed, st = self._saved
        self.handle.inner_test = inner
        self.fn._hypothesis_internal_use_seed = seed
        self.fn._hypothesis_internal_use_settings = st

    def exchange(self, slot: str, rank: int, payload: dict) -> dict[int, dict]:
        self.rv.post(slot, rank, payload)
        return self.rv.wait(slot, range(self.n), self.item.nodeid)

    def check_same(self, got: dict[int, dict], slot: str) -> None:
        ref = got[0]
        bad = [r for r in sorted(got) if got[r]["h"] != ref["h"]]
        if bad:
            r = bad[0]
            raise SimDivergence(
                f"simulated lockstep: {self.item.nodeid}: ranks diverged at {slot}; first "
                f"differing rank is {r}.\n  rank 0: {ref['x'] or '(test ended)'}\n"
                f"  rank {r}: {got[r]['x'] or '(test ended)'}\nExamples must not depend on "
                f"the rank. {self.replay}")

    def call_on_rank(self, rank: int, call: Any) -> Any:
        """Run the test (``call()``) as rank ``rank``, in lockstep with the others."""
        run = _tls.run = _RankRun(self, rank)
        try:
            result = call()
        except SimDivergence:
            raise
        except BaseException:
            self._finish(run)
            raise
        self._finish(run)
        return result

    def _finish(self, run: _RankRun) -> None:
        if run.rank == 0:
            self.examples += run.k
        got = self.exchange(f"ex{run.k}", run.rank, {"h": "END", "o": "end", "e": "",
                                                     "x": "(no further example)"})
        self.check_same(got, f"ex{run.k}")


def _is_data(v: Any) -> bool:
    return type(v).__name__ == "DataObject" and hasattr(v, "draw")


def _record_draws(v: Any, out: list[str]) -> None:
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
