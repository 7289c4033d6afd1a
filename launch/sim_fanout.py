"""Hypothesis in a simulated world: one engine, every example fanned out to
the rank threads.

A real world runs one Hypothesis engine per rank process and keeps them in
step (``launch.given_lockstep``). In a simulated world the ranks share one
interpreter, so the service runs **one** engine, on the main thread, and
hands each example to every rank thread (``SimWorld.run``): the ranks get the
same drawn values by construction, the engine's generation, shrinking and
database work is done once instead of n times, and nothing the engines
share (Python's ``random``, Hypothesis' caches) can make the ranks draw
different examples, which is what broke an engine-per-thread design.

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

Per example the ranks' outcomes are combined as a real world combines them:
a failure on any rank fails the example on all (one ``SimRankFailure`` naming
the ranks, their errors and the drawn values, which the engine then shrinks);
an assumption rejected anywhere rejects it; Hypothesis' own control flow
(end of data, skips) is re-raised to the engine.

Example (what ``launch.sim_mode`` does for a ``@given`` test)::

    with SimFanout(item, world, timeout=300, replay="Replay: ...",
                   rank_kwargs=per_rank) as fan:
        item.obj(**fixtures)          # Hypothesis runs here; bodies on the ranks
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import threading
import time
import traceback
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

# At module level, not in the functions: only simulated worlds import this
# module (after torch), and a function-level import costs ~0.7 us per call
# even when the module is loaded: the draw and copy paths run ~30 times per
# rank per example (~2.5 % of a simulated suite's CPU went to these lines).
from hypothesis.control import _current_build_context, current_build_context
from hypothesis.errors import UnsatisfiedAssumption
from hypothesis.internal.conjecture.data import ConjectureData

from launch.sim import SimWorld, on_wait, turn

__all__ = ["SimDivergence", "SimFanout", "SimRankFailure"]

_TIMING_CHECKS = ("too_slow", "differing_executors", "function_scoped_fixture")
_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), range)


class SimDivergence(BaseException):
    """Ranks did different things with one example (a BaseException: never shrunk)."""


class SimRankFailure(AssertionError):
    """An example failed on some rank of a simulated world."""


def _private(value: Any) -> Any:
    """A copy of a drawn value for one rank (a real rank draws its own object)."""
    if isinstance(value, _IMMUTABLE):
        return value
    if type(value) is tuple and all(isinstance(v, _IMMUTABLE) for v in value):
        return value
    fast = _copy_plain(value, {}, 0)
    if fast is not _SLOW:
        return fast
    try:
        return copy.deepcopy(value)
    except Exception:  # uncopyable: shared, as the engine's own object
        return value


_SLOW = object()  # _copy_plain's "not mine: deepcopy it"


def _copy_plain(value: Any, storages: dict, depth: int) -> Any:
    """``copy.deepcopy(value)`` for immutable scalars, plain dense tensors and
    tuples/lists of them, or ``_SLOW``. ``Tensor.__deepcopy__`` goes through
    typed-storage wrappers and ``copy``'s memo in Python: three times the
    cost, and drawn tensors were most of the copies (a copy per rank but one
    of every drawn value). Same result: each storage copied once per value
    (views drawn together stay views of one copy), offset, strides and
    ``requires_grad`` kept."""
    if isinstance(value, _IMMUTABLE):
        return value
    t = type(value)
    if t is torch.Tensor:
        if (value.layout != torch.strided or value.is_quantized or value.is_meta
                or value.grad is not None or value.is_conj() or value.is_neg()
                or value.__dict__ or value.grad_fn is not None):
            return _SLOW
        src = value.untyped_storage()
        key = src.data_ptr() if src.nbytes() else None
        storage = storages.get(key) if key is not None else None
        if storage is None and key is not None and value.storage_offset() == 0 \
                and src.nbytes() == value.numel() * value.element_size() \
                and value.is_contiguous():
            # It fills its storage alone (most drawn tensors): a clone has the
            # same strides and a storage of the same size; 1.3 us, where the
            # storage's Python clone and set_ below take 7.
            out = value.detach().clone()
            storages[key] = out.untyped_storage()  # a view drawn with it follows
            return out.requires_grad_() if value.requires_grad else out
        if storage is None:
            storage = src.clone()
            if key is not None:
                storages[key] = storage
        out = torch.empty(0, dtype=value.dtype, device=value.device).set_(
            storage, value.storage_offset(), value.size(), value.stride())
        if value.requires_grad:
            out.requires_grad_()
        return out
    if (t is tuple or t is list) and depth < 8:
        items = [_copy_plain(v, storages, depth + 1) for v in value]
        if any(v is _SLOW for v in items):
            return _SLOW
        if t is tuple and all(a is b for a, b in zip(items, value, strict=True)):
            return value  # as deepcopy: a tuple of shared values is itself shared
        return t(items)
    fields = _frozen_fields(t)
    if fields is None:
        return value if t in _ATOMIC else _SLOW
    # A frozen dataclass of values that need no copy (placements, layouts,
    # op cases) is itself one: shared, where deepcopy rebuilt it field by field.
    if depth < 8 and all(_copy_plain(getattr(value, f), storages, depth + 1)
                         is getattr(value, f) for f in fields):
        return value
    return _SLOW


_TORCH_ATOMIC: set = set()  # dtypes, devices, ops...: immutable, filled on first use
_ATOMIC: set = set()  # those, functions (deepcopy shares them) and enums seen
_FROZEN: dict = {}  # type -> its field names if a frozen dataclass, else None


def _torch_atomic() -> set:
    if not _TORCH_ATOMIC:
        _TORCH_ATOMIC.update((torch.dtype, torch.device, torch.layout, torch.memory_format,
                              types.BuiltinFunctionType, torch._ops.OpOverload,
                              torch._ops.OpOverloadPacket))
    return _TORCH_ATOMIC


def _frozen_fields(t: type) -> tuple[str, ...] | None:
    if t not in _FROZEN:
        if not _ATOMIC:
            _ATOMIC.update(_torch_atomic(), (types.FunctionType,))
        if issubclass(t, enum.Enum):
            _ATOMIC.add(t)
        params = getattr(t, "__dataclass_params__", None)
        _FROZEN[t] = (tuple(f.name for f in dataclasses.fields(t))
                      if params is not None and params.frozen else None)
    return _FROZEN[t]


_DRAWER = threading.local()  # entry: (shared draws, slot) while this thread draws
_COPY_WAIT_S = 0.25  # how long the others wait for a draw before replaying it


def _drawer_waits() -> None:
    """``launch.sim.on_wait`` hook: the drawing rank is about to wait for the
    others, which must then replay its draw (a collective strategy)."""
    entry = getattr(_DRAWER, "entry", None)
    if entry is not None:
        shared, slot = entry
        with shared.cond:
            slot.blocked = True
            shared.cond.notify_all()


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether a drawn value holds no rank state, so that a copy of it is what
    each rank would have drawn: immutable scalars, dtypes and devices, exact
    ``torch.Tensor`` objects (a subclass such as a DTensor holds a mesh),
    containers and dataclasses of those, functions without closures."""
    if depth > 20:
        return False
    t = type(value)
    if isinstance(value, _IMMUTABLE) or t is slice or t in _torch_atomic():
        return True
    if isinstance(value, enum.Enum):
        return True
    if t in (tuple, list, set, frozenset):
        return all(_plain(v, depth + 1) for v in value)
    if t is dict:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    if t is torch.Tensor:
        return True
    if t is types.FunctionType:
        return value.__closure__ is None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return all(_plain(getattr(value, f.name), depth + 1)
                   for f in dataclasses.fields(value))
    return False


def _is_data(v: Any) -> bool:
    return type(v).__name__ == "DataObject" and hasattr(v, "draw")


class _Slot:
    """The k-th ``data.draw`` of one example: drawn once, streamed to the others."""

    __slots__ = ("blocked", "done", "end", "error", "nodes", "plain", "same", "start", "text",
                 "value")

    def __init__(self, nodes: list, start: int) -> None:
        self.nodes, self.start = nodes, start  # the engine's choice list grows as it draws
        self.end = -1  # len(nodes) when the draw ended
        self.done = False
        self.error: BaseException | None = None
        self.text: str | int = ""  # the draw's number: its value's repr, made when needed
        self.value: Any = None
        self.plain = False  # the value holds no rank state: the others copy it
        self.same = False  # and its copy is the value itself (nothing mutable in it)
        self.blocked = False  # the drawer waits for the other ranks inside its draw


class _SharedDraws:
    """One ``st.data()`` object of one example, seen by all ranks.

    The first rank to reach its k-th draw draws from the engine; the others
    draw the same strategy (their own object, on their own thread) from the
    choices the engine makes, read as they appear. They must not wait for the
    whole draw: a strategy that builds a mesh is collective over its ranks,
    so the ranks' draws have to run side by side, as in a real world.
    """

    def __init__(self, real: Any, context: Any, n: int, timeout: float) -> None:
        self.real, self.context, self.timeout = real, context, timeout
        self.cond = threading.Condition()
        # Same lock, other waiters: only ranks replaying a draw wait for each
        # new choice. Waking the copying ranks on every choice too (3 ranks x
        # ~30 choices an example, each a futile wake-up and two thread
        # switches) was most of the simulated suite's ~240 context switches
        # per example.
        self.new_choice = threading.Condition(self.cond._lock)  # type: ignore[attr-defined]
        self.slots: list[_Slot] = []
        self.counts = [0] * n

    @property
    def texts(self) -> list[str]:
        return [f"draw {s.text}: {s.value!r}"[:300] if type(s.text) is int else s.text
                for s in self.slots if s.text]

    def for_rank(self, rank: int) -> _RankData:
        return _RankData(self, rank)

    def draw(self, rank: int, strategy: Any, label: Any) -> Any:
        with self.cond:
            k = self.counts[rank]
            self.counts[rank] += 1
            first = k == len(self.slots)
            if first:
                cd = self.real.conjecture_data
                if not isinstance(cd._nodes, _Announcing):
                    # Stays for the rest of the example: swapping it back after
                    # a draw raced the next draw's drawer, whose choices then
                    # went to a list nobody watched.
                    cd._nodes = _Announcing(cd._nodes, self.new_choice)
                nodes = cd._nodes
                slot = _Slot(nodes, len(nodes))
                self.slots.append(slot)
            else:
                slot = self.slots[k]
        if first:
            _DRAWER.entry = (self, slot)  # a wait for the others marks the slot blocked
            try:
                with _current_build_context.with_value(self.context):
                    value = self.real.draw(strategy, label)
                slot.value, slot.plain = value, _plain(value)
                if not slot.plain:
                    slot.text = f"draw {k + 1}: {value!r}"[:300]
                    return value
                # The drawer gets a copy too: the slot keeps the value as
                # drawn, printed only if the example fails (a tensor's repr
                # cost more than the copy, on every draw).
                slot.text = k + 1
                mine = _private(value)
                # Decided once per draw, not once per rank: walking a tuple of
                # placements or an op case to find nothing to copy was most
                # of the copies' cost (~4 % of a simulated suite's CPU).
                slot.same = mine is value
                return mine
            except BaseException as e:
                slot.error = e
                raise
            finally:
                _DRAWER.entry = None
                with self.cond:
                    slot.end, slot.done = len(slot.nodes), True
                    self.cond.notify_all()
                    self.new_choice.notify_all()
        # NOTE: a value that holds no rank state (numbers, shapes, placements,
        # plain tensors, frozen dataclasses of them) is copied from the
        # drawer's, as the engine's own arguments are (_private): replaying
        # the draw on every rank was most of a simulated example's time (a
        # third of the GIL's at 4 ranks). A draw that waits for the other
        # ranks (a mesh makes groups with all of them) or takes long is
        # replayed side by side as before, so nothing waits on itself.
        # The turn is given up only for a real wait: the drawer usually ran
        # first and is done, and a needless hand-off costs two thread switches.
        with self.cond:
            ready = slot.done or slot.blocked
        if not ready:
            with turn.waiting(), self.cond:
                self.cond.wait_for(lambda: slot.done or slot.blocked, timeout=_COPY_WAIT_S)
        with self.cond:
            copy_it = slot.done and slot.plain and slot.error is None
        if copy_it:
            return slot.value if slot.same else _private(slot.value)
        replay = ConjectureData(random=None, provider=_stream_provider()(self, slot))
        value = replay.draw(strategy)
        if not slot.done:  # the replay must use exactly the drawer's choices
            with turn.waiting(), self.cond:
                while not slot.done:
                    self.cond.wait(1.0)
        if slot.error is None and len(replay.nodes) != slot.end - slot.start:
            raise SimDivergence(f"rank {rank}'s draw {k + 1} made {len(replay.nodes)} "
                                f"choices, the engine's {slot.end - slot.start}")
        return value

    def next_choice(self, slot: _Slot, i: int) -> tuple[Any, int]:
        """The drawer's first unforced choice at or after offset ``i`` of
        ``slot`` (waiting for it to be made), and the offset after it. Forced
        choices are the strategy's own, made again by the replay."""
        end = time.monotonic() + self.timeout
        while True:
            with self.cond:
                stop = slot.end if slot.done else len(slot.nodes)
                while slot.start + i < stop and slot.nodes[slot.start + i].was_forced:
                    i += 1
                if slot.start + i < stop:
                    return slot.nodes[slot.start + i].value, i + 1
                if slot.done:
                    if slot.error is not None:
                        raise slot.error
                    raise SimDivergence(f"a replayed draw asked for choice {i + 1}; the "
                                        f"engine's draw made {slot.end - slot.start}")
                left = end - time.monotonic()
                if left <= 0:
                    raise SimDivergence("a replayed draw waited too long for the engine")
            # The turn is given up outside the lock (a rank holding the turn
            # may be about to take the lock); the choice may have come since.
            with turn.waiting(), self.cond:
                if not slot.done and slot.start + i >= len(slot.nodes):
                    self.new_choice.wait(min(left, 1.0))


class _Announcing(list):
    """The engine's choice list during a shared draw: each new choice wakes
    the ranks replaying it (polling instead costs the drawer the GIL)."""

    def __init__(self, items: list, cond: threading.Condition) -> None:
        super().__init__(items)
        self.cond = cond

    def append(self, node: Any) -> None:
        super().append(node)
        with self.cond:
            self.cond.notify_all()


_PROVIDER: list[type] = []


def _stream_provider() -> type:
    """A Hypothesis provider whose choices are another draw's, in order."""
    if _PROVIDER:
        return _PROVIDER[0]
    from hypothesis.internal.conjecture.providers import PrimitiveProvider

    class StreamProvider(PrimitiveProvider):
        lifetime = "test_case"

        def __init__(self, shared: _SharedDraws, slot: _Slot) -> None:
            super().__init__(None)
            self.shared, self.slot, self.i = shared, slot, 0

        def _next(self, *_: Any, **__: Any) -> Any:
            value, self.i = self.shared.next_choice(self.slot, self.i)
            return value

        draw_boolean = draw_integer = draw_float = draw_string = draw_bytes = _next

    _PROVIDER.append(StreamProvider)
    return StreamProvider


class _RankData:
    """What a rank's test body sees as its ``st.data()`` argument."""

    def __init__(self, shared: _SharedDraws, rank: int) -> None:
        self._shared, self._rank = shared, rank

    def draw(self, strategy: Any, label: Any = None) -> Any:
        return self._shared.draw(self._rank, strategy, label)

    def __repr__(self) -> str:
        return "data(...)"


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
        from hypothesis import HealthCheck, Phase, settings

        on_wait(_drawer_waits)

        fn = self.fn
        self._saved = (self.handle.inner_test, fn._hypothesis_internal_use_settings)
        current = fn._hypothesis_internal_use_settings
        checks = list(dict.fromkeys([*current.suppress_health_check,
                                     *(getattr(HealthCheck, c) for c in _TIMING_CHECKS)]))
        more = {"max_examples": self.max_examples} if self.max_examples else {}
        fn._hypothesis_internal_use_settings = settings(
            current, **more, deadline=None, suppress_health_check=checks,
            phases=[p for p in current.phases if p != Phase.explain])
        inner = self.handle.inner_test

        @functools.wraps(inner)
        def fanned_out(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            return self._example(inner, args, kwargs)

        self.handle.inner_test = fanned_out
        self.deadline = time.monotonic() + self.timeout
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.inner_test, self.fn._hypothesis_internal_use_settings = self._saved

    # -- one example ------------------------------------------------------------
    def _example(self, inner: Any, args: tuple, kwargs: dict) -> Any:
        __tracebackhide__ = True
        context = current_build_context()
        left = max(self.deadline - time.monotonic(), 1.0)
        shared = {k: _SharedDraws(v, context, self.n, left) for k, v in kwargs.items()
                  if k in self.given and _is_data(v)}
        drawn = {k: v for k, v in kwargs.items() if k in self.given and k not in shared}

        def on_rank(rank: int) -> Any:
            kw = self.rank_kwargs(rank, kwargs)
            if rank:
                kw.update((k, _private(v)) for k, v in drawn.items())
            kw.update((k, s.for_rank(rank)) for k, s in shared.items())
            try:
                with _current_build_context.with_value(context):
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

        hung = [o.rank for o in outs if o.hung]
        if hung:
            raise SimDivergence(f"{self.item.nodeid}: rank(s) {hung} of the simulated "
                                f"{self.n}-rank world hung on example: {texts()}. {self.replay}")
        for s in shared.values():
            off = [r for r, c in enumerate(s.counts) if c != s.counts[0]]
            if off and not any(o.error is not None for o in outs):
                raise SimDivergence(
                    f"{self.item.nodeid}: rank(s) {off} drew {[s.counts[r] for r in off]} "
                    f"values, rank 0 drew {s.counts[0]}: examples must not depend on the "
                    f"rank. {self.replay}")
        failed = [o for o in outs if isinstance(o.error, Exception) and not o.aborted
                  and not isinstance(o.error, UnsatisfiedAssumption)]
        if failed:
            lines = [f"example failed on rank(s) {[o.rank for o in failed]} of "
                     f"{list(range(self.n))} (simulated world): {texts()}"]
            for o in failed[:4]:
                err = o.error
                tb = "".join(traceback.format_exception(type(err), err, err.__traceback__,
                                                        limit=-4))[-2500:]
                lines.append(f"----- rank {o.rank} -----\n{tb.rstrip()}")
            if len(failed) > 4:
                lines.append(f"(and {len(failed) - 4} more ranks)")
            lines.append(self.replay)
            raise SimRankFailure("\n".join(lines)) from failed[0].error
        control = [o for o in outs if o.error is not None and not isinstance(o.error, Exception)]
        if control:
            raise control[0].error
        if any(isinstance(o.error, UnsatisfiedAssumption) for o in outs):
            raise UnsatisfiedAssumption()
        aborted = [o for o in outs if o.error is not None]
        if aborted:  # released from a collective with no failure anywhere
            raise SimDivergence(f"{self.item.nodeid}: rank(s) {[o.rank for o in aborted]} "
                                f"were released from a collective: {aborted[0].error}. "
                                f"{self.replay}")
        return outs[0].value
