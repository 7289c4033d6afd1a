"""Per-rank state when several ranks share one process (a simulated world).

A process normally hosts one rank, and the runtime keeps that rank's state in
module globals. A simulated world (the test service's ``--dist-sim``: ranks
as threads over PyTorch's threaded process group) hosts many, so whatever
belongs to a rank must be looked up per thread:

- the generator state (``dtensor.random``): one ``_Seeding`` per rank thread,
  swapped in through ``random._current``;
- the c10d world, hence process groups and the world-keyed caches in
  ``dtensor._comm`` and ``dtensor._seeding``: per thread already (the
  threaded group keeps a world per thread, and those caches key on it);
- the current-mesh stack (``dtensor.mesh``) and dispatch's re-entrancy
  state: thread-local already;
- collective counters (``dtensor._comm.count``, ``dtensor.debug``): a
  listener hears only the collectives of the rank that pushed it;
- meshes: a mesh holds its rank's coordinate and groups, and its equality
  includes the rank, so caches keyed by specs never hand one rank's mesh to
  another (rank-independent caches, e.g. redistribute plans keyed by shapes,
  stay shared).

Nothing here runs in a one-rank process: ``random._current`` stays the
module-global lookup until ``enter_rank`` is first called, so the ordinary
path pays nothing.

Example (what ``launch.sim.world`` does on each rank thread, through the
``dist_sim_rank_init`` ini option)::

    enter_rank(rank, size)
"""

from __future__ import annotations

import threading

from . import _comm
from . import random as rng

__all__ = ["auto_enter", "enter_rank", "is_sim_rank"]

_local = threading.local()
_installed = False
_install_lock = threading.Lock()


def _per_rank_current():
    g = getattr(_local, "seeding", None)
    return g if g is not None else rng._seeding


def enter_rank(rank: int, size: int | None = None) -> None:
    """Make this thread rank ``rank``'s: its own generator state from now on."""
    global _installed
    with _install_lock:
        if not _installed:
            rng._current = _per_rank_current
            _installed = True
    _local.seeding = rng._Seeding()
    _local.rank = rank
    _comm._rank_local.rank = rank  # collective counters count this rank's only


def auto_enter() -> None:
    """Make this thread's rank state its own if it is a rank of an in-process
    world that nobody entered for it: PyTorch's thread-per-rank test bases
    (``MultiThreadedTestCase``, ``DTensorOpTestBase``) start rank threads
    over the threaded process group without calling ``enter_rank``. Called
    where a rank first touches rank state (a reseed, a mesh), not per op."""
    if getattr(_local, "rank", None) is not None:
        return
    import torch.distributed as dist

    if type(dist.distributed_c10d._world).__name__ != "ThreadLocalWorld":
        return  # one rank per process (or an ordinary world): module state is the rank's
    if dist.is_initialized():
        enter_rank(dist.get_rank(), dist.get_world_size())


def is_sim_rank() -> bool:
    """Whether this thread is a rank of a simulated world."""
    return getattr(_local, "rank", None) is not None
