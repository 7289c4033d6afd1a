"""Process groups for mesh axes: created once per world and rank tuple, by
the member ranks only, under a name derived from the world and the ranks.

Neither the world nor non-members take part, so a sub-mesh can be built by
just its ranks and never hangs the others. (``dist.new_group(
use_local_synchronization=True)`` cannot promise that: its group names depend
on how many groups each process made before, so members with different
histories pick different names and wait for each other forever.)

A group's name is a pure function of the world and its ranks
(``world_tag()`` + ranks, + how many groups of those ranks the world
destroyed before: ``destroy_process_group`` of one group forgets only that
group), so compiled code, which bakes group names into its generated code,
names the same group in every process of the same world configuration, and
never a group of another world (see ``dtensor.mesh``: the world tag is part
of how a mesh is named in generated code, hence part of every compile cache
key). Groups live as long as their world, whatever happens to the meshes
that asked for them; the world's end (``dist.destroy_process_group``, or the
interpreter's exit) goes through here.
"""

from __future__ import annotations

import atexit
import functools
import gc
import threading
import time
from collections import Counter
from collections.abc import Sequence

import torch.distributed as dist

__all__ = ["group_for", "group_name_for", "on_world_end", "world_tag"]

# id(default group) -> (default group, {ranks: group}, lock, {ranks: times
# destroyed}). Holding the default group keeps its id from being reused by a
# later world's group.
# Per world, since a rank's default group is its own: ranks sharing a
# process (a simulated world, launch/sim/) each have theirs, and one
# rank's group creation (a store barrier with its peers) must not hold a
# lock the peers need to reach that barrier.
_groups: dict[int, tuple[object, dict[tuple[int, ...], object], threading.Lock, Counter]] = {}
_groups_lock = threading.Lock()
# id -> a tuple of ints seen before (held, so its id is not reused): the O(ranks)
# check of a 1,024-rank tuple, asked for by every rank of a simulated world, once.
_ints: dict[int, tuple[int, ...]] = {}
_INTS_MAX = 4096
# (world tag, ranks, generation) -> (group name, global-to-group rank map):
# what a group's making needs that does not depend on the asking rank. Every
# member of a simulated world's line asks for it (a 512-rank line's name and
# map built 512 times), and sharing the map is safe since c10d only reads it
# (``launch.sim.groups.share_world_ranks`` does the same for the world group).
_parts: dict[tuple, tuple[str, dict[int, int]]] = {}
_PARTS_MAX = 4096
# id(default group) -> (default group, its world tag): a mesh asks for the tag
# (five calls into c10d) on every rank. Forgotten when the world ends.
_tags: dict[int, tuple[object, str]] = {}

def world_tag() -> str:
    """Names the current world: equal on all its ranks, stable across runs.

    ``"local"`` without a process group. Worlds of the same configuration (the
    default group's name and size) share a tag, so on-disk compile caches
    carry over between runs of the same launch; different worlds, e.g. a
    4-rank world and a 2-rank world or a sub-world swapped in by a test
    service, get different tags, so a program compiled in one is never
    replayed in another.
    """
    pg = dist.distributed_c10d._world.default_pg if dist.is_available() else None
    if pg is None:
        return "local"
    known = _tags.get(id(pg))
    if known is not None and known[0] is pg:
        return known[1]
    name = str(pg.group_name).replace(":", ".")
    tag = f"{name}.{pg.size()}"
    with _groups_lock:
        _tags[id(pg)] = (pg, tag)
    return tag


def group_for(ranks: Sequence[int]):
    """The process group of exactly ``ranks`` (in that order); members only.

    Cached per world and rank tuple for the world's lifetime (never tied to the
    mesh that asked first). The group spanning the whole world in rank order is
    the default group, so 1-D meshes over the world create nothing.
    """
    if _ints.get(id(ranks)) is not ranks:
        if type(ranks) is not tuple or not all(type(r) is int for r in ranks):
            ranks = tuple(int(r) for r in ranks)
        # else kept: a mesh's ranks are one tuple shared by a simulated world's
        # ranks, checked once for all of them
        elif len(_ints) < _INTS_MAX:
            _ints[id(ranks)] = ranks
    world = dist.distributed_c10d._world.default_pg
    if world is None:
        raise ValueError("group_for: no default process group; call "
                         "dist.init_process_group first")
    entry = _groups.get(id(world))
    if entry is not None and entry[0] is world:
        group = entry[1].get(ranks)
        if group is not None:
            return group
    with _groups_lock:
        entry = _groups.get(id(world))
        if entry is None or entry[0] is not world:
            entry = _groups[id(world)] = (world, {}, threading.Lock(), Counter())
    with entry[2]:
        group = entry[1].get(ranks)
        if group is None:
            group = entry[1][ranks] = _create_group(ranks, entry[3][ranks])
    return group


_on_world_end: list = []  # callbacks: dispatch drops plans that hold the world's meshes
on_world_end = _on_world_end.append  # callback() after dist.destroy_process_group()


_ended: list[bool] = []  # a group was destroyed in this process (the exit hook's cue)


def _is_threaded(group) -> bool:
    # PyTorch's threaded process group (a simulated world's ranks as threads)
    return type(group).__name__ == "ProcessLocalGroup"


def _wrap_destroy(destroy):
    def destroy_process_group(group=None):
        target = group if group is not None else dist.distributed_c10d._world.default_pg
        threaded = _is_threaded(target)
        destroy(group)
        if not threaded:  # a threaded group (ranks as threads) has no workers to drain
            _ended.append(True)  # never the group: holding it would keep its workers alive
        with _groups_lock:
            known = _tags.get(id(target))
            if known is not None and known[0] is target:
                del _tags[id(target)]
            for key, (world, groups, _lock, destroyed) in list(_groups.items()):
                if world is target:  # the world ended, and its groups with it
                    del _groups[key]
                    continue
                # One group ended: forget only it. (Forgetting the world's
                # others made the ranks that destroyed it re-create them by
                # their still registered names and fail, while the other
                # members went on into a collective and waited for good.)
                for ranks in [r for r, g in groups.items() if g is target]:
                    del groups[ranks]
                    destroyed[ranks] += 1
        for callback in _on_world_end:
            callback()

    destroy_process_group.__wrapped__, destroy_process_group._dtensor_hook = destroy, True
    destroy_process_group.__doc__ = destroy.__doc__
    return destroy_process_group


# A world's end goes through here (not a guess from c10d's registry: the test
# service's sub-worlds swap live worlds out of it), so nothing keeps a
# destroyed world's groups alive through cached plans and meshes.
if not getattr(dist.destroy_process_group, "_dtensor_hook", False):
    dist.destroy_process_group = _wrap_destroy(dist.destroy_process_group)
    dist.distributed_c10d.destroy_process_group = dist.destroy_process_group


def _end_world_at_exit() -> None:
    # Gloo's worker threads drop their last finished work (and its tensors)
    # after the caller's wait() returns; if the interpreter is already
    # finalizing, taking the GIL there aborts the process ("terminate called
    # without an active exception": 5 of 20 two-rank plain-torch scripts whose
    # last act is an all_gather; also after an explicit destroy, since the
    # workers live as long as Python holds the group). Ending the world,
    # freeing what it leaves and giving a descheduled worker a moment, while
    # Python is still whole, narrows that window (it cannot be closed from
    # Python). Bounded: a worker stuck in a peer's collective must not hang.
    if not dist.is_available() or not (dist.is_initialized() or _ended):
        return

    def end() -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()

    ender = threading.Thread(target=end, daemon=True)
    ender.start()
    ender.join(timeout=10.0)
    time.sleep(0.1)


atexit.register(_end_world_at_exit)


def group_name_for(ranks: Sequence[int], generation: int = 0) -> str:
    """The deterministic name ``group_for(ranks)`` registers (non-world groups).

    ``generation``: how many groups of these ranks this world destroyed. A
    re-created group gets a new name, since Gloo's rendezvous would otherwise
    find the destroyed group's addresses under the same keys of the store.
    """
    name = f"dtensor:{world_tag()}:" + "_".join(str(int(r)) for r in ranks)
    return f"{name}~{generation}" if generation else name


@functools.lru_cache(maxsize=8)
def _whole(n: int) -> tuple[int, ...]:
    return tuple(range(n))


def _group_parts(ranks: tuple[int, ...], generation: int) -> tuple[str, dict[int, int]]:
    key = (world_tag(), ranks, generation)
    parts = _parts.get(key)
    if parts is None:
        if len(_parts) >= _PARTS_MAX:
            _parts.clear()
        parts = _parts[key] = (group_name_for(ranks, generation),
                               {g: i for i, g in enumerate(ranks)})
    return parts


def _create_group(ranks: tuple[int, ...], generation: int = 0):
    c10d = dist.distributed_c10d
    world = c10d._world
    default = world.default_pg  # (c10d's own accessors reach it in several calls each)
    me = default.rank()
    if me not in ranks:
        raise AssertionError(f"rank {me} asked for group {ranks} it is not in")
    size = default.size()
    if len(ranks) == size and ranks == _whole(size):
        return default
    name, rank_map = _group_parts(ranks, generation)
    backend, store = world.pg_map[default]  # what get_backend() and _get_default_store() read
    try:
        group, _ = c10d._new_process_group_helper(
            len(ranks),
            ranks.index(me),
            list(ranks),
            dist.Backend(backend),
            store,
            c10d.GroupName(name) if hasattr(c10d, "GroupName") else name,
            timeout=c10d.default_pg_timeout,
        )
    except TypeError:  # pragma: no cover - private helper changed signature
        # NOTE: fallback with the naming caveat from the module docstring.
        return dist.new_group(list(ranks), use_local_synchronization=True)
    c10d._world.pg_group_ranks[group] = rank_map
    return group
