"""c10d on rank threads: PyTorch's threaded process group, with the turn.

``entered()`` routes c10d through per-thread worlds (process-wide, undone on
leaving) and hooks the threaded group's two ways of waiting for the other
ranks (a collective's join, a group's barrier) so they hand the turn on
(``launch.sim.turn``). It also fills in the reduce-scatter ops the threaded
group lacks.
"""

from __future__ import annotations

import operator
import sys
import threading
from collections.abc import Callable
from typing import Any

from launch.sim import collectives
from launch.sim.turn import _waiting, turn

__all__ = ["entered", "unpark_collectives"]

_lock = threading.Lock()
_depth = 0
_saved_world: Any = None
_saved_waits: tuple | None = None


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
# ``set_result`` wrappers cost a few percent of a simulated suite's CPU:
# every rank of every collective makes one). Bound when the hook is
# installed: this module loads with the plugin, before torch, and an import
# statement in ``_sim_join`` would run on every call.
_ret_work: list = []


def _finished_work(torch: Any) -> Callable[[Any], Any]:
    future, from_future = torch._C.Future, torch._C._distributed_c10d._create_work_from_future

    def ret_work(data: Any) -> Any:
        fut = future([])
        fut.set_result(data)
        return from_future(fut)

    return ret_work


def unpark_collectives(group_cls: Any) -> None:
    """Wake every rank parked in a collective (after ``exception_handle``)."""
    for coll in list(group_cls._cur_coll_on_pgs.values()):
        turn.unpark(coll.__dict__.get("_sim_parked", ()))
    collectives.unpark_meetings()  # and every rank waiting for a group to be made


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


def _quick_world(mtpg: Any) -> type:
    """Torch's per-thread c10d world, each of its fields one call away.

    c10d reads its world's fields on every call (``group.WORLD`` is a field:
    ``dist.get_rank()`` reads three), and torch's per-thread world reaches
    each through three Python calls: tens of thousands of calls per test at
    512 ranks. Here a field is read from the thread's data in one, falling
    back to torch's where the thread has none yet.
    """
    base = mtpg.ThreadLocalWorld
    if _quick[:1] and _quick[0].__base__ is base:
        return _quick[0]
    here = base._world  # the class's thread-local data

    def field(name: str, slow: property) -> property:
        read = operator.attrgetter(f"world.{name}")

        def get(self: Any) -> Any:
            try:
                return read(here)
            except AttributeError:  # this thread's world is not made yet
                return slow.fget(self)

        return property(get, slow.fset, doc=slow.__doc__)

    fields = {k: field(k, v) for k, v in vars(base).items() if isinstance(v, property)}
    _quick[:] = [type("QuickThreadLocalWorld", (base,), fields)]
    return _quick[0]


_quick: list = []


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
        dist.distributed_c10d._world = _quick_world(mtpg)()
        global _saved_waits
        _saved_waits = (*_hook_waits(mtpg), collectives.install(mtpg))
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

            mtpg.Collective.join, mtpg._store_based_barrier, made = _saved_waits
            collectives.uninstall(mtpg, made)
            _saved_waits = None


class _ReduceScatter:
    """The threaded group's reduce-scatter for every reduce op it all-reduces
    with (its own takes SUM and AVG only; Gloo also takes MIN, MAX, PRODUCT)."""

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
