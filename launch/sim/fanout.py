"""Hypothesis in a simulated world: one engine, every example fanned out to
the rank threads.

A real world runs one Hypothesis engine per rank process and keeps them in
step (``launch.hypo.lockstep``). In a simulated world the ranks share one
interpreter, so the service runs **one** engine, on the main thread, and
hands each example to every rank thread (``SimWorld.run``): the ranks get the
same drawn values by construction, the engine's generation, shrinking and
database work is done once instead of n times, and nothing the engines
share (Python's ``random``, Hypothesis' caches) can make the ranks draw
different examples (an engine per rank thread would).

The engine runs with the settings a real rank's engine gets (no deadline,
no timing health checks, no ``explain`` phase), so a derandomized run draws
the same example sequence simulated and real, hence gives the same verdicts.

Draws made inside the test body (``st.data()``) are shared too: the first
rank to reach its k-th draw draws it from the engine (under a lock, with the
engine's build context). A value that holds no rank state (numbers, shapes,
dtypes, placements, plain tensors, containers and frozen dataclasses of
them) is copied to every rank, the drawer included (the slot keeps the value
as drawn, for the failure report). Any other value (a mesh holds its rank's
groups), and any draw during which the drawer waits for the other ranks (a
strategy that makes a group or runs a collective), is replayed instead: the
others draw the same strategy through their own object on their own thread
from the choices the engine makes, so each rank builds its own value, as
each real rank does. A rank that draws more or fewer times than rank 0 is
reported as a divergence. Examples must not depend on the rank: a strategy
that reads the rank while drawing a plain value (``st.builds(dist.get_rank)``)
gives every simulated rank the drawer's value.

Per example the ranks' outcomes are combined as a real world combines them
(``launch.agree.example_verdict``): a failure on any rank fails the example
on all (one ``RankFailure`` naming the ranks, their errors and the drawn
values, which the engine then shrinks); an assumption rejected anywhere
rejects it; Hypothesis' own control flow (end of data, skips) on every rank
is re-raised to the engine, on some ranks only it is a divergence.

Example (what ``launch.modes.simulated`` does for a ``@given`` test)::

    with SimFanout(item, world, timeout=300, replay="Replay: ...",
                   rank_kwargs=per_rank) as fan:
        item.obj(**fixtures)          # Hypothesis runs here; bodies on the ranks
"""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis.control import _current_build_context, current_build_context
from hypothesis.errors import UnsatisfiedAssumption

from launch.agree import LockstepDivergence, RankFailure, example_verdict
from launch.hypo import engine
from launch.hypo.engine import is_data
from launch.sim.copies import plain, private
from launch.sim.draws import SharedDraws, drawer_waits
from launch.sim.turn import on_wait
from launch.sim.world import SimWorld

__all__ = ["SimFanout"]


class SimFanout:
    """Runs one ``@given`` test's engine here, its examples on ``world``'s ranks.

    ``rank_kwargs(rank, kwargs)`` gives the keyword arguments of one rank's
    call (e.g. its own ``world`` fixture value); drawn values are copied per
    rank by the fan-out itself.
    """

    def __init__(self, item: pytest.Item, world: Any, timeout: float, replay: str,
                 rank_kwargs: Callable[[int, dict], dict],
                 max_examples: int | None = None) -> None:
        self.item, self.world, self.n, self.replay = item, world, world.n, replay
        self.timeout, self.rank_kwargs, self.max_examples = timeout, rank_kwargs, max_examples
        self.fn = getattr(item.obj, "__func__", item.obj)
        self.handle = self.fn.hypothesis
        self.given = set(getattr(self.handle, "_given_kwargs", {}) or {})
        self.examples = 0
        self.deadline = 0.0

    def __enter__(self) -> SimFanout:
        on_wait(drawer_waits)
        more = {"max_examples": self.max_examples} if self.max_examples else {}

        def fan_out(inner: Any) -> Any:
            @functools.wraps(inner)
            def fanned_out(*args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                return self._example(inner, args, kwargs)

            return fanned_out

        engine.push(self.fn, "fanout", inner=fan_out,
                    settings=lambda cur: engine.multi_process_settings(cur, **more))
        self.deadline = time.monotonic() + self.timeout
        return self

    def __exit__(self, *exc: Any) -> None:
        engine.pop(self.fn, "fanout")

    def _redraw(self, choices: list, names: list[str]) -> dict[str, Any]:
        """The given arguments ``names`` drawn on this thread from ``choices``
        (the engine draws every given argument first, in this order)."""
        from hypothesis import strategies as st
        from hypothesis.control import BuildContext
        from hypothesis.internal.conjecture.data import ConjectureData

        data = ConjectureData.for_choices(choices)
        given = dict(self.handle._given_kwargs)
        with _current_build_context.with_value(
                BuildContext(data, wrapped_test=current_build_context().wrapped_test)):
            values = data.draw(st.fixed_dictionaries(given))
        return {k: values[k] for k in names}

    # -- one example ------------------------------------------------------------
    def _example(self, inner: Any, args: tuple, kwargs: dict) -> Any:
        __tracebackhide__ = True
        context = current_build_context()
        left = max(self.deadline - time.monotonic(), 1.0)
        shared = {k: SharedDraws(v, context, self.n, left) for k, v in kwargs.items()
                  if k in self.given and is_data(v)}
        drawn = {k: v for k, v in kwargs.items() if k in self.given and k not in shared}
        # An argument that holds rank state (a mesh: its groups are the
        # drawing thread's) is drawn again on every rank thread from the
        # engine's choices, as each real rank draws its own.
        own = [k for k, v in drawn.items() if not plain(v)]
        choices = [n.value for n in context.data.nodes] if own else []

        def on_rank(rank: int) -> Any:
            kw = self.rank_kwargs(rank, kwargs)
            if rank:
                kw.update((k, private(v)) for k, v in drawn.items() if k not in own)
            kw.update((k, s.for_rank(rank)) for k, s in shared.items())
            try:
                with _current_build_context.with_value(context):
                    if own:
                        kw.update(self._redraw(choices, own))
                    return inner(*args, **kw)
            except (Exception, SystemExit):
                raise
            except BaseException as e:
                # Control flow (end of data, a skip) on one rank must not leave
                # the others waiting for it in a collective.
                SimWorld._release(e)
                raise

        outs = self.world.run(on_rank, left)
        self.examples += 1

        def texts() -> str:  # only for a report: reprs of tensors are slow
            return "; ".join(t for t in (
                ", ".join(f"{k}={v!r}" for k, v in sorted(drawn.items())),
                *(t for s in shared.values() for t in s.texts)) if t)[:1500]

        for s_ in shared.values():
            off = [r for r, c in enumerate(s_.counts) if c != s_.counts[0]]
            if off and not any(o.error is not None or o.hung for o in outs):
                raise LockstepDivergence(
                    f"{self.item.nodeid}: rank(s) {off} drew {[s_.counts[r] for r in off]} "
                    f"values, rank 0 drew {s_.counts[0]}: examples must not depend on the "
                    f"rank. {self.replay}")
        kind, ranks = example_verdict({o.rank: _outcome(o) for o in outs})
        by_rank = {o.rank: o for o in outs}
        if kind == "diverged":
            o = by_rank[ranks[0]]
            why = ("hung on example" if o.hung else
                   f"were released from a collective: {o.error}" if o.aborted else
                   "stopped the test (skip/exit/interrupt) only, on example")
            raise LockstepDivergence(f"{self.item.nodeid}: rank(s) {ranks} of the simulated "
                                     f"{self.n}-rank world {why}: {texts()}. {self.replay}")
        if kind == "failed":
            failed = [by_rank[r] for r in ranks]
            lines = [f"example failed on rank(s) {ranks} of "
                     f"{list(range(self.n))} (simulated world): {texts()}"]
            for o in failed[:4]:
                err = o.error
                tb = "".join(traceback.format_exception(type(err), err, err.__traceback__,
                                                        limit=-4))[-2500:]
                lines.append(f"----- rank {o.rank} -----\n{tb.rstrip()}")
            if len(failed) > 4:
                lines.append(f"(and {len(failed) - 4} more ranks)")
            lines.append(self.replay)
            raise RankFailure("\n".join(lines)) from failed[0].error
        if kind == "control":
            raise by_rank[ranks[0]].error
        if kind == "rejected":
            raise UnsatisfiedAssumption()
        return outs[0].value


def _outcome(o: Any) -> str:
    """One rank's outcome of one example, for ``launch.agree.example_verdict``."""
    if o.hung:
        return "hung"
    if o.error is None:
        return "pass"
    if o.aborted:
        return "released"
    if isinstance(o.error, UnsatisfiedAssumption):
        return "reject"
    return "fail" if isinstance(o.error, Exception) else "control"
