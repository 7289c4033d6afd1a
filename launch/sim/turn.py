"""The turn: which rank thread of a simulated world runs, one at a time.

A rank thread holds the turn while it runs Python and gives it up only where
it waits for the other ranks (a collective, a group's barrier, a shared draw,
the end of its task), so a rank runs until it needs the others, as a real
rank does. ``on_wait`` lets a layer above (the example fan-out) learn that a
rank is about to wait for the others.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator

__all__ = ["on_wait", "turn"]

_WAIT_HOOKS: list[Callable[[], None]] = []


def on_wait(hook: Callable[[], None]) -> None:
    """Call ``hook()`` on a rank thread right before it waits for the other
    ranks (a collective, or the barrier that makes a process group).

    ``launch.sim.fanout`` uses it to learn that a rank drawing a value is
    blocked on the others (a strategy that builds a mesh), so they must run
    their own draws side by side instead of waiting for its value.
    """
    if not callable(hook):
        raise TypeError(f"on_wait: expected a callable taking no arguments, got {hook!r}")
    if hook not in _WAIT_HOOKS:
        _WAIT_HOOKS.append(hook)


def _waiting() -> None:
    for hook in _WAIT_HOOKS:
        hook()


class _Waiter:
    """One thread's place in the turn's queue: woken only when handed the turn.

    ``wake`` is a bare lock held while nobody hands this thread the turn: the
    hand-over releases it, the thread's wait acquires it. Every wait for the
    other ranks is a hand-over (thousands per test at 512 ranks), and
    ``threading.Event`` spends most of one in Python (a condition, a fresh
    lock per wait).
    """

    __slots__ = ("clock", "granted", "parked", "wake")

    def __init__(self) -> None:
        self.wake = _thread.allocate_lock()
        self.wake.acquire()
        self.granted = False  # handed the turn, not yet noticed
        self.parked = False  # waits for other ranks (a collective, a task), not for the turn
        self.clock = _cpu_clock()  # this thread's CPU clock, where the platform has one

    def cpu(self) -> float | None:
        """CPU seconds this thread has run, or None where unknown."""
        if self.clock is None:
            return None
        try:
            return time.clock_gettime(self.clock)
        except OSError:
            return None


def _cpu_clock() -> int | None:
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):  # not a POSIX platform with per-thread clocks
        return None


class _Turn:
    """Which rank thread runs: one at a time, until it waits for the others.

    Every torch op gives up the GIL while its kernel runs, so runnable rank
    threads would otherwise trade the GIL op by op (hundreds of thread
    switches per example, the waiting threads spinning on another core).
    The turn is held while a rank runs Python and given up only where it
    waits for another rank (a collective, a group's barrier, a shared draw,
    the end of its task), so a rank runs until it needs the others, as a
    real rank does.

    The turn goes from hand to hand: ``give`` wakes exactly the next thread
    in line (first come, first served), and a thread whose wait for the
    other ranks ends (``unpark``: a collective done, a task posted) joins
    the line without being woken; waking every waiter to race for a lock
    would cost several thread switches per rank and collective.

    A thread first in line that waits ``_TURN_WAIT_S`` while no thread gets
    the turn, and the holder's thread did not run meanwhile, runs without
    it: a wait this module does not know of (a store read inside torch)
    costs that long at worst, never a hang. ``missed`` counts them. A holder
    that runs keeps the turn (up to ``_BUSY_MAX_S`` without a hand-over). Threads further back check only every ``_LINE_POLL_S``:
    a long line polling often (1,024 ranks) would starve the holder of the
    GIL, so that no thread would see a hand-off and all would run without
    the turn.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: _Waiter | None = None
        self._line: collections.deque[_Waiter] = collections.deque()
        self._mine = threading.local()
        self.missed = 0
        self.handoffs = 0  # turns taken: a wait is over only while nobody gets one

    def me(self) -> _Waiter:
        """This thread's waiter."""
        w = getattr(self._mine, "w", None)
        if w is None:
            w = self._mine.w = _Waiter()
        return w

    def _hand(self, w: _Waiter) -> None:  # under _lock
        self._holder = w
        self.handoffs += 1
        w.granted = True
        w.wake.release()

    def take(self) -> None:
        w = self.me()
        with self._lock:
            if self._holder is w:
                return
            if self._holder is None:
                self._holder = w
                self.handoffs += 1
                return
            self._line.append(w)
        self._await(w, None)

    def give(self) -> None:
        w = self.me()
        with self._lock:
            if self._holder is not w:
                return
            if self._line:
                self._hand(self._line.popleft())
            else:
                self._holder = None

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a wait for other ranks: they run meanwhile."""
        self.give()
        try:
            yield
        finally:
            self.take()

    def park(self) -> _Waiter:
        """Mark this thread as waiting for the others; ``unpark`` ends it."""
        w = self.me()
        w.parked = True
        return w

    def unpark(self, waiters: Iterable[_Waiter]) -> None:
        """Their waits are over: they join the line (the first is handed a
        free turn), each woken only when its turn comes."""
        with self._lock:
            for w in waiters:
                if w.parked:
                    w.parked = False
                    self._line.append(w)
            if self._holder is None and self._line:
                self._hand(self._line.popleft())

    def wait_parked(self, w: _Waiter, released: Callable[[], bool]) -> None:
        """Give the turn up, then sleep until unparked and handed the turn
        (or, parked still, until ``released()``: then without the turn)."""
        self.give()
        self._await(w, released)

    def _await(self, w: _Waiter, released: Callable[[], bool] | None) -> None:
        busy_since = None
        while True:
            seen = self.handoffs
            holder = self._holder
            spent = None if holder is None else holder.cpu()
            if w.parked:
                w.wake.acquire(True, _PARKED_POLL_S)
            else:  # NOTE: read without the lock; a stale answer costs one poll
                line = self._line
                w.wake.acquire(True, _TURN_WAIT_S if line and line[0] is w else _LINE_POLL_S)
            with self._lock:
                if w.granted:
                    w.granted = False
                    w.wake.acquire(False)  # the hand-over came after the wait timed out
                    return
                if w.parked:
                    if released is not None and released():
                        w.parked = False
                        return
                    continue
                if self.handoffs == seen:  # nobody got the turn meanwhile
                    # A holder that ran meanwhile is working, not waiting for
                    # a rank: a long step (building a big cached table, an
                    # import) would otherwise let the line run beside it, each
                    # repeating the step while fighting over the GIL (minutes
                    # at 1,024 ranks). Only a holder that stood still, or one
                    # busy past _BUSY_MAX_S (a spin on something only another
                    # rank does), lets this thread run without the turn.
                    now = None if spent is None else holder.cpu()
                    if now is not None and now - spent > _RAN_S and holder is self._holder:
                        busy_since = busy_since or time.monotonic()
                        if time.monotonic() - busy_since < _BUSY_MAX_S:
                            continue
                    self._line.remove(w)
                    self.missed += 1
                    return
                busy_since = None


_TURN_WAIT_S = 0.05
_RAN_S = 0.002  # CPU time the holder must have run in one wait to count as working
_BUSY_MAX_S = 30.0  # a holder working this long without a hand-over gets company
_LINE_POLL_S = 2.0  # behind the first in line: a safety net only
_PARKED_POLL_S = 1.0  # a parked thread is woken by unpark; this is a safety net
turn = _Turn()
