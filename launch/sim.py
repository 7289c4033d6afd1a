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
real worlds of ``launch.parent``). ``run(fn)`` calls ``fn(rank)`` on every
rank and returns each rank's ``Outcome``. A rank that raises releases the
others from any collective they wait in (they see a ``SimAbort``), and a
rank that is still running when the deadline passes is reported as hung;
either way the world is then reset (or, if a thread never came back,
abandoned) before the next call.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Outcome", "SimAbort", "SimWorld", "entered", "on_wait", "world"]


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


_lock = threading.Lock()
_depth = 0
_saved_world: Any = None
_saved_waits: tuple | None = None
_WAIT_HOOKS: list[Callable[[], None]] = []


def on_wait(hook: Callable[[], None]) -> None:
    """Call ``hook()`` on a rank thread right before it waits for the other
    ranks (a collective, or the barrier that makes a process group).

    ``launch.sim_fanout`` uses it to learn that a rank drawing a value is
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
    """One thread's place in the turn's queue: woken only when handed the turn."""

    __slots__ = ("event", "granted", "parked")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.granted = False  # handed the turn, not yet noticed
        self.parked = False  # waits for other ranks (a collective, a task), not for the turn


class _Turn:
    """Which rank thread runs: one at a time, until it waits for the others.

    Every torch op gives up the GIL while its kernel runs. With all of a
    world's ranks runnable (they are, between collectives: most examples
    make one or two), each op handed the GIL to another rank, so the ranks
    took turns op by op: ~1,150 futex calls and ~240 thread switches per
    simulated example, a fifth of the suite's time in the kernel, and the
    waiting threads spun on the machine's other core. The turn is held
    while a rank runs Python and given up only where it waits for another
    rank (a collective, a group's barrier, a shared draw, the end of its
    task), so a rank runs until it needs the others, as a real rank does.

    The turn goes from hand to hand: ``give`` wakes exactly the next thread
    in line (first come, first served), and a thread whose wait for the
    other ranks ends (``unpark``: a collective done, a task posted) joins
    the line without being woken. (A lock all waiters raced for woke every
    rank at the end of a collective to find the turn taken: ~23 thread
    switches and ~450 us of CPU per 4-rank all-reduce, against ~4.)

    A thread that waits ``_TURN_WAIT_S`` in line while no thread gets the
    turn runs without it: a wait this module does not know of (a store read
    inside torch) costs that long at worst, never a hang. ``missed`` counts
    them. (A fixed limit instead let a 64-rank world's ranks, queued behind
    each other, run without the turn ~2,000 times a suite.)
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
        w.event.set()

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
        while True:
            seen = self.handoffs
            w.event.wait(_PARKED_POLL_S if w.parked else _TURN_WAIT_S)
            with self._lock:
                if w.granted:
                    w.granted = False
                    w.event.clear()
                    return
                if w.parked:
                    if released is not None and released():
                        w.parked = False
                        return
                    continue
                if self.handoffs == seen:  # nobody got the turn meanwhile: stuck
                    self._line.remove(w)
                    self.missed += 1
                    return


_TURN_WAIT_S = 0.05
_PARKED_POLL_S = 1.0  # a parked thread is woken by unpark; this is a safety net
turn = _Turn()


def _sim_join(self: Any, rank: int, data: Any) -> Any:
    """The threaded group's ``Collective.join`` with the turn: the last rank to
    arrive moves the data (the collective's own ``work``), then goes on; the
    others sleep until the turn reaches them. (Torch's has rank 0 wait for
    all and do the work, then wakes every rank at once.)"""
    _waiting()
    terminated = self._pg._terminate.is_set
    me = turn.me()
    with self._start_cond:
        self._data[rank] = data
        self._count += 1
        last = self._count == self._world_size
        if not last:
            turn.park()
            self.__dict__.setdefault("_sim_parked", []).append(me)
    if last:
        if terminated():
            sys.exit("Test termination event occurs.")
        self._collective.work(self._data)
        with self._done_cond:
            self._done = True
            self._done_cond.notify_all()
        turn.unpark(self.__dict__.get("_sim_parked", ()))
    else:
        turn.wait_parked(me, terminated)
        if not self._done:  # released: another rank failed or the world timed out
            sys.exit("Test termination event occurs.")
        # Done is done: a rank that fails after it moved the data (and so
        # releases the world) must not take the others' finished results away.
    return _ret_work[0](data)


# A finished ``Work`` holding ``data`` (the threaded group's ``ret_work``
# without the Python ``Future`` subclass, whose ``__init__`` and
# ``set_result`` wrappers were ~2.5 % of a simulated suite's CPU: every rank
# of every collective makes one). Bound when the hook is installed: this
# module loads with the plugin, before torch, and an import statement in
# ``_sim_join`` cost ~0.7 us per call.
_ret_work: list = []


def _finished_work(torch: Any) -> Callable[[Any], Any]:
    future, from_future = torch._C.Future, torch._C._distributed_c10d._create_work_from_future

    def ret_work(data: Any) -> Any:
        fut = future([])
        fut.set_result(data)
        return from_future(fut)

    return ret_work


def _unpark_collectives(group_cls: Any) -> None:
    """Wake every rank parked in a collective (after ``exception_handle``)."""
    for coll in list(group_cls._cur_coll_on_pgs.values()):
        turn.unpark(coll.__dict__.get("_sim_parked", ()))


def _hook_waits(mtpg: Any) -> tuple:
    """Replace the threaded group's two ways of waiting for the other ranks."""
    join, barrier = mtpg.Collective.join, mtpg._store_based_barrier
    import torch

    _ret_work[:] = [_finished_work(torch)]

    def hooked_barrier(*args: Any, **kwargs: Any) -> Any:
        _waiting()
        with turn.waiting():
            return barrier(*args, **kwargs)

    mtpg.Collective.join = _sim_join
    mtpg._store_based_barrier = hooked_barrier
    return join, barrier


def _enter() -> None:
    """Route c10d through per-thread worlds (process-wide; undone by ``_exit``)."""
    global _depth, _saved_world
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    with _lock:
        _depth += 1
        if _depth > 1:
            return
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        _saved_world = dist.distributed_c10d._world
        # Installed by hand (not mtpg._install_threaded_pg) so that leaving
        # restores exactly what was there, and autograd's device threads stay
        # on: the ranks call backward() from their own threads.
        dist.distributed_c10d._world = mtpg.ThreadLocalWorld()
        global _saved_waits
        _saved_waits = _hook_waits(mtpg)
        if mtpg.ReduceScatter is not _ReduceScatter:
            _ReduceScatter.ops = mtpg._reduce_ops
            mtpg.ReduceScatter = _ReduceScatter


def _exit() -> None:
    global _depth
    import torch
    import torch.distributed as dist

    with _lock:
        _depth -= 1
        if _depth > 0:
            return
        dist.distributed_c10d._world = _saved_world
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        global _saved_waits
        if _saved_waits is not None:
            from torch.testing._internal.distributed import multi_threaded_pg as mtpg

            mtpg.Collective.join, mtpg._store_based_barrier = _saved_waits
            _saved_waits = None


class _ReduceScatter:
    """The threaded group's reduce-scatter for every reduce op it all-reduces
    with (its own takes SUM and AVG only; Gloo also takes MIN, MAX, PRODUCT,
    which a redistribute of ``Partial(max)`` to ``Shard`` uses)."""

    ops: dict = {}

    def __init__(self, op: Any) -> None:
        op = getattr(op, "op", op)  # a ReduceOp wraps its RedOpType
        if op not in self.ops:
            raise NotImplementedError(f"simulated reduce_scatter does not support {op}")
        self.op = op

    def work(self, data: list) -> None:
        import torch

        with torch.no_grad():
            for i, (out, _) in enumerate(data):
                if len(out) != 1 or any(len(d[1]) != 1 for d in data):
                    raise AssertionError("simulated reduce_scatter takes one tensor per rank")
                pieces = [d[1][0][i].to(out[0].device) for d in data]
                out[0].detach().copy_(self.ops[self.op](pieces))


class entered:
    """``with entered():`` c10d calls on rank threads reach their own worlds."""

    def __enter__(self) -> entered:
        _enter()
        return self

    def __exit__(self, *exc: Any) -> None:
        _exit()


_STOP = object()


class SimWorld:
    """n rank threads sharing one store; see the module docstring.

    Example::

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
        self._threads: list[threading.Thread] = []
        self._started = False

    # -- threads --------------------------------------------------------------
    def _start(self) -> None:
        import torch.distributed as dist

        store = dist.HashStore()
        for r in range(self.n):
            t = threading.Thread(target=self._serve, args=(r, store), daemon=True,
                                 name=f"{self.tag}-rank{r}")
            self._threads.append(t)
            t.start()
        self._started = True

    def _serve(self, rank: int, store: Any) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        init_error: BaseException | None = None
        try:
            dist.init_process_group("threaded", rank=rank, world_size=self.n, store=store)
        except BaseException as e:  # reported with the first task
            init_error = e
        if init_error is None and self.rank_init is not None:
            try:
                self.rank_init(rank, self.n)
            except BaseException as e:
                init_error = e
        while True:
            task = self._next_task(rank)
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
        dist.destroy_process_group()

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
            _unpark_collectives(ProcessLocalGroup)

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
            for t in self._threads:
                t.join(timeout=5)
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
