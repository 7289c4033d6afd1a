"""Redistribute: a pure plan of per-axis steps, then their execution.

``plan(src, dst, mesh_shape, global_shape)`` turns two placement tuples into
a tuple of ``Step`` values without touching the network; ``execute`` runs
them on a local tensor through ``dtensor._comm``; ``redistribute_local``
does both for a block of a ``DTensorSpec``. Plans are cached per (src, dst,
mesh shape, global shape).

Two candidates compete on wire bytes (``dtensor._plan_cost``): the phase
plan below, and the cheapest ordering of the same per-axis steps found by a
search (it may, say, gather a Partial block before reduce-scattering the
smaller block the gather frees, or reduce-scatter a Partial axis that ends
Replicate and gather it back after the other axes' reductions). Ties keep
the phase plan. The phase plan has four phases; before the first
and after every gather, replicated axes whose target shard can already be cut
in nesting order are sliced (free, and every later collective moves less):

1. reduce: every ``Partial`` axis whose target differs is all-reduced, or,
   when its target is ``Shard(d)`` and that shard can be cut right away (see
   ``can_cut``), reduce-scattered: half the wire bytes of an all-reduce,
   and every later step moves 1/n of the data.
2. gather: for each tensor dim, the axes that shard it in the source but are
   not part of the longest common prefix with the target are all-gathered,
   innermost axis first over all dims (with nested sharding only the innermost piece can be
   gathered without reordering rows, the bug behind upstream issue 194457).
3. slice: target shards not yet in place are cut locally, outer axis first.
4. partial: ``Replicate`` axes that become ``Partial`` keep the value on
   every coordinate (idempotent ops) or on coordinate 0, the op's identity
   elsewhere (sum, product, bxor); see ``_to_partial``.

Several ``Partial`` axes reduce in axis order; an axis the target keeps
partial is still reduced (and made partial again) when a higher axis with a
non-commuting op is reduced (``_kept_but_reduced``).

Example:
    >>> plan((Shard(0), Shard(0)), (Replicate(), Shard(0)), (2, 2))
    (Step(axis=1, kind='gather', ...), Step(axis=0, kind='gather', ...),
     Step(axis=1, kind='slice', ...))
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dtensor import _comm
from dtensor._norm_wire import refuse_negative
from dtensor._plan_cost import (
    can_cut,
    cheapest_moves,
    even_shape,
    plan_cost,
    reduce_runs,
)
from dtensor.errors import PlacementError
from dtensor.placement import Partial, Placement, Replicate, Shard
from dtensor.spec import DTensorSpec, local_block, shard_range
from dtensor.strided import has_strided
from dtensor.strided import redistribute as _strided_redistribute

__all__ = [
    "Step",
    "commute",
    "empty_local",
    "execute",
    "plan",
    "redistribute_local",
]


@dataclass(frozen=True, slots=True)
class Step:
    """One transition on one mesh axis.

    kind: ``reduce`` (Partial → Replicate), ``reduce_scatter`` (Partial →
    Shard), ``gather`` (Shard → Replicate), ``slice`` (Replicate → Shard),
    ``to_partial`` (Replicate → Partial).
    ``before`` is the full placement tuple before the step runs.
    """

    axis: int
    kind: str
    src: Placement
    dst: Placement
    before: tuple[Placement, ...]

    def __str__(self) -> str:
        return f"{self.kind}@{self.axis}:{self.src}->{self.dst}"


def _shard_order(placements: Sequence[Placement], dim: int) -> list[int]:
    return [a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim]


def plan(
    src: Sequence[Placement],
    dst: Sequence[Placement],
    mesh_shape: Sequence[int],
    global_shape: Sequence[int] | None = None,
) -> tuple[Step, ...]:
    """Steps that turn layout ``src`` into ``dst`` (pure; no communication).

    ``global_shape`` prices uneven shapes' padding when orderings are
    compared; without it the plan is the cheapest for an evenly split shape.
    Axes of size 1 never need communication but are still planned, so the
    placement bookkeeping stays exact; ``execute`` skips their collectives.
    """
    shape = None if global_shape is None else tuple(global_shape)
    return _plan(tuple(src), tuple(dst), tuple(mesh_shape), shape)


@functools.lru_cache(maxsize=4096)
def _plan(src: tuple, dst: tuple, mesh_shape: tuple, global_shape: tuple | None) -> tuple[Step, ...]:
    if src == dst:
        return ()
    if has_strided(src) or has_strided(dst):  # checked on a cache miss only
        raise PlacementError(
            f"plan: {src} -> {dst} has StridedShard axes, which have no per-axis "
            "steps; redistribute_local moves them (gather, then cut locally)"
        )
    redo = _kept_but_reduced(src, dst)
    if redo:
        # Reduce those axes too, then make them partial again (see below).
        mid = tuple(Replicate() if a in redo else d for a, d in enumerate(dst))
        return _plan(src, mid, mesh_shape, global_shape) + _plan(mid, dst, mesh_shape, global_shape)
    shape = global_shape if global_shape is not None else even_shape(src, dst, mesh_shape)
    ordered = _phase_plan(src, dst)
    # NOTE: no fixed ordering is cheapest everywhere: reducing a Partial axis
    # after the gathers lets it reduce-scatter a smaller block, but with two
    # gathers in between it moves more. So the phase plan competes with the
    # cheapest ordering the executor supports, and keeps ties (its orderings
    # are the documented, tested ones).
    ops = {s.reduce_op for s, d in zip(src, dst, strict=True)
           if isinstance(s, Partial) and s != d}
    target = tuple(Replicate() if isinstance(d, Partial) and s != d else d
                   for s, d in zip(src, dst, strict=True))
    moves = cheapest_moves(src, target, mesh_shape, shape,
                           in_axis_order=not (ops <= {"sum", "avg"} or len(ops) == 1),
                           budget=plan_cost(ordered, mesh_shape, shape) - 1e-9)
    return ordered if moves is None else _replay(src, dst, moves)


def commute(a: str, b: str) -> bool:
    """Reducing over two mesh axes with ops ``a`` and ``b`` gives the same
    value in either order (same op, or both linear)."""
    return a == b or {a, b} <= {"sum", "avg"}


def _kept_but_reduced(src: tuple, dst: tuple) -> tuple[int, ...]:
    """Partial axes the target keeps whose reduction must still happen now.

    Pieces on several Partial axes reduce in axis order (axis 0 first). A
    higher axis can only be reduced while a lower one stays partial when the
    two ops commute: ``max_j sum_i x[i, j]`` is not ``sum_i max_j x[i, j]``.
    Otherwise the lower axis is reduced first and made partial again.
    """
    redo = []
    for a, (s, d) in enumerate(zip(src, dst, strict=True)):
        if isinstance(s, Partial) and s == d and any(
            isinstance(q, Partial) and q != dst[k] and not commute(s.reduce_op, q.reduce_op)
            for k, q in enumerate(src[a + 1:], start=a + 1)
        ):
            redo.append(a)
    return tuple(redo)


def _replay(src: tuple, dst: tuple, moves) -> tuple[Step, ...]:
    """Steps for ``moves``, then Replicate -> Partial where ``dst`` asks for it."""
    cur = list(src)
    steps = []
    for axis, kind, new in moves:
        steps.append(Step(axis, kind, cur[axis], new, tuple(cur)))
        cur[axis] = new
    for axis, d in enumerate(dst):
        if isinstance(d, Partial) and cur[axis] != d:
            steps.append(Step(axis, "to_partial", cur[axis], d, tuple(cur)))
            cur[axis] = d
    assert tuple(cur) == dst, (src, dst, cur)
    return tuple(steps)


def _phase_plan(src: tuple, dst: tuple) -> tuple[Step, ...]:
    """The four-phase plan of the module docstring."""
    redo = _kept_but_reduced(src, dst)
    if redo:
        mid = tuple(Replicate() if a in redo else d for a, d in enumerate(dst))
        return _phase_plan(src, mid) + _phase_plan(mid, dst)
    cur = list(src)
    steps: list[Step] = []

    def emit(axis: int, kind: str, new: Placement) -> None:
        steps.append(Step(axis, kind, cur[axis], new, tuple(cur)))
        cur[axis] = new

    def slice_early() -> None:
        # A cut is free and shrinks every later collective, so a replicated
        # axis takes its target shard as soon as the nesting allows it.
        for axis, d in enumerate(dst):
            if cur[axis] == Replicate() and isinstance(d, Shard):
                if can_cut(cur, dst, axis, d.dim):
                    emit(axis, "slice", d)

    # 0. slice what can be cut before anything moves.
    slice_early()

    # 1. reduce pending partial sums that the target does not keep. When the
    # reductions commute (sum/avg only, or one op throughout), reduce-scatters
    # go first and free cuts follow, so the all-reduces move 1/n of the data.
    pending = [a for a, (s, d) in enumerate(zip(src, dst, strict=True))
               if isinstance(s, Partial) and s != d]
    ops = {src[a].reduce_op for a in pending}
    if ops <= {"sum", "avg"} or len(ops) == 1:
        for axis in pending:
            d = dst[axis]
            if isinstance(d, Shard) and can_cut(cur, dst, axis, d.dim):
                emit(axis, "reduce_scatter", d)
        slice_early()
    for axis in pending:
        d = dst[axis]
        if cur[axis] != src[axis]:
            continue  # reduce-scattered above
        if isinstance(d, Shard) and can_cut(cur, dst, axis, d.dim):
            emit(axis, "reduce_scatter", d)
        else:
            emit(axis, "reduce", Replicate())

    # 2. gather source shards outside the common prefix, innermost first.
    # All dims at once, inner axis first: an inner gather can free an axis
    # whose cut then shrinks the outer gathers, whatever dim they move.
    dims = {p.dim for p in src + dst if isinstance(p, Shard)}
    gathers = []
    for dim in sorted(dims):
        s_axes, d_axes = _shard_order(cur, dim), _shard_order(dst, dim)
        keep = 0
        while keep < min(len(s_axes), len(d_axes)) and s_axes[keep] == d_axes[keep]:
            keep += 1
        gathers += s_axes[keep:]
    for axis in sorted(gathers, reverse=True):
        emit(axis, "gather", Replicate())
        slice_early()

    # 3. slice target shards, outer axis first (left-to-right nesting).
    for axis, d in enumerate(dst):
        if isinstance(d, Shard) and cur[axis] != d:
            emit(axis, "slice", d)

    # 4. replicate -> partial.
    for axis, d in enumerate(dst):
        if isinstance(d, Partial) and cur[axis] != d:
            emit(axis, "to_partial", d)

    assert tuple(cur) == dst, (src, dst, cur)
    return tuple(steps)


def execute(
    local: torch.Tensor,
    steps: Sequence[Step],
    global_shape: Sequence[int],
    mesh,
    *,
    async_op: bool = False,
) -> torch.Tensor:
    """Run ``steps`` on this rank's ``local`` block; returns the new local block.

    Must be called by every member of ``mesh``; outsiders never call it.
    ``async_op``: collectives are issued without waiting; a step waits for
    the previous step's result when it reads it, and the last result may be
    returned in flight (``dtensor._async.AsyncCollectiveTensor``).
    """
    coord = mesh.get_coordinate()
    runs, skip = reduce_runs(steps), 0
    for i, step in enumerate(steps):
        if i < skip:
            continue  # reduced with the run that starts before it
        n = mesh.shape[step.axis]
        group = mesh.axis_group(step.axis) if n > 1 else None
        if i in runs:  # several axes' reductions: one all-reduce over all their ranks
            skip = runs[i]
            group = _axes_group(mesh, [s.axis for s in steps[i:skip]], coord)
        if step.kind == "reduce":
            if group is not None:
                local = _comm.all_reduce(local, step.src.reduce_op, group,
                                         async_op=async_op)
        elif step.kind == "reduce_scatter":
            if group is not None:
                _, length = _outer_range(step, global_shape, mesh.shape, coord, step.dst.dim)
                assert local.shape[step.dst.dim] == length, (local.shape, length, step)
                local = _comm.reduce_scatter(local, step.src.reduce_op, step.dst.dim, group,
                                             async_op=async_op)
            else:
                local = _slice(local, step, global_shape, mesh.shape, coord)
        elif step.kind == "gather":
            if group is not None:
                local = _gather(local, step, global_shape, mesh.shape, coord, group,
                                async_op)
        elif step.kind == "slice":
            local = _slice(local, step, global_shape, mesh.shape, coord)
        elif step.kind == "to_partial":
            local = _to_partial(local, step, coord)
        else:  # pragma: no cover - plan() emits only the kinds above
            raise AssertionError(step.kind)
    return local


def _axes_group(mesh, axes, coord):
    """The group of the ranks that differ from this one only along ``axes``
    (None when that is this rank alone)."""
    wide = [a for a in axes if mesh.shape[a] > 1]
    if len(wide) <= 1:
        return mesh.axis_group(wide[0]) if wide else None
    index = tuple(slice(None) if a in wide else c for a, c in enumerate(coord))
    return _comm.group_for(mesh.mesh[index].reshape(-1).tolist())


def _to_partial(local: torch.Tensor, step: Step, coord) -> torch.Tensor:
    """This coordinate's piece when ``step.axis`` turns Replicate into Partial.

    Idempotent ops (avg, max, min, band, bor) keep the value everywhere.
    Otherwise coordinate 0 keeps it and the others hold pieces that reduce to
    the op's identity (0 for sum and bxor, 1 for product). Lower Partial axes
    are reduced first (axis order), so a rank at a non-zero coordinate of such
    an axis holds that axis's identity instead: its slice then still reduces
    to the identity this axis needs.
    """
    p = step.dst
    if p.norm_order is not None:
        refuse_negative(local, f"redistribute {step.src} -> {p} on mesh axis {step.axis}: "
                        "the value", p)
    if p.is_idempotent or coord[step.axis] == 0:
        return local
    fill = p.identity()
    for a in range(step.axis):
        q = step.before[a]
        if isinstance(q, Partial) and not q.is_idempotent and coord[a] != 0:
            fill = q.identity()
            break
    return torch.full_like(local, fill)


def redistribute_local(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec, *,
                       async_op: bool = False) -> torch.Tensor:
    """Move ``local`` (a block of ``src``) to its block of ``dst``.

    Outsiders of the mesh never communicate: they keep their (empty) block.
    ``async_op``: the result may still be in flight (see ``execute``);
    StridedShard moves complete before returning.
    """
    mesh = src.mesh
    if mesh.get_coordinate() is None:
        return local if src.placements == dst.placements else empty_local(dst, local.device)
    if src.placements != dst.placements and (
            has_strided(src.placements) or has_strided(dst.placements)):
        return _strided_redistribute(local, src, dst, redistribute_local)
    steps = plan(src.placements, dst.placements, mesh.shape, src.shape)
    if not steps:
        return local
    return execute(local, steps, src.shape, mesh, async_op=async_op)


def empty_local(spec: DTensorSpec, device) -> torch.Tensor:
    """An empty block of ``spec``'s dtype: what a rank outside the mesh holds."""
    shape, _ = local_block(spec.shape, spec.mesh.shape, spec.placements, None)
    return torch.empty(shape, dtype=spec.dtype, device=device)


def _outer_range(step, global_shape, mesh_shape, coord, dim) -> tuple[int, int]:
    """(offset, length) along ``dim`` of the block that ``step.axis`` splits."""
    outer = [
        p if a < step.axis else Replicate() for a, p in enumerate(step.before)
    ]
    shape, offset = local_block(global_shape, mesh_shape, outer, coord)
    return offset[dim], shape[dim]


def _gather(local, step, global_shape, mesh_shape, coord, group, async_op) -> torch.Tensor:
    _, length = _outer_range(step, global_shape, mesh_shape, coord, step.src.dim)
    return _comm.gather_chunks(local, step.src.dim, length, group, async_op=async_op)


def _slice(local, step, global_shape, mesh_shape, coord) -> torch.Tensor:
    dim = step.dst.dim
    n = mesh_shape[step.axis]
    _, length = _outer_range(step, global_shape, mesh_shape, coord, dim)
    assert local.shape[dim] == length, (local.shape, dim, length, step)
    start, size = shard_range(length, n, coord[step.axis])
    # clone: the shard must not alias the replicated source (a later in-place
    # op on one would silently change the other).
    return local.narrow(dim, start, size).clone()
