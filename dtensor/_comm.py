"""The only module that calls ``torch.distributed``.

Process groups for mesh axes are created here, once per distinct rank tuple,
by the member ranks only, under a name derived from the ranks alone. Neither
the world nor non-members take part, so a sub-mesh can be built by just its
ranks and never hangs the others. (``dist.new_group(use_local_synchronization=
True)`` cannot promise that: its group names depend on how many groups each
process made before, so members with different histories pick different
names and wait for each other forever.)

A group's name is a pure function of the world and its ranks
(``world_tag()`` + ranks, + how many groups of those ranks the world
destroyed before: ``destroy_process_group`` of one group forgets only that
group), so compiled code, which bakes group names into its
generated code, names the same group in every process of the same world
configuration, and never a group of another world (see ``dtensor.mesh``:
the world tag is part of how a mesh is named in generated code, hence part of
every compile cache key). Groups live as long as their world, whatever
happens to the meshes that asked for them.

Collectives take plain local tensors and a group, and know nothing of specs.
Every call is counted when a ``CommCounter`` is active.
"""

from __future__ import annotations

import atexit
import gc
import threading
from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .errors import ShardingError

__all__ = [
    "all_gather",
    "all_reduce",
    "broadcast",
    "count",
    "get_rank",
    "group_for",
    "is_initialized",
    "reduce_scatter",
    "world_tag",
]

# torch 2.13 renamed all_gather_into_tensor (now deprecated); 2.11 lacks the new name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_funcol_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
# torch 2.13 renamed reduce_scatter_tensor too (now deprecated); 2.11 lacks the new name.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_tracing = torch.compiler.is_compiling

# id(default group) -> (default group, {ranks: group}, lock, {ranks: times
# destroyed}). Holding the default group keeps its id from being reused by a
# later world's group.
# Per world, since a rank's default group is its own: ranks sharing a
# process (a simulated world, launch/sim*.py) each have theirs, and one
# rank's group creation (a store barrier with its peers) must not hold a
# lock the peers need to reach that barrier.
_groups: dict[int, tuple[object, dict[tuple[int, ...], object], threading.Lock, Counter]] = {}
_groups_lock = threading.Lock()
# Listeners, each with the simulated rank that pushed it (None in a process
# that is one rank): a rank counts only its own collectives.
_counters: list[tuple[object, int | None]] = []
_rank_local = threading.local()  # .rank: set on simulated rank threads (_rank_state)

_REDUCE = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    # Gloo has no AVG: averaging is a sum then a division (see all_reduce).
    "avg": dist.ReduceOp.SUM,
    "product": dist.ReduceOp.PRODUCT,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Global rank of this process; 0 when no process group is initialised."""
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def count(kind: str, t: torch.Tensor | None = None, copies: int = 1) -> None:
    """Record one collective of ``kind`` filling ``copies`` times ``t``'s bytes.

    The bytes are those of the buffer the collective fills on this rank (for
    an all-gather, every rank's piece). Costs one list check when nothing
    listens.
    """
    if not _counters:
        return
    nbytes = t.numel() * t.element_size() * copies if t is not None else 0
    me = getattr(_rank_local, "rank", None)
    for c, owner in _counters:
        if owner != me:
            continue
        record = getattr(c, "record", None)
        if record is None:  # a bare Counter: counts only
            c[kind] += 1
        else:
            record(kind, nbytes)


def push_counter(c) -> None:
    """Listen to collectives: a ``Counter`` (counts by kind) or an object with
    ``record(kind, nbytes)`` (see ``dtensor.debug``)."""
    _counters.append((c, getattr(_rank_local, "rank", None)))


def pop_counter(c: Counter) -> None:
    for i, (x, _) in enumerate(_counters):
        if x is c:
            del _counters[i]
            return
    raise ValueError(f"pop_counter: {c!r} is not listening")


def world_tag() -> str:
    """Names the current world: equal on all its ranks, stable across runs.

    ``"local"`` without a process group. Worlds of the same configuration (the
    default group's name and size) share a tag, so on-disk compile caches
    carry over between runs of the same launch; different worlds, e.g. a
    4-rank world and a 2-rank world or a sub-world swapped in by a test
    service, get different tags, so a program compiled in one is never
    replayed in another.
    """
    if not is_initialized():
        return "local"
    pg = dist.distributed_c10d._get_default_group()
    name = str(pg.group_name).replace(":", ".")
    return f"{name}.{pg.size()}"


def group_for(ranks: Sequence[int]):
    """The process group of exactly ``ranks`` (in that order); members only.

    Cached per world and rank tuple for the world's lifetime (never tied to the
    mesh that asked first). The group spanning the whole world in rank order is
    the default group, so 1-D meshes over the world create nothing.
    """
    ranks = tuple(int(r) for r in ranks)
    world = dist.distributed_c10d._get_default_group()
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


def _wrap_destroy(destroy):
    def destroy_process_group(group=None):
        target = group if group is not None else dist.distributed_c10d._world.default_pg
        destroy(group)
        with _groups_lock:
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
    # last act is an all_gather). Ending the world and freeing what it leaves
    # while Python is still whole lets those threads finish first (0 of 40).
    # Bounded: a worker stuck in a peer's collective must not hang the exit.
    if dist.is_available() and dist.is_initialized():
        ender = threading.Thread(target=lambda: (dist.destroy_process_group(), gc.collect()),
                                 daemon=True)
        ender.start()
        ender.join(timeout=10.0)


atexit.register(_end_world_at_exit)


def group_name_for(ranks: Sequence[int], generation: int = 0) -> str:
    """The deterministic name ``group_for(ranks)`` registers (non-world groups).

    ``generation``: how many groups of these ranks this world destroyed. A
    re-created group gets a new name, since Gloo's rendezvous would otherwise
    find the destroyed group's addresses under the same keys of the store.
    """
    name = f"dtensor:{world_tag()}:" + "_".join(str(int(r)) for r in ranks)
    return f"{name}~{generation}" if generation else name


def _create_group(ranks: tuple[int, ...], generation: int = 0):
    me = dist.get_rank()
    if me not in ranks:
        raise AssertionError(f"rank {me} asked for group {ranks} it is not in")
    if ranks == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    c10d = dist.distributed_c10d
    name = group_name_for(ranks, generation)
    try:
        group, _ = c10d._new_process_group_helper(
            len(ranks),
            ranks.index(me),
            list(ranks),
            dist.get_backend(),
            c10d._get_default_store(),
            c10d.GroupName(name) if hasattr(c10d, "GroupName") else name,
            timeout=c10d.default_pg_timeout,
        )
    except TypeError:  # pragma: no cover - private helper changed signature
        # NOTE: fallback with the naming caveat from the module docstring.
        return dist.new_group(list(ranks), use_local_synchronization=True)
    c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(ranks)}
    return group


# Collectives --------------------------------------------------------------
# Dtypes Gloo rejects ("Invalid scalar type"), mapped to a carrier it takes:
# (carrier for moving data, carrier for reducing it). A carrier of the same
# size is a bit view (exact for any value); a wider one is an exact cast.
_CARRIERS: dict[torch.dtype, tuple[torch.dtype, torch.dtype | None]] = {
    torch.bool: (torch.uint8, torch.uint8),
    torch.int16: (torch.int32, torch.int32),
    torch.uint16: (torch.int32, torch.int32),
    torch.uint32: (torch.int64, torch.int64),
    # Two's complement: an int64 sum has the uint64 sum's bits; max/min do not.
    torch.uint64: (torch.int64, torch.int64),
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _CARRIERS[getattr(torch, _name)] = (torch.uint8, torch.float32)


def _wire(t: torch.Tensor, reduce_op: str | None = None):
    """``t`` in a dtype the backend accepts, and the dtype to restore (or None)."""
    carriers = _CARRIERS.get(t.dtype)
    if carriers is None:
        return t.contiguous(), None
    carrier = carriers[0] if reduce_op is None else carriers[1]
    # Two's complement: int64 sums, products and bitwise ops have the uint64 bits.
    if carrier is None or (t.dtype == torch.uint64 and reduce_op in ("max", "min", "avg")):
        raise ShardingError(
            f"all_reduce({reduce_op}) of {t.dtype} is not supported by the backend; "
            "cast to int64 or a float dtype first"
        )
    return _to_carrier(t.contiguous(), carrier), t.dtype


def _to_carrier(t: torch.Tensor, carrier: torch.dtype) -> torch.Tensor:
    if t.dtype == torch.bool or t.element_size() != carrier.itemsize:
        return t.to(carrier)
    return t.view(carrier)


def _restore(buf: torch.Tensor, back: torch.dtype | None) -> torch.Tensor:
    if back is None:
        return buf
    if back == torch.bool or buf.element_size() != back.itemsize:
        return buf.to(back)
    return buf.view(back)


def all_reduce(t: torch.Tensor, op: str, group) -> torch.Tensor:
    """Reduce ``t`` over ``group`` with ``op`` (a ``Partial`` reduce op); returns a new tensor."""
    if t.numel() == 0:
        return t.clone()
    count("all_reduce", t)
    buf, back = _wire(t, op)
    if not _tracing() and buf.data_ptr() == t.data_ptr():
        buf = buf.clone()  # reduced in place (traced collectives are functional)
    if _tracing():
        # NOTE: under torch.compile, collectives must be functional ops (the
        # traced graph holds them); "avg" is summed, as Gloo has no AVG.
        wire_op = "sum" if op == "avg" else op
        if buf.is_complex():
            buf = torch.view_as_complex(
                funcol.all_reduce(torch.view_as_real(buf), wire_op, group)
            )
        else:
            buf = funcol.all_reduce(buf, wire_op, group)
    elif buf.is_complex():
        view = torch.view_as_real(buf)
        dist.all_reduce(view, op=_REDUCE[op], group=group)
    else:
        dist.all_reduce(buf, op=_REDUCE[op], group=group)
    if op == "avg":
        n = dist.get_world_size(group)
        buf = buf / n if buf.is_floating_point() or buf.is_complex() else buf // n
    return _restore(buf, back)


def all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    """All ranks' ``t`` (same shape on every rank), in group-rank order."""
    n = dist.get_world_size(group)
    if t.numel() == 0:  # same padded shape everywhere, so nobody sends
        return [t] * n
    count("all_gather", t, n)
    buf, back = _wire(t)
    shape = buf.shape
    if buf.is_complex():
        buf = torch.view_as_real(buf)
    flat = buf.reshape(-1)
    if _tracing():
        out = _funcol_gather(flat, 0, group)
    else:
        out = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
        _all_gather_single(out, flat, group=group)
    out = out.view(n, *buf.shape)
    if t.is_complex():
        out = torch.view_as_complex(out)
    out = _restore(out, back)
    assert out.shape[1:] == shape
    return list(out.unbind(0))


def all_gather_cat(t: torch.Tensor, group) -> torch.Tensor:
    """All ranks' ``t`` concatenated along dim 0 (same shape on every rank)."""
    n = dist.get_world_size(group)
    if t.numel() == 0 or t.dtype in _CARRIERS or t.is_complex():
        return torch.cat(all_gather(t, group), dim=0)
    count("all_gather", t, n)
    t = t.contiguous()
    if _tracing():
        return _funcol_gather(t, 0, group)
    out = torch.empty((n * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    _all_gather_single(out, t, group=group)
    return out


def reduce_scatter(t: torch.Tensor, op: str, dim: int, group) -> torch.Tensor:
    """Reduce ``t`` over ``group`` with ``op`` and keep this rank's chunk of ``dim``.

    The chunks are ``torch.chunk``'s (pieces of ``ceil(size / n)``, trailing
    ones shorter or empty), the layout of a ``Shard(dim)``: the reduced value
    equals ``all_reduce`` then that chunk, at half the wire bytes. Every rank
    passes the same shape. Example (2 ranks, each holding ``[1, 2, 3]``)::

        >>> reduce_scatter(torch.tensor([1., 2., 3.]), "sum", 0, group)
        tensor([2., 4.])    # rank 0; rank 1 gets tensor([6.])
    """
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    size = t.shape[dim]
    piece = -(-size // n)
    start = min(me * piece, size)
    keep = max(0, min(piece, size - start))
    if t.numel() == 0:  # same shape everywhere, so nobody sends
        return t.narrow(dim, start, keep).clone()
    # The backend splits dim 0 into n equal pieces: move ``dim`` first and pad
    # it to n * piece, which puts each torch.chunk piece in its own slot.
    front = t.movedim(dim, 0)
    if piece * n != size:
        pad = front.new_zeros((piece * n - size, *front.shape[1:]))
        front = torch.cat([front, pad], dim=0)
    count("reduce_scatter", front)
    buf, back = _wire(front, op)
    if buf.is_complex():
        buf = torch.view_as_real(buf.contiguous())
    if _tracing():
        # NOTE: functional under torch.compile, like all_reduce; "avg" is
        # summed (Gloo has no AVG) and divided below.
        wire_op = "sum" if op == "avg" else op
        out = funcol.reduce_scatter_tensor(buf, wire_op, 0, group)
    else:
        out = buf.new_empty((piece, *buf.shape[1:]))
        _reduce_scatter_single(out, buf, op=_REDUCE[op], group=group)
    if t.is_complex():
        out = torch.view_as_complex(out)
    if op == "avg":
        out = out / n if out.is_floating_point() or out.is_complex() else out // n
    out = _restore(out, back)
    return out.narrow(0, 0, keep).movedim(0, dim).contiguous()


def broadcast(t: torch.Tensor, src_group_rank: int, group) -> torch.Tensor:
    """``t`` from group rank ``src_group_rank`` to all; returns the received tensor."""
    count("broadcast", t)
    buf, back = _wire(t)
    if not _tracing() and buf.data_ptr() == t.data_ptr():
        buf = buf.clone()  # reduced in place (traced collectives are functional)
    target = torch.view_as_real(buf) if buf.is_complex() else buf
    if _tracing():
        out = funcol.broadcast(target, src_group_rank, group)
        buf = torch.view_as_complex(out) if buf.is_complex() else out
        return _restore(buf, back)
    dist.broadcast(target, group_src=src_group_rank, group=group)
    return _restore(buf, back)
