"""The threaded process group's parts whose cost grew with the square of the
rank count, replaced for simulated worlds of hundreds to thousands of ranks.

- Making a group: torch's threaded backend meets in the store (every rank
  adds to one key and waits on another), and every store write wakes every
  thread waiting on any key of the store. A 1,024-rank world making a 3-D
  mesh's 320 groups spent seconds in those wake-ups. Here the members meet
  on the turn (``launch.sim.turn``): each parks, the last one in unparks the
  others, one wake-up each.
- Making a group's object: c10d's ``_new_process_group_helper`` builds a
  wrapper group, parses the backend's configuration, fills in backend
  options and checks the debug level, on every rank for every group, and
  for a Python backend like the threaded one then throws the wrapper away
  (a 3-D mesh at 512 ranks: 1,536 calls). ``_make_here`` makes just the
  rank's ``ProcessLocalGroup``, named and registered in the rank's c10d
  world as c10d registers it (``_register_pg_in_world``); anything else
  (another backend, a tag, a device, backend options, a torch without that
  registration) goes to c10d's own helper.
- ``all_gather_single`` and ``reduce_scatter_single`` (the tensor forms a
  runtime uses): torch's split every rank's buffer into n pieces and copied
  piece by piece, n^2 tensor operations per collective (a million at 1,024
  ranks). Here: one concatenation or one reduction, then one copy per rank.

``install(mtpg)`` puts them in place and returns what ``uninstall`` needs to
put torch's back.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

from launch.sim.turn import _waiting, turn

__all__ = ["install", "share_world_ranks", "uninstall", "unpark_meetings"]

_group_cls: list = []  # the threaded group's class, bound by install()
_meets_lock = threading.Lock()
_meets: dict[tuple, list] = {}  # a group being made -> the ranks that reached it
_torch_helper: list = []  # c10d's own group maker, bound by install()
_configs: dict[str, str] = {}  # backend -> its configuration as c10d records it


def _make_group(opts: Any, _backend_options: Any = None) -> Any:
    """The threaded backend's group maker (c10d's extended plugin form, which
    hands in the group's name): torch's group, met on the turn."""
    group = _group_cls[0](opts.group_rank, opts.group_size)
    group._sim_name = opts.group_id
    _meet((str(opts.group_id), opts.group_size), opts.group_size)
    return group


def _meet(key: tuple, size: int) -> None:
    """Wait until ``size`` rank threads reached ``key``; the last wakes the rest."""
    _waiting()
    me = turn.me()
    with _meets_lock:
        here = _meets.setdefault(key, [])
        here.append(me)
        last = len(here) == size
        if last:
            del _meets[key]
        else:
            turn.park()
    if last:
        turn.unpark(here[:-1])
        return
    turn.wait_parked(me, _group_cls[0]._terminate.is_set)
    if len(here) < size:  # released: another rank failed or the world timed out
        sys.exit("Test termination event occurs.")


def _make_here(group_size: int, group_rank: int, global_ranks_in_group: list,
               backend: Any, store: Any, group_name: Any, backend_options: Any = None,
               timeout: Any = None, pg_tag: Any = None, device_id: Any = None,
               group_desc: Any = None) -> tuple:
    """c10d's ``_new_process_group_helper`` (same arguments, same result) for
    the threaded backend: see the module docstring."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    register = getattr(c10d, "_register_pg_in_world", None)
    if (str(backend) != "threaded" or backend_options is not None or device_id is not None
            or pg_tag not in (None, "") or register is None
            or getattr(c10d, "_use_torchcomms_enabled", bool)()):
        return _torch_helper[0](group_size, group_rank, global_ranks_in_group, backend, store,
                                group_name, backend_options, timeout, pg_tag, device_id,
                                group_desc)
    world = c10d._world
    if group_name in world.pg_names.values():
        raise ValueError("The specified group name has already been created, please use a "
                         "different group name")
    if global_ranks_in_group and world.default_pg.rank() not in global_ranks_in_group:
        return c10d.GroupMember.NON_GROUP_MEMBER, None
    prefix_store = c10d.PrefixStore(f"{group_name}/", store)
    pg = _group_cls[0](group_rank, group_size)
    pg._sim_name = group_name
    _meet((str(group_name), group_size), group_size)
    pg._set_group_name(group_name)
    pg._set_group_desc("undefined" if group_desc is None else group_desc)
    config = _configs.get(backend)
    if config is None:
        config = _configs[backend] = str(c10d.BackendConfig(backend))
    register(pg, backend_name=backend, store=prefix_store, group_name=group_name,
             backend_config=config, add_to_default_tag=True)
    return pg, prefix_store


def _named(registered: property) -> property:
    """The threaded group's ``group_name``, also once its world forgot it.

    c10d's ``destroy_process_group`` of a group other than the world's asks
    the group its name after taking it out of the world's names, and the
    threaded group looks its name up there; the name the group was made
    with is kept on the group itself.
    """

    def group_name(self: Any) -> Any:
        try:
            return registered.fget(self)
        except KeyError:
            kept = self.__dict__.get("_sim_name")
            if kept is None:
                raise
            return kept

    return property(group_name, doc=registered.__doc__)


@functools.lru_cache(maxsize=8)
def _identity(n: int) -> dict[int, int]:
    return {r: r for r in range(n)}


def share_world_ranks(n: int) -> None:
    """Give this rank's world group the rank map every rank shares.

    c10d keeps, per rank, a dict from global to group rank for each group; for
    the world group of a 1,024-rank world that was 1,024 dicts of 1,024
    entries (~60 MB). c10d only reads it, so one serves every rank.
    """
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    maps = c10d._world.pg_group_ranks
    world = c10d._get_default_group()
    made = maps.get(world)
    # c10d makes the identity map; checked at its ends (a full comparison on
    # every rank is the square of the rank count again)
    if made is not None and len(made) == n and made.get(0) == 0 and made.get(n - 1) == n - 1:
        maps[world] = _identity(n)


def unpark_meetings() -> None:
    """Release every rank waiting for a group to be made (a failed world)."""
    with _meets_lock:
        waiting = [w for here in _meets.values() for w in here]
        _meets.clear()
    turn.unpark(waiting)


class _GatherSingle:
    """All-gather into one tensor per rank: the inputs concatenated once."""

    def work(self, data: list) -> None:
        import torch

        with torch.no_grad():
            full = torch.cat([inp.reshape(-1) for _, inp in data])
            for out, _ in data:
                out.detach().view(-1).copy_(full)


class _ScatterSingle:
    """Reduce-scatter of one tensor per rank: one reduction, one copy per rank."""

    def __init__(self, op: Any, ops: dict) -> None:
        op = getattr(op, "op", op)  # a ReduceOp wraps its RedOpType
        if op not in ops:
            raise NotImplementedError(f"simulated reduce_scatter does not support {op}")
        self.reduce = ops[op]

    def work(self, data: list) -> None:
        import torch

        with torch.no_grad():
            full = self.reduce([inp for _, inp in data])
            for (out, _), piece in zip(data, full.chunk(len(data)), strict=True):
                out.detach().copy_(piece)


def install(mtpg: Any) -> tuple:
    """Replace the threaded group's maker and tensor-form collectives."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    pg = mtpg.ProcessLocalGroup
    _group_cls[:] = [pg]
    saved = (dist.Backend._plugins["THREADED"], c10d._new_process_group_helper,
             pg.__dict__["group_name"], *(getattr(pg, n) for n in _names(pg)))
    _torch_helper[:] = [saved[1]]
    dist.Backend._plugins["THREADED"] = saved[0]._replace(creator_fn=_make_group,
                                                          extended_api=True)
    c10d._new_process_group_helper = _make_here
    pg.group_name = _named(saved[2])

    def all_gather_single(self: Any, output: Any, input: Any, opts: Any = None) -> Any:
        coll = pg._start_coll(_GatherSingle(), self)
        res = coll.join(self._rank, (output, input))
        pg._end_coll(coll, self)
        return res

    def reduce_scatter_single(self: Any, output: Any, input: Any, opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        coll = pg._start_coll(_ScatterSingle(op, mtpg._reduce_ops), self)
        res = coll.join(self._rank, (output, input))
        pg._end_coll(coll, self)
        return res

    gather_name, scatter_name = _names(pg)
    setattr(pg, gather_name, all_gather_single)
    setattr(pg, scatter_name, reduce_scatter_single)
    return saved


def _names(pg: Any) -> tuple[str, str]:
    """The threaded group's tensor-form all-gather and reduce-scatter methods
    (torch 2.11 names them ``_allgather_base`` / ``_reduce_scatter_base``)."""
    if hasattr(pg, "all_gather_single"):
        return "all_gather_single", "reduce_scatter_single"
    return "_allgather_base", "_reduce_scatter_base"


def uninstall(mtpg: Any, saved: tuple) -> None:
    import torch.distributed as dist

    pg = mtpg.ProcessLocalGroup
    dist.Backend._plugins["THREADED"] = saved[0]
    dist.distributed_c10d._new_process_group_helper = saved[1]
    pg.group_name = saved[2]
    for name, fn in zip(_names(pg), saved[3:], strict=True):
        setattr(pg, name, fn)
