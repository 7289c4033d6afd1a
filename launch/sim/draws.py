"""Draws inside a simulated test body (``st.data()``), shared by the ranks.

The first rank to reach its k-th draw draws it from the engine (under a
lock, with the engine's build context). A value that holds no rank state is
copied to every rank (``launch.sim.copies``); any other value, and any draw
during which the drawer waits for the other ranks (a strategy that makes a
group or runs a collective), is replayed instead: the others draw the same
strategy through their own object on their own thread from the choices the
engine makes, so each rank builds its own value, as each real rank does.
"""

from __future__ import annotations

import threading
import time
from typing import Any

# At module level, not in the functions: only simulated worlds import this
# module (after torch), and a function-level import costs ~0.7 us per call
# even when the module is loaded: the draw path runs ~30 times per rank per
# example.
from hypothesis.control import _current_build_context
from hypothesis.internal.conjecture.data import ConjectureData

from launch.agree import LockstepDivergence
from launch.sim.copies import plain, private
from launch.sim.turn import turn

__all__ = ["RankData", "SharedDraws", "drawer_waits"]

_DRAWER = threading.local()  # entry: (shared draws, slot) while this thread draws
_COPY_WAIT_S = 0.25  # how long the others wait for a draw before replaying it


def drawer_waits() -> None:
    """``launch.sim.turn.on_wait`` hook: the drawing rank is about to wait for the
    others, which must then replay its draw (a collective strategy)."""
    entry = getattr(_DRAWER, "entry", None)
    if entry is not None:
        shared, slot = entry
        with shared.cond:
            slot.blocked = True
            shared.cond.notify_all()


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


class SharedDraws:
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
        # new choice: waking the copying ranks on every choice too would cost
        # a futile wake-up and two thread switches per rank and choice.
        self.new_choice = threading.Condition(self.cond._lock)  # type: ignore[attr-defined]
        self.slots: list[_Slot] = []
        self.counts = [0] * n

    @property
    def texts(self) -> list[str]:
        return [f"draw {s.text}: {s.value!r}"[:300] if type(s.text) is int else s.text
                for s in self.slots if s.text]

    def for_rank(self, rank: int) -> RankData:
        return RankData(self, rank)

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
                slot.value, slot.plain = value, plain(value)
                if not slot.plain:
                    slot.text = f"draw {k + 1}: {value!r}"[:300]
                    return value
                # The drawer gets a copy too: the slot keeps the value as
                # drawn, printed only if the example fails (a tensor's repr
                # cost more than the copy, on every draw).
                slot.text = k + 1
                mine = private(value)
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
        # replayed side by side on every rank, so nothing waits on itself.
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
            return slot.value if slot.same else private(slot.value)
        replay = ConjectureData(random=None, provider=_stream_provider()(self, slot))
        value = replay.draw(strategy)
        if not slot.done:  # the replay must use exactly the drawer's choices
            with turn.waiting(), self.cond:
                while not slot.done:
                    self.cond.wait(1.0)
        if slot.error is None and len(replay.nodes) != slot.end - slot.start:
            raise LockstepDivergence(f"rank {rank}'s draw {k + 1} made {len(replay.nodes)} "
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
                    raise LockstepDivergence(f"a replayed draw asked for choice {i + 1}; the "
                                        f"engine's draw made {slot.end - slot.start}")
                left = end - time.monotonic()
                if left <= 0:
                    raise LockstepDivergence("a replayed draw waited too long for the engine")
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

        def __init__(self, shared: SharedDraws, slot: _Slot) -> None:
            super().__init__(None)
            self.shared, self.slot, self.i = shared, slot, 0

        def _next(self, *_: Any, **__: Any) -> Any:
            value, self.i = self.shared.next_choice(self.slot, self.i)
            return value

        draw_boolean = draw_integer = draw_float = draw_string = draw_bytes = _next

    _PROVIDER.append(StreamProvider)
    return StreamProvider


class RankData:
    """What a rank's test body sees as its ``st.data()`` argument."""

    def __init__(self, shared: SharedDraws, rank: int) -> None:
        self._shared, self._rank = shared, rank

    def draw(self, strategy: Any, label: Any = None) -> Any:
        return self._shared.draw(self._rank, strategy, label)

    def __repr__(self) -> str:
        return "data(...)"
