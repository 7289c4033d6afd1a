"""Strided (interleaved) sharding: which rows a block holds, FSDP + TP
placements, and redistribution to and from ``StridedShard``.

``StridedShard(dim, split_factor)`` (``dtensor.placement``) is the layout
FSDP gives a parameter that tensor parallelism already sharded on the same
dim: its rows are several runs of the global dim, not one. ``block_runs``
says which; ``fsdp_tp_placements`` builds the placements for a ``(dp, tp)``
mesh and refuses sizes the layout cannot express; ``redistribute`` moves a
block between any layout and one with ``StridedShard`` axes (called by
``dtensor.redistribute.redistribute_local``): it gathers the strided axes
(and the axes nested inside them on the same dim), runs the ordinary plan
for the rest, then cuts the target's strided axes locally.

Example (FSDP + TP on a ``(dp, tp) = (2, 2)`` mesh, an 8-row weight):
    >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    >>> tp_w = distribute_tensor(w, mesh["tp"], [Shard(0)])  # ColwiseParallel's
    >>> ps = fsdp_tp_placements(mesh, tp_w.placements[0], tp_w.shape)
    >>> ps
    (StridedShard(dim=0, split_factor=2), Shard(dim=0))
    >>> # FSDP's cut: dp piece i of this rank's TP block (torch.chunk)
    >>> i = mesh.get_local_rank("dp")
    >>> block = torch.chunk(tp_w.to_local(), 2)[i]       # 2 of its 4 rows
    >>> p = DTensor.from_local(block, mesh, ps, shape=tp_w.shape)
    >>> torch.equal(p.full_tensor(), w)                 # the rows in order
    True
    >>> block_runs((8, 4), (2, 2), ps, (0, 1))          # rank (0, 1): rows 4-5
    (((4, 2),), ((0, 4),))
    >>> p.redistribute(mesh, (Replicate(), Shard(0)))   # FSDP's all-gather
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from dtensor import _comm
from dtensor.errors import PlacementError
from dtensor.placement import (
    Placement,
    Replicate,
    Shard,
    StridedShard,
    format_placements,
)
from dtensor.spec import DTensorSpec, cut_runs, local_shape, shard_range

__all__ = ["block_runs", "draw_runs", "fsdp_tp_placements", "has_strided", "redistribute",
           "unstrided"]

Runs = tuple[tuple[int, int], ...]


def has_strided(placements: Sequence[Placement]) -> bool:
    """Any axis of ``placements`` is a ``StridedShard``."""
    return any(isinstance(p, StridedShard) for p in placements)


def unstrided(specs: tuple[DTensorSpec, ...]) -> tuple[DTensorSpec, ...]:
    """``specs`` with every ``StridedShard`` axis ``Replicate`` (the same tuple
    when there is none): the layout op rules are asked about."""
    if not any(has_strided(s.placements) for s in specs):
        return specs
    return tuple(s.with_placements(tuple(Replicate() if isinstance(p, StridedShard) else p
                                         for p in s.placements)) for s in specs)


def block_runs(global_shape: Sequence[int], mesh_shape: Sequence[int],
               placements: Sequence[Placement], coordinate: Sequence[int]
               ) -> tuple[Runs, ...]:
    """Per tensor dim, the (start, length) runs of global indices the block
    at ``coordinate`` holds, in local order (``local_block`` generalised to
    ``StridedShard``). Mesh axes cut the dim's current rows left to right.

    Example:
        >>> block_runs((8, 3), (2, 2), (StridedShard(0, 2), Shard(0)), (1, 0))
        (((2, 2),), ((0, 3),))
    """
    rows: list[list[int]] = [list(range(n)) for n in global_shape]
    for axis, p in enumerate(placements):
        if isinstance(p, (Shard, StridedShard)):
            have = rows[p.dim]
            cut = cut_runs(len(have), p, mesh_shape[axis], coordinate[axis])
            rows[p.dim] = [have[i] for start, n in cut for i in range(start, start + n)]
    return tuple(_as_runs(r) for r in rows)


def draw_runs(spec: DTensorSpec, coordinate, seed, offset, make, device) -> torch.Tensor:
    """The block at ``coordinate`` of a counter-based draw, whose values are a
    function of the global index: ``make(seed, offset, global_shape, start,
    shape, device=)`` draws one box per combination of runs, put together in
    local order (the single-device values, as for contiguous blocks)."""
    runs = block_runs(spec.shape, spec.mesh.shape, spec.placements, coordinate)

    def box(d: int, start: list, shape: list) -> torch.Tensor:
        if d == len(runs):
            return make(seed, offset, spec.shape, tuple(start), tuple(shape), device=device)
        parts = [box(d + 1, [*start, s], [*shape, n]) for s, n in runs[d] or ((0, 0),)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)

    return box(0, [], [])


def _as_runs(indices: list[int]) -> Runs:
    out: list[tuple[int, int]] = []
    for g in indices:
        if out and out[-1][0] + out[-1][1] == g:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((g, 1))
    return tuple(out)


def fsdp_tp_placements(mesh, tp_placement: Placement, global_shape: Sequence[int], *,
                       dp_axis: int | str = "dp", tp_axis: int | str = "tp"
                       ) -> tuple[Placement, ...]:
    """Placements of a parameter laid out by TP as ``tp_placement`` on
    ``tp_axis`` once FSDP shards each TP block's dim 0 over ``dp_axis``
    (every other mesh axis ``Replicate``, as HSDP's replicate axis).

    Rank ``(i, j)`` holds dp piece ``i`` (``torch.chunk`` of the TP block's
    dim 0) of TP block ``j``. When both shard dim 0 and ``dp_axis`` comes
    first, that is ``StridedShard(0, split_factor=tp size)`` on ``dp_axis``.
    Raises ``PlacementError`` for a dim-0 size where no placements say
    exactly that (uneven TP blocks whose dp pieces do not line up); padding
    dim 0 to a multiple of dp size * tp size always works.

    Example:
        >>> fsdp_tp_placements(mesh, Shard(0), (8, 4))       # mesh ("dp", "tp")
        (StridedShard(dim=0, split_factor=2), Shard(dim=0))
        >>> fsdp_tp_placements(mesh, Shard(1), (8, 4))
        (Shard(dim=0), Shard(dim=1))
    """
    dp, tp = mesh._axis(dp_axis), mesh._axis(tp_axis)
    ndim = len(global_shape)
    if dp == tp or ndim == 0:
        raise PlacementError(
            f"fsdp_tp_placements: expected two different mesh axes and a tensor with "
            f"a dim 0; got dp_axis={dp_axis!r}, tp_axis={tp_axis!r} on {mesh!r}, "
            f"shape {tuple(global_shape)}"
        )
    out: list[Placement] = [Replicate()] * mesh.ndim
    out[tp] = tp_placement
    out[dp] = Shard(0)
    both = isinstance(tp_placement, Shard) and tp_placement.dim in (0, -ndim)
    if not (both and dp < tp):
        return tuple(out)  # left-to-right nesting already cuts TP first
    out[tp] = Shard(0)
    if mesh.shape[tp] > 1:  # one TP block: plain nesting, the canonical value
        out[dp] = StridedShard(0, mesh.shape[tp])
    wrong = _misfit(global_shape[0], tuple(mesh.shape), tuple(out), dp, tp)
    if wrong is not None:
        i, j, want, got = wrong
        n_dp, n_tp, rows = mesh.shape[dp], mesh.shape[tp], global_shape[0]
        raise PlacementError(
            f"fsdp_tp_placements: dim 0 of size {rows} cut by tp={n_tp} then "
            f"dp={n_dp} gives rank (dp={i}, tp={j}) rows {want}, which "
            f"{format_placements(tuple(out))} cannot express (it holds {got}); "
            f"pad dim 0 to a multiple of {n_dp * n_tp}, or shard another dim "
            "with TP"
        )
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _misfit(rows: int, mesh_shape: tuple[int, ...], out: tuple[Placement, ...],
            dp: int, tp: int):
    """The first block ``(i, j, want, got)`` whose rows ``out`` does not give
    (TP block ``j``'s dp piece ``i``), else None. The same on every rank and
    linear in the rank count, so computed once per process, not per rank (a
    1,024-rank simulated world otherwise repeats it 1,024 times)."""
    n_dp, n_tp = mesh_shape[dp], mesh_shape[tp]
    for j in range(n_tp):
        tp_start, tp_len = shard_range(rows, n_tp, j)
        for i in range(n_dp):
            start, length = shard_range(tp_len, n_dp, i)
            want = ((tp_start + start, length),) if length else ()
            coord = [0] * len(mesh_shape)
            coord[dp], coord[tp] = i, j
            got = block_runs((rows,), mesh_shape, out, coord)[0]
            if got != want:
                return i, j, want, got
    return None


def redistribute(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec,
                 plain: Callable[[torch.Tensor, DTensorSpec, DTensorSpec], torch.Tensor],
                 ) -> torch.Tensor:
    """This member's block of ``dst`` from its block ``local`` of ``src``.

    Gathers (innermost first) every source axis at or after the first
    ``StridedShard`` that shards a dim some ``StridedShard`` shards, runs
    ``plain`` (the ordinary redistribution) to the target with the same rule
    applied to it, then cuts the target's remaining axes locally in axis
    order. Every member of the mesh calls it.
    """
    mesh, shape = src.mesh, src.shape
    coord = mesh.get_coordinate()
    cur = list(src.placements)
    for axis in reversed(_nested(src.placements)):
        local = _gather(local, cur, axis, shape, mesh, coord)
        cur[axis] = Replicate()
    cuts = _nested(dst.placements)
    mid = tuple(Replicate() if a in cuts else p for a, p in enumerate(dst.placements))
    mid_spec = dst.with_placements(mid)
    local = plain(local, src.with_placements(cur), mid_spec)
    for axis in cuts:
        p = dst.placements[axis]
        runs = cut_runs(local.shape[p.dim], p, mesh.shape[axis], coord[axis])
        local = _take(local, p.dim, runs)
    return local


def _nested(placements) -> list[int]:
    """Axes at or after the first StridedShard that shard one of its dims."""
    strided = [a for a, p in enumerate(placements) if isinstance(p, StridedShard)]
    if not strided:
        return []
    dims = {placements[a].dim for a in strided}
    return [a for a in range(strided[0], len(placements))
            if isinstance(placements[a], (Shard, StridedShard)) and placements[a].dim in dims]


def _take(local: torch.Tensor, dim: int, runs: Runs) -> torch.Tensor:
    """The rows ``runs`` of ``local`` along ``dim``, as a new tensor (no alias
    of the source: a later in-place op on one must not change the other)."""
    if len(runs) == 1:
        return local.narrow(dim, *runs[0]).clone()
    if not runs:
        return local.narrow(dim, 0, 0).clone()
    return torch.cat([local.narrow(dim, s, n) for s, n in runs], dim=dim)


def _gather(local, cur, axis, shape, mesh, coord) -> torch.Tensor:
    """Undo the cut of mesh axis ``axis`` (a Shard or StridedShard) whose inner
    axes on the same dim are already gathered: one all-gather of padded
    pieces, then the rows put back in order by runs (views, no index tensor)."""
    p, n = cur[axis], mesh.shape[axis]
    if n == 1:
        return local
    outer = [q if a < axis else Replicate() for a, q in enumerate(cur)]
    length = local_shape(shape, mesh.shape, outer, coord)[p.dim]
    cuts = [cut_runs(length, p, n, c) for c in range(n)]
    piece = max(sum(k for _, k in runs) for runs in cuts)
    if piece == 0:
        return local  # every piece empty: nothing to move
    moved = local.movedim(p.dim, 0)
    if moved.shape[0] != piece:  # uneven: pad to the largest piece
        pad = moved.new_zeros((piece - moved.shape[0], *moved.shape[1:]))
        moved = torch.cat([moved, pad])
    gathered = _comm.all_gather_cat(moved.contiguous(), mesh.axis_group(axis))
    # (start in block, start in gathered, length) for every run of every piece
    parts = []
    for c, runs in enumerate(cuts):
        pos = c * piece
        for start, k in runs:
            parts.append((start, pos, k))
            pos += k
    parts.sort()
    out = torch.cat([gathered.narrow(0, g, k) for _, g, k in parts])
    return out.movedim(0, p.dim).contiguous() if p.dim else out
