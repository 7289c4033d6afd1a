"""Mesh layouts: a checked grid of ranks, one object per layout in the process.

A ``Layout`` is what every mesh of the same ranks in the same shape shares:
the rank tuple, the grid, and what follows from them for each rank (its
coordinate, the ranks along each axis through it). ``dtensor._mesh_build``
checks a mesh's arguments into one; ``dtensor.mesh`` reads its rank's place
from it.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Sequence

import torch

from dtensor.errors import MeshError

__all__ = ["Layout", "real_tensors", "shared_layout", "unravel"]


def real_tensors() -> contextlib.AbstractContextManager:
    """A context for work on mesh grids, which are metadata: real tensors even
    while ``FakeTensorMode``, a tracing mode or another dispatch mode is on.

    A grid made under ``FakeTensorMode`` would be fake, and a kept layout
    holding it would break every later mesh of that layout in the process;
    a real grid read under it raises. Free when no mode is on.

    Example:
        >>> with real_tensors():
        ...     grid = torch.arange(4, device="cpu")
    """
    if not torch._C._len_torch_dispatch_stack():
        return contextlib.nullcontext()
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    """The coordinate of row-major index ``flat`` in a mesh of ``shape``.

    NOTE: plain integer math, not ``torch.unravel_index``: that one imports
    sympy on first use (about 0.6 s), which every first mesh paid.

    Example:
        >>> unravel(5, (2, 3))
        (1, 2)
    """
    total = math.prod(shape)
    if not 0 <= flat < total:
        raise MeshError(f"unravel: index {flat} is outside a mesh of shape {tuple(shape)} "
                        f"({total} ranks); expected 0 <= index < {total}")
    coord = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        coord.append(i)
    return tuple(reversed(coord))


# One layout object per (ranks, shape) in the process -------------------------------
class Layout:
    """A checked rank grid, shared by every mesh of that layout in the process.

    The ranks of a simulated world (threads of one process) each build the
    same meshes: a 1,024-rank world held 1,024 copies of every big mesh's rank
    tuple and grid (~70 MB for one 1-D mesh over the world), and each rank
    redid the checks, the coordinate search and the axis lines, O(ranks) work
    per rank. One ``Layout`` holds them once; what depends on a rank (its
    place, its lines) is computed on first use and shared. ``grid`` is a
    copy, so a caller's tensor changed later never changes a mesh.
    """

    __slots__ = ("_index", "_lines", "grid", "hash", "ranks", "shape")

    def __init__(self, ranks: tuple[int, ...], grid: torch.Tensor) -> None:
        self.ranks, self.grid, self.shape = ranks, grid, tuple(grid.shape)
        self.hash = hash((ranks, self.shape))  # tuples do not cache theirs
        self._index: dict[int, int] | None = None
        self._lines: dict[tuple, tuple[int, ...]] = {}

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """``rank``'s coordinate in the grid, or ``None`` when it is not in it."""
        index = self._index
        if index is None:
            index = self._index = {r: i for i, r in enumerate(self.ranks)}
        flat = index.get(rank)
        return None if flat is None else unravel(flat, self.shape)

    def line(self, coordinate: tuple[int, ...], axis: int) -> tuple[int, ...]:
        """The ranks along ``axis`` through ``coordinate``: one tuple per line,
        the same object for every rank on it."""
        if len(self.shape) == 1:
            return self.ranks
        key = (axis, *coordinate[:axis], *coordinate[axis + 1:])
        got = self._lines.get(key)
        if got is None:
            index = list(coordinate)
            index[axis] = slice(None)
            with _shared_lock, real_tensors():
                got = self._lines.setdefault(key, tuple(self.grid[tuple(index)].tolist()))
        return got


_SHARED_MAX = 512  # layouts kept; an evicted one stays alive in the meshes holding it
_shared: dict[tuple, Layout] = {}
_by_grid: dict[int, Layout] = {}  # id(layout.grid) -> layout, for the shared grids
_row_majors: dict[tuple[int, ...], torch.Tensor] = {}  # shape -> shared arange grid
_shared_lock = threading.Lock()


def shared_layout(ranks: tuple[int, ...], grid: torch.Tensor) -> Layout:
    """The ``Layout`` of ``ranks`` in ``grid``'s shape, one per layout in the process."""
    key = (ranks, tuple(grid.shape))
    with _shared_lock:
        hit = _shared.get(key)
        if hit is None:
            if len(_shared) >= _SHARED_MAX:
                old = _shared.pop(next(iter(_shared)))  # the oldest
                _by_grid.pop(id(old.grid), None)
            with real_tensors():
                hit = _shared[key] = Layout(ranks, grid.clone())
            _by_grid[id(hit.grid)] = hit
    return hit


def _layout_of(mesh) -> Layout | None:
    """The shared layout whose grid ``mesh`` is (a mesh's ``.mesh``, a sub-grid
    view is not), else ``None``."""
    if type(mesh) is not torch.Tensor:
        return None
    hit = _by_grid.get(id(mesh))
    return hit if hit is not None and hit.grid is mesh else None


def _row_major(shape: tuple[int, ...]) -> torch.Tensor:
    """The shared grid of ranks ``0 .. prod(shape) - 1`` in ``shape``, row-major."""
    grid = _row_majors.get(shape)
    if grid is None or _layout_of(grid) is None:  # new, or its layout was evicted
        with real_tensors():  # and on the CPU under ``with torch.device("meta")``
            arange = torch.arange(math.prod(shape), device="cpu").reshape(shape)
        grid = shared_layout(tuple(range(arange.numel())), arange).grid
        with _shared_lock:
            if len(_row_majors) >= _SHARED_MAX:
                del _row_majors[next(iter(_row_majors))]
            _row_majors[shape] = grid
    return grid
