"""Shape classes of a rank's block, and a strategy that reaches each one.

Code that fills a block (random ops above all) takes different paths for an
empty block, a block that is one contiguous run of the global row-major
order (one full row, a partial row, several full rows, the short last piece
of an uneven dim) and a strided block (several runs). Generic strategies
reach some of these rarely; ``sharded_blocks(kind=...)`` builds layouts in
which at least one rank of the mesh holds a block of ``kind``.

Example:
    >>> sharded_blocks(world_size=4, kind="run")   # e.g. ((1, 7), S(1) on 4 ranks)
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from dtensor.placement import Placement, Replicate, Shard
from dtensor.testing.meshes import MeshLayout, check_int, mesh_layouts
from dtensor.testing.oracle import reference_block

__all__ = ["BLOCK_CLASSES", "BlockCase", "block_class", "block_classes", "mid_row_runs",
           "sharded_blocks"]

#: Shape classes of a block, simplest first.
BLOCK_CLASSES = ("empty", "one_row", "run", "strided")


def block_class(global_shape: Sequence[int], local_shape: Sequence[int]) -> str:
    """``empty``; ``one_row`` (one full row of a >= 2-D tensor); ``run`` (any
    other block whose elements are consecutive in row-major order, 0-d and
    1-D blocks included); ``strided`` (several runs)."""
    gs, ls = tuple(global_shape), tuple(local_shape)
    if math.prod(ls) == 0:
        return "empty"
    j = len(gs) - 1
    while j > 0 and ls[j] == gs[j]:
        j -= 1
    if any(n != 1 for n in ls[:max(j, 0)]):
        return "strided"
    if len(gs) >= 2 and ls[0] == 1 and ls[1:] == gs[1:] and gs[0] > 1:
        return "one_row"
    return "run"


@dataclass(frozen=True)
class BlockCase:
    """A mesh layout, a global shape and placements (dtensor's)."""

    layout: MeshLayout
    shape: tuple[int, ...]
    placements: tuple[Placement, ...]

    def classes(self) -> set[str]:
        """The shape classes of the blocks the mesh's ranks hold."""
        return set(_classes(tuple(self.shape), tuple(self.layout.shape), tuple(self.placements)))

    def __repr__(self) -> str:
        ps = ", ".join(map(str, self.placements))
        return f"BlockCase({list(self.shape)}, ({ps}) on {self.layout})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis' printer
        p.text(repr(self))


@functools.lru_cache(maxsize=256)
def _classes(shape: tuple[int, ...], mesh_shape: tuple[int, ...],
             placements: tuple) -> frozenset[str]:
    # Every coordinate of the mesh, in row-major order; cached because each
    # rank of a simulated world draws the same case (1024 ranks x 1024 blocks).
    out = set()
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        idx = reference_block(shape, mesh_shape, placements, coord)
        out.add(block_class(shape, [len(i) for i in idx]))
    return frozenset(out)


def block_classes(case: BlockCase) -> set[str]:
    return case.classes()


@st.composite
def _case(draw, world_size: int, kind: str, allow_sub_meshes: bool) -> BlockCase:
    layout = draw(mesh_layouts(world_size=world_size, allow_sub_meshes=allow_sub_meshes))
    axes = [a for a, n in enumerate(layout.shape) if n > 1]
    if not axes:  # a one-rank (sub-)mesh: every block is the whole tensor
        layout = MeshLayout((world_size,), tuple(range(world_size)))
        axes = [0]
    axis = draw(st.sampled_from(axes))
    n = layout.shape[axis]
    side = st.integers(0, 4)
    if kind == "empty":  # fewer elements than pieces: the last coordinates hold none
        ndim = draw(st.integers(1, 3))
        dim = draw(st.integers(0, ndim - 1))
        shape = [draw(side) for _ in range(ndim)]
        shape[dim] = draw(st.integers(0, n - 1))
    elif kind == "one_row":  # at most one row per piece, full rows
        ndim = draw(st.integers(2, 3))
        dim = 0
        shape = [draw(st.integers(1, n))] + [draw(st.integers(1, 4)) for _ in range(ndim - 1)]
        shape[0] = max(shape[0], 2)
    elif kind == "run":  # leading size-1 dims, or several full rows of an uneven dim
        ndim = draw(st.integers(1, 3))
        dim = draw(st.integers(0, ndim - 1))
        shape = [1] * dim + [draw(st.integers(n + 1, 3 * n + 1))]
        shape += [draw(st.integers(1, 3)) for _ in range(ndim - dim - 1)]
    elif kind == "strided":  # several rows, part of each
        ndim = draw(st.integers(2, 3))
        dim = draw(st.integers(1, ndim - 1))
        shape = [draw(st.integers(2, 4)) for _ in range(ndim)]
        shape[dim] = draw(st.integers(n, 3 * n + 1))
    else:
        raise InvalidArgument(f"sharded_blocks: kind={kind!r} must be one of {BLOCK_CLASSES}")
    ps: list[Placement] = []
    for a in range(layout.ndim):
        if a == axis:
            ps.append(Shard(dim))
        elif kind != "empty":
            ps.append(Replicate())  # another cut could change the block's class
        else:
            ps.append(draw(st.sampled_from([Replicate(), Shard(dim)])))
    return BlockCase(layout, tuple(shape), tuple(ps))


def sharded_blocks(*, world_size: int, kind: str,
                   allow_sub_meshes: bool = False) -> st.SearchStrategy[BlockCase]:
    """Layouts where some rank of the mesh holds a block of shape class ``kind``.

    Args:
        world_size: ranks of the test's world (>= 2).
        kind: one of ``BLOCK_CLASSES``.
        allow_sub_meshes: also meshes that leave ranks out.
    """
    fn = "sharded_blocks"
    check_int(fn, "world_size", world_size, min_value=2)
    if kind not in BLOCK_CLASSES:
        raise InvalidArgument(f"{fn}: kind={kind!r} must be one of {BLOCK_CLASSES}")
    return _case(world_size, kind, allow_sub_meshes)


@st.composite
def _mid_row(draw, world_size: int, allow_sub_meshes: bool) -> BlockCase:
    layout = draw(mesh_layouts(world_size=world_size, allow_sub_meshes=allow_sub_meshes))
    axes = [a for a, n in enumerate(layout.shape) if n > 1]
    if not axes:  # a one-rank (sub-)mesh: every block is the whole tensor
        layout = MeshLayout((world_size,), tuple(range(world_size)))
        axes = [0]
    col_axis = draw(st.sampled_from(axes))
    others = [a for a in axes if a != col_axis]
    row_axis = draw(st.sampled_from(others)) if others else None
    n_col = layout.shape[col_axis]
    cols = draw(st.integers(n_col + 1, 3 * n_col + 1))  # uneven: runs start mid-row
    lead = draw(st.integers(0, 2))  # size-1 dims before the rows
    if row_axis is None:
        shape = [1] * lead + [cols]
        ps_by_axis = {col_axis: Shard(lead)}
    else:  # one row per piece along row_axis: each block is one run of a row
        rows = draw(st.integers(1, layout.shape[row_axis]))
        mid = draw(st.integers(0, 1))  # size-1 dims between rows and columns
        shape = [1] * lead + [rows] + [1] * mid + [cols]
        ps_by_axis = {row_axis: Shard(lead), col_axis: Shard(lead + 1 + mid)}
    ps = tuple(ps_by_axis.get(a, Replicate()) for a in range(layout.ndim))
    return BlockCase(layout, tuple(shape), ps)


def mid_row_runs(*, world_size: int,
                 allow_sub_meshes: bool = False) -> st.SearchStrategy[BlockCase]:
    """Layouts where ranks hold one contiguous run that starts mid-row: the
    last dim is sharded unevenly and, where the mesh has two axes of size > 1,
    another axis cuts the rows one per piece, so a block's offset is non-zero
    in two dims (size-1 dims before and between them).

    Example:
        >>> mid_row_runs(world_size=4)   # e.g. ((2, 7), (S(0), S(1)) on (2, 2))
    """
    check_int("mid_row_runs", "world_size", world_size, min_value=2)
    return _mid_row(world_size, allow_sub_meshes)
