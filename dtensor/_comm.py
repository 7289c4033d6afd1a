"""The only module that calls ``torch.distributed`` collectives.

Process groups come from ``dtensor._groups`` (created by their members only,
named by world and ranks, forgotten when their world ends); ``group_for``,
``world_tag`` and ``on_world_end`` are re-exported here for the callers.

Collectives take local tensors and a group, and know nothing of specs.
Every call is counted when a ``CommCounter`` is active. With ``async_op=True``
a collective returns its result still in flight (``dtensor._async``): views of
it stay in flight, the first op that reads it waits. An in-flight input is
waited for before it is sent.
"""

from __future__ import annotations

import math
import threading
from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# Re-exported: the runtime and its tests reach groups as ``_comm.*``.
from . import _norm_wire
from ._async import AsyncCollectiveTensor, Flight, settle
from ._groups import _groups, group_for, group_name_for, on_world_end, world_tag  # noqa: F401
from .errors import ShardingError
from .placement import NORM_PREFIX, norm_order

__all__ = [
    "all_gather",
    "all_reduce",
    "broadcast",
    "count",
    "gather_chunks",
    "get_rank",
    "group_for",
    "is_initialized",
    "reduce_scatter",
    "scatter",
    "unpack_chunks",
    "world_tag",
]

# torch 2.13 renamed all_gather_into_tensor (now deprecated); 2.11 lacks the new name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_funcol_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
# torch 2.13 renamed reduce_scatter_tensor too (now deprecated); 2.11 lacks the new name.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_tracing = torch.compiler.is_compiling

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


_AVAILABLE = dist.is_available()


def _default_group():
    """c10d's default group or None, read from c10d's world at every call (a
    test service swaps worlds) in one step, where ``dist.get_rank()`` takes
    several: a mesh asks about the world on every rank, half a dozen times."""
    return dist.distributed_c10d._world.default_pg if _AVAILABLE else None


def is_initialized() -> bool:
    return _default_group() is not None


def get_rank() -> int:
    """Global rank of this process; 0 when no process group is initialised."""
    pg = _default_group()
    return 0 if pg is None else pg.rank()


def get_world_size() -> int:
    pg = _default_group()
    return 1 if pg is None else pg.size()


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


def _issued(buf: torch.Tensor, work) -> torch.Tensor:
    """``buf``, which ``work`` fills, in flight (or ``buf`` when nothing is pending)."""
    return buf if work is None else AsyncCollectiveTensor(buf, Flight([work]))


def all_reduce(t: torch.Tensor, op: str, group, *, _fresh: bool = False,
               async_op: bool = False) -> torch.Tensor:
    """Reduce ``t`` over ``group`` with ``op`` (a ``Partial`` reduce op); returns a new tensor."""
    t = settle(t)
    if t.numel() == 0:
        return t.clone()
    if op.startswith(NORM_PREFIX):  # p-norm pieces: a sum of powers, or a max
        p = norm_order(op)
        buf, how = _norm_wire.to_wire(t, p)
        # A power or the bits' view is a new tensor nobody else holds: no copy.
        reduced = all_reduce(buf, how, group, _fresh=buf is not t, async_op=async_op)
        return _norm_wire.from_wire(reduced, p, t.dtype)
    count("all_reduce", t)
    buf, back = _wire(t, op)
    if not (_fresh or _tracing()) and buf.data_ptr() == t.data_ptr():
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
    else:
        wire = torch.view_as_real(buf) if buf.is_complex() else buf
        buf = _issued(buf, dist.all_reduce(wire, op=_REDUCE[op], group=group,
                                           async_op=async_op))
    if op == "avg":  # waits for an in-flight sum (the division reads it)
        n = dist.get_world_size(group)
        buf = buf / n if buf.is_floating_point() or buf.is_complex() else buf // n
    return _restore(buf, back)


def all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    """All ranks' ``t`` (same shape on every rank), in group-rank order."""
    return list(all_gather_stacked(t, group).unbind(0))


def all_gather_stacked(t: torch.Tensor, group) -> torch.Tensor:
    """All ranks' ``t`` (same shape on every rank) stacked on a new leading
    dim in group-rank order: ``(n, *t.shape)``, for callers that combine the
    ranks' values with one vectorized op instead of a loop over ranks."""
    return _gather_stacked(settle(t), group, False)


def all_gather_cat(t: torch.Tensor, group, *, async_op: bool = False) -> torch.Tensor:
    """All ranks' ``t`` concatenated along dim 0 (same shape on every rank).

    The result is the buffer the backend fills, viewed: no copy after the
    collective (for dtypes sent through a wider carrier, one cast back).
    """
    t = settle(t)
    n = dist.get_world_size(group)
    if t.numel() == 0 or t.dtype in _CARRIERS or t.is_complex():
        return _gather_stacked(t, group, async_op).flatten(0, 1)
    count("all_gather", t, n)
    t = t.contiguous()
    if _tracing():
        return _funcol_gather(t, 0, group)
    out = torch.empty((n * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    return _issued(out, _all_gather_single(out, t, group=group, async_op=async_op))


def gather_chunks(t: torch.Tensor, dim: int, length: int, group, *,
                  async_op: bool = False) -> torch.Tensor:
    """The tensor of ``length`` rows along ``dim`` that ``torch.chunk`` split
    over ``group``, from this rank's piece ``t`` (the inverse of the cut of a
    ``Shard(dim)``). Pieces hold ``ceil(length / n)`` rows, trailing ones
    fewer or none; shorter ones are padded before the all-gather.

    The gathered buffer is the result, viewed, when the dims before ``dim``
    have one element (``dim`` 0, or a block like ``(1, k)``): the padded
    pieces then lie end to end, the padding after the last real row. Else
    each rank's real rows are joined by one ``cat``. Example (2 ranks)::

        >>> gather_chunks(torch.arange(2.).view(1, 2) + 2 * rank, 1, 3, group)
        tensor([[0., 1., 2.]])      # rank 1's piece was [[2.]], padded
    """
    n = dist.get_world_size(group)
    piece = -(-length // n)
    if t.shape[dim] != piece:  # uneven: pad to the largest piece
        padded = t.new_zeros((*t.shape[:dim], piece, *t.shape[dim + 1:]))
        padded.narrow(dim, 0, t.shape[dim]).copy_(settle(t))
        t = padded
    return unpack_chunks(all_gather_cat(t, group, async_op=async_op), n, dim, length)


def unpack_chunks(stacked: torch.Tensor, n: int, dim: int, length: int) -> torch.Tensor:
    """``gather_chunks``' result from the ``n`` padded pieces stacked on dim 0:
    a view of ``stacked`` where the layout allows, else one ``cat``."""
    block = [stacked.shape[0] // n, *stacked.shape[1:]]  # one rank's padded piece
    piece = block[dim]
    if math.prod(block[:dim]) == 1:
        whole = (*block[:dim], n * piece, *block[dim + 1:])
        out = stacked.view(whole) if dim else stacked  # dim 0: already that shape
        return out if n * piece == length else out.narrow(dim, 0, length)
    sizes = [max(0, min(piece, length - i * piece)) for i in range(n)]
    blocks = stacked.view(n, *block).unbind(0)
    return torch.cat([b.narrow(dim, 0, k) for b, k in zip(blocks, sizes, strict=True)], dim)


def _gather_stacked(t: torch.Tensor, group, async_op: bool) -> torch.Tensor:
    """All ranks' ``t`` stacked on a new leading dim: ``(n, *t.shape)``."""
    n = dist.get_world_size(group)
    if t.numel() == 0:  # same padded shape everywhere, so nobody sends
        return t.new_empty((n, *t.shape))
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
        out = _issued(out, _all_gather_single(out, flat, group=group, async_op=async_op))
    out = out.view(n, *buf.shape)
    if t.is_complex():
        out = torch.view_as_complex(out)
    out = _restore(out, back)
    assert out.shape[1:] == shape
    return out


def reduce_scatter(t: torch.Tensor, op: str, dim: int, group, *,
                   async_op: bool = False) -> torch.Tensor:
    """Reduce ``t`` over ``group`` with ``op`` and keep this rank's chunk of ``dim``.

    The chunks are ``torch.chunk``'s (pieces of ``ceil(size / n)``, trailing
    ones shorter or empty), the layout of a ``Shard(dim)``: the reduced value
    equals ``all_reduce`` then that chunk, at half the wire bytes. Every rank
    passes the same shape. Example (2 ranks, each holding ``[1, 2, 3]``)::

        >>> reduce_scatter(torch.tensor([1., 2., 3.]), "sum", 0, group)
        tensor([2., 4.])    # rank 0; rank 1 gets tensor([6.])
    """
    t = settle(t)
    if op.startswith(NORM_PREFIX):
        p = norm_order(op)
        buf, how = _norm_wire.to_wire(t, p)
        out = reduce_scatter(buf, how, dim, group, async_op=async_op)
        return _norm_wire.from_wire(out, p, t.dtype)
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
        out = _issued(out, _reduce_scatter_single(out, buf, op=_REDUCE[op], group=group,
                                                  async_op=async_op))
    if t.is_complex():
        out = torch.view_as_complex(out)
    if op == "avg":
        out = out / n if out.is_floating_point() or out.is_complex() else out // n
    out = _restore(out, back)
    return out.narrow(0, 0, keep).movedim(0, dim).contiguous()


def scatter(pieces: list[torch.Tensor] | None, like: torch.Tensor, src_group_rank: int,
            group) -> torch.Tensor:
    """Group rank ``i`` receives ``pieces[i]`` from group rank ``src_group_rank``
    (only the source passes ``pieces``, all of ``like``'s shape and dtype; the
    others pass None). Each rank receives one piece, where a broadcast of the
    whole would send every piece to everyone. Example (2 ranks, source 0)::

        >>> scatter([torch.zeros(2), torch.ones(2)] if rank == 0 else None,
        ...         torch.empty(2), 0, group)
        tensor([1., 1.])    # on rank 1
    """
    n = dist.get_world_size(group)
    pieces = None if pieces is None else [settle(p) for p in pieces]
    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    count("scatter", like, n)
    buf, back = _wire(out)
    wires = None
    if pieces is not None:
        wires = [_wire(p)[0] for p in pieces]
    if buf.is_complex():
        buf = torch.view_as_real(buf)
        wires = None if wires is None else [torch.view_as_real(w) for w in wires]
    dist.scatter(buf, wires, group_src=src_group_rank, group=group)
    if like.is_complex():
        buf = torch.view_as_complex(buf)
    return _restore(buf, back)


def broadcast(t: torch.Tensor, src_group_rank: int, group) -> torch.Tensor:
    """``t`` from group rank ``src_group_rank`` to all; returns the received tensor."""
    t = settle(t)
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
