"""A simulated world: n ranks as n threads of this process.

The transport is PyTorch's threaded process group
(``torch.testing._internal.distributed.multi_threaded_pg``): every rank
thread joins a ``"threaded"`` default group of its own, so
``dist.get_rank()``, ``dist.group.WORLD`` and every group a mesh creates
are that rank's, while a collective hands tensors between threads (no
sockets, no process switches). Writing a transport of our own would only
duplicate it.

What is per rank: the c10d world (thread-local under the threaded group),
and the runtime's per-rank state (``dtensor._rank_state``). What is shared:
the interpreter, torch's default generator and Python's ``random`` (seeded
once per test by the service, not per rank), caches that do not depend on
the rank, and the GIL (ranks take turns; nothing overlaps in time).

A world keeps its threads for the session (one world per size, like the
real worlds of ``launch.modes.parent``). ``run(fn)`` calls ``fn(rank)`` on every
rank and returns each rank's ``Outcome``. A rank that raises releases the
others from any collective they wait in (they see a ``SimAbort``), and a
rank that is still running when the deadline passes is reported as hung;
either way the world is then reset (or, if a thread never came back,
abandoned) before the next call.
"""

from __future__ import annotations

import _thread
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from launch.sim import collectives
from launch.sim.malloc import one_malloc_arena
from launch.sim.threaded import unpark_collectives
from launch.sim.turn import _Waiter, turn

__all__ = ["SIM_DEADLINE_RANKS", "Outcome", "SimAbort", "SimWorld", "sim_deadline",
           "world"]


#: Past this many ranks a simulated world's watchdog grows with the rank count.
SIM_DEADLINE_RANKS = 128


def sim_deadline(timeout: float, n: int) -> float:
    """The watchdog seconds of an ``n``-rank simulated world for a test whose
    real-world watchdog is ``timeout``: a real world's ranks run side by side,
    a simulated world's one at a time, so an example's wall time grows with
    the rank count. Up to ``SIM_DEADLINE_RANKS`` ranks the same; past it,
    ``timeout * n / SIM_DEADLINE_RANKS`` (120 s is 960 s at 1,024 ranks).

    Example:
        >>> sim_deadline(120.0, 64), sim_deadline(120.0, 1024)
        (120.0, 960.0)
    """
    return timeout * max(1.0, n / SIM_DEADLINE_RANKS)


class SimAbort(Exception):
    """A rank was released from a collective because another rank failed or hung."""


@dataclass
class Outcome:
    """What ``fn(rank)`` did on one rank: returned ``value`` or raised ``error``
    (``hung`` when it had not returned by the deadline)."""

    rank: int
    value: Any = None
    error: BaseException | None = None
    hung: bool = False
    aborted: bool = False  # released from a collective by another rank's failure


_STOP = object()


class SimWorld:
    """n rank threads sharing one store; see the module docstring.

    Example (``entered`` is ``launch.sim.threaded.entered``)::

        w = SimWorld(4)
        with entered():
            outs = w.run(lambda rank: dist.get_rank())
        assert [o.value for o in outs] == [0, 1, 2, 3]
    """

    _generation = 0

    def __init__(self, n: int, rank_init: Callable[[int, int], Any] | None = None) -> None:
        if n < 1:
            raise ValueError(f"SimWorld: n must be >= 1, got {n}")
        SimWorld._generation += 1
        self.n = n
        self.rank_init = rank_init  # called as rank_init(rank, n) on each rank thread
        self.tag = f"sim{SimWorld._generation}"
        self.broken: str | None = None
        # A task waits in _pending; a rank with none is parked in _idle until
        # run() hands it one. Outcomes of the current task gather in _outs.
        self._tasks_lock = threading.Lock()
        self._pending: list[Any] = [None] * n
        self._idle: list[_Waiter | None] = [None] * n
        self._outs_cond = threading.Condition()
        self._outs: dict[int, Outcome] = {}
        self._outs_seq = 0
        self._threads: list[Any] = []  # per rank thread: a lock held until it ends
        self._started = False

    # -- threads --------------------------------------------------------------
    def _start(self) -> None:
        import torch.distributed as dist

        store = dist.HashStore()
        one_malloc_arena()
        for r in range(self.n):
            ended = _thread.allocate_lock()
            ended.acquire()
            self._threads.append(ended)
            # A bare thread: ``threading.Thread.start`` waits until the new
            # thread runs, a scheduler's wake-up each (on a loaded machine
            # 0.6 s of wall time for 0.1 s of work at 512 ranks).
            _thread.start_new_thread(self._serve_then_end, (r, store, ended))
        self._started = True

    def _serve_then_end(self, rank: int, store: Any, ended: Any) -> None:
        try:
            self._serve(rank, store)
        finally:
            ended.release()

    def _serve(self, rank: int, store: Any) -> None:
        import torch
        import torch.distributed as dist

        # With the turn from the start: hundreds of threads starting at once
        # would otherwise trade the interpreter's lock among themselves.
        turn.take()
        torch.set_num_threads(1)
        init_error: BaseException | None = None
        try:
            dist.init_process_group("threaded", rank=rank, world_size=self.n, store=store)
            collectives.share_world_ranks(self.n)
        except BaseException as e:  # reported with the first task
            init_error = e
        if init_error is None and self.rank_init is not None:
            try:
                self.rank_init(rank, self.n)
            except BaseException as e:
                init_error = e
        while True:
            task = self._next_task(rank)
            if task is None:  # woken with no task (another rank's release): wait again
                continue
            if task is _STOP:
                turn.give()
                break
            seq, fn = task
            out = Outcome(rank)
            if init_error is not None:
                out.error = init_error
                turn.give()
            else:
                try:
                    out.value = fn(rank)
                except SystemExit as e:  # the threaded group's release of waiters
                    out.aborted, out.error = True, SimAbort(str(e))
                except Exception as e:
                    out.error = e
                    try:
                        self._release(e)
                    except Exception as why:  # never lose the rank's outcome
                        e.add_note(f"(releasing the other ranks failed: {why!r})")
                except BaseException as e:  # a skip: the others are not waiting for it
                    out.error = e
                finally:
                    turn.give()
            with self._outs_cond:
                if seq == self._outs_seq:
                    self._outs[rank] = out
                    if len(self._outs) == self.n:
                        self._outs_cond.notify()
        try:
            dist.destroy_process_group()
        except AttributeError:  # torch 2.11: its thread-local world has no ``comms``
            pass

    def _next_task(self, rank: int) -> Any:
        """This rank's next task, with the turn (or, stuck in line, without)."""
        me = turn.me()
        with self._tasks_lock:
            task = self._pending[rank]
            if task is None:
                turn.park()
                self._idle[rank] = me
        if task is None:
            turn.wait_parked(me, _never)  # gives up the turn held since the last task
            with self._tasks_lock:
                task = self._pending[rank]
        else:
            turn.take()
        with self._tasks_lock:
            self._pending[rank] = None
        return task

    @staticmethod
    def _release(exc: BaseException) -> None:
        """Wake every rank waiting in a collective (they exit it with SimAbort)."""
        from torch.testing._internal.distributed.multi_threaded_pg import (
            ProcessLocalGroup,
        )

        # Under the registry's lock: exception_handle walks the collectives in
        # flight while other ranks add and remove theirs ("dictionary changed
        # size during iteration" killed the releasing rank's thread, and its
        # world waited for it until the deadline).
        with ProcessLocalGroup._coll_lock:
            ProcessLocalGroup.exception_handle(exc)
            unpark_collectives(ProcessLocalGroup)

    # -- running ----------------------------------------------------------------
    _seq = 0

    def run(self, fn: Callable[[int], Any], timeout: float = 300.0) -> list[Outcome]:
        """``fn(rank)`` on every rank; each rank's outcome, in rank order."""
        from torch.testing._internal.distributed.multi_threaded_pg import (
            ProcessLocalGroup,
        )

        if self.broken:
            raise RuntimeError(f"simulated {self.n}-rank world is broken: {self.broken}")
        if not self._started:
            self._start()
        SimWorld._seq += 1
        seq = SimWorld._seq
        with self._outs_cond:
            self._outs, self._outs_seq = {}, seq
        with self._tasks_lock:
            for r in range(self.n):
                self._pending[r] = (seq, fn)
            idle = [w for w in self._idle if w is not None]
            self._idle = [None] * self.n
        turn.unpark(idle)  # in rank order: rank 0 runs first
        deadline = time.monotonic() + timeout
        released = False
        with self._outs_cond:
            while len(self._outs) < self.n:
                left = deadline - time.monotonic()
                if left <= 0 and not released:
                    # Release the waiters; give them a moment to come back.
                    self._release(TimeoutError("simulated world deadline"))
                    released, deadline = True, time.monotonic() + 10.0
                    continue
                if left <= 0:
                    break
                self._outs_cond.wait(timeout=min(left, 1.0))
            outs = dict(self._outs)
            self._outs_seq = 0  # a rank that comes back later reports to nobody
        missing = [r for r in range(self.n) if r not in outs]
        for r in missing:
            outs[r] = Outcome(r, error=TimeoutError(
                f"rank {r} of the simulated {self.n}-rank world did not finish within "
                f"{timeout:.0f}s"), hung=True)
        if released:
            for o in outs.values():
                if o.aborted:
                    o.hung = True
        if missing:
            # A thread stuck outside any collective cannot be stopped: abandon it.
            self.broken = f"rank(s) {missing} never returned from a test"
        ProcessLocalGroup.reset()
        return [outs[r] for r in range(self.n)]

    def close(self) -> None:
        if self._started and not self.broken:
            with self._tasks_lock:
                self._pending = [_STOP] * self.n
                idle = [w for w in self._idle if w is not None]
                self._idle = [None] * self.n
            turn.unpark(idle)
            for ended in self._threads:
                if ended.acquire(timeout=5):
                    ended.release()
        self._started = False


def _never() -> bool:
    return False


_worlds: dict[int, SimWorld] = {}


def world(n: int, rank_init: Callable[[int, int], Any] | None = None) -> SimWorld:
    """The session's simulated world of ``n`` ranks (a fresh one if it broke)."""
    w = _worlds.get(n)
    if w is None or w.broken:
        w = _worlds[n] = SimWorld(n, rank_init)
    return w
