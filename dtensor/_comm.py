"""The only module that calls ``torch.distributed``.

Process groups for mesh axes are created here, once per distinct rank tuple,
by the member ranks only, under a name derived from the ranks alone. Neither
the world nor non-members take part, so a sub-mesh can be built by just its
ranks and never hangs the others. (``dist.new_group(use_local_synchronization=
True)`` cannot promise that: its group names depend on how many groups each
process made before, so members with different histories pick different
names and wait for each other forever.)

Collectives take plain local tensors and a group, and know nothing of specs.
Every call is counted when a ``CommCounter`` is active.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "all_gather",
    "all_reduce",
    "broadcast",
    "count",
    "get_rank",
    "group_for",
    "is_initialized",
]

# torch 2.13 renamed all_gather_into_tensor (now deprecated); 2.11 lacks the new name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_groups: dict[tuple, object] = {}
_groups_lock = threading.Lock()
_counters: list[Counter] = []

_REDUCE = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    # Gloo has no AVG: averaging is a sum then a division (see all_reduce).
    "avg": dist.ReduceOp.SUM,
}


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Global rank of this process; 0 when no process group is initialised."""
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def count(kind: str) -> None:
    for c in _counters:
        c[kind] += 1


def push_counter(c: Counter) -> None:
    _counters.append(c)


def pop_counter(c: Counter) -> None:
    _counters.remove(c)


def _world_key() -> int:
    # A re-initialised world (destroy + init in one process) must not reuse
    # groups of the old one.
    return id(dist.distributed_c10d._get_default_group())


def group_for(ranks: Sequence[int]):
    """The process group of exactly ``ranks`` (in that order); members only.

    Cached per rank tuple. The group spanning the whole world in rank order is
    the default group, so 1-D meshes over the world create nothing.
    """
    ranks = tuple(int(r) for r in ranks)
    key = (_world_key(), ranks)
    group = _groups.get(key)
    if group is not None:
        return group
    with _groups_lock:
        group = _groups.get(key)
        if group is None:
            group = _create_group(ranks)
            _groups[key] = group
    return group


def _create_group(ranks: tuple[int, ...]):
    me = dist.get_rank()
    if me not in ranks:
        raise AssertionError(f"rank {me} asked for group {ranks} it is not in")
    if ranks == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    c10d = dist.distributed_c10d
    name = "dtensor:" + "_".join(map(str, ranks))
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
def _wire(t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
    # Gloo reduces neither bool nor complex: send bytes / real views.
    if t.dtype == torch.bool:
        return t.to(torch.uint8), torch.bool
    return t.contiguous(), None


def all_reduce(t: torch.Tensor, op: str, group) -> torch.Tensor:
    """Reduce ``t`` over ``group`` with ``op`` (sum/avg/max/min); returns a new tensor."""
    if t.numel() == 0:
        return t.clone()
    count("all_reduce")
    buf, back = _wire(t)
    buf = buf.clone() if buf is t else buf
    if buf.is_complex():
        view = torch.view_as_real(buf)
        dist.all_reduce(view, op=_REDUCE[op], group=group)
    else:
        dist.all_reduce(buf, op=_REDUCE[op], group=group)
    if op == "avg":
        n = dist.get_world_size(group)
        buf = buf / n if buf.is_floating_point() or buf.is_complex() else buf // n
    return buf.to(back) if back is not None else buf


def all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    """All ranks' ``t`` (same shape on every rank), in group-rank order."""
    n = dist.get_world_size(group)
    if t.numel() == 0:  # same padded shape everywhere, so nobody sends
        return [t] * n
    count("all_gather")
    buf, back = _wire(t)
    shape = buf.shape
    if buf.is_complex():
        buf = torch.view_as_real(buf)
    flat = buf.reshape(-1)
    out = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
    _all_gather_single(out, flat, group=group)
    out = out.view(n, *buf.shape)
    if t.is_complex():
        out = torch.view_as_complex(out)
    if back is not None:
        out = out.to(back)
    assert out.shape[1:] == shape
    return list(out.unbind(0))


def all_gather_cat(t: torch.Tensor, group) -> torch.Tensor:
    """All ranks' ``t`` concatenated along dim 0 (same shape on every rank)."""
    n = dist.get_world_size(group)
    if t.numel() == 0 or t.dtype == torch.bool or t.is_complex():
        return torch.cat(all_gather(t, group), dim=0)
    count("all_gather")
    t = t.contiguous()
    out = torch.empty((n * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    _all_gather_single(out, t, group=group)
    return out


def broadcast(t: torch.Tensor, src_group_rank: int, group) -> torch.Tensor:
    """``t`` from group rank ``src_group_rank`` to all; returns the received tensor."""
    count("broadcast")
    buf, back = _wire(t)
    buf = buf.clone() if buf is t else buf
    target = torch.view_as_real(buf) if buf.is_complex() else buf
    dist.broadcast(target, group_src=src_group_rank, group=group)
    return buf.to(back) if back is not None else buf
