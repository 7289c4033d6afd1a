"""The per-rank layout oracle: which block, offset and coordinate each rank holds.

The runtime's own layout math (``dtensor.spec.local_block``, the mesh's
cached coordinate) is what a layout bug would break, so it cannot be its own
reference. The oracle derives everything independently, on each rank:

- the coordinate: where this process's rank sits in the mesh's rank tensor
  (``mesh.mesh``), checked against ``get_coordinate()``, ``get_local_rank``
  of every axis (by index, negative index and name) and ``size(axis)``;
- the block: for each mesh axis in order, ``torch.chunk`` of the global index
  range of the sharded dim, piece number = the coordinate on that axis (no
  piece: empty), so nested and uneven sharding follow PyTorch's convention;
- the offset: the first global index of the block on every non-empty dim,
  checked against the runtime's ``spec.local_block`` where it has one;
- the values: the expected global tensor read at those indices (``narrow``
  where they are consecutive, ``index_select`` where a strided shard
  interleaves them), not sliced with the runtime's offsets.

It issues no collectives, so it never hangs a world whose ranks disagree;
call it on every rank (each checks its own block). It works on dtensor's and
on ``torch.distributed.tensor``'s DTensor.

Example:
    >>> dt = distribute_tensor(x, mesh, [Shard(0), Shard(0)])
    >>> assert_layout(dt, x)            # block, offset, coordinate, values
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dtensor.testing.compare import compare_block

__all__ = ["assert_coordinate", "assert_layout", "reference_block", "reference_coordinate"]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def reference_coordinate(grid: torch.Tensor, rank: int) -> tuple[int, ...] | None:
    """``rank``'s position in the rank tensor ``grid``; None when absent."""
    # A rank checks many tensors on one mesh, whose rank tensor lives as long
    # as the mesh: the search (~17 us, a rank of a simulated world asks it for
    # every block it checks) runs once per rank tensor, again if it changed.
    key = (id(grid), rank)
    hit = _COORDINATES.get(key)
    if hit is not None and hit[0]() is grid and hit[1] == grid._version:
        return hit[2]
    found = (grid == rank).nonzero().tolist()
    coord = tuple(found[0]) if found else None
    if len(_COORDINATES) >= 4096:
        _COORDINATES.clear()
    _COORDINATES[key] = (weakref.ref(grid), grid._version, coord)
    return coord


_COORDINATES: dict = {}  # (id(rank tensor), rank) -> (its weakref, its version, coordinate)


def reference_block(global_shape: Sequence[int], mesh_shape: Sequence[int],
                    placements: Sequence[Any], coordinate: Sequence[int]
                    ) -> list[torch.Tensor]:
    """Per tensor dim, the global indices of the block at ``coordinate``.

    Mesh axes are applied in order; ``Shard(d)`` keeps piece
    ``coordinate[axis]`` of ``torch.chunk(indices[d], mesh_shape[axis])``
    (``torch.chunk`` may return fewer pieces: the missing ones are empty).
    """
    return [torch.arange(i.start, i.stop) if isinstance(i, range)
            else torch.tensor(i, dtype=torch.long)
            for i in _block_indices(global_shape, mesh_shape, placements, coordinate)]


def _block_indices(global_shape: Sequence[int], mesh_shape: Sequence[int],
                   placements: Sequence[Any], coordinate: Sequence[int]
                   ) -> list[range | list[int]]:
    """``reference_block`` as Python sequences: a ``range`` where the block's
    indices on that dim are consecutive (every ``Shard``), a list where a
    strided shard interleaves them. The oracle runs on every rank for every
    block it checks; ranges cost no tensor ops and let the values be read
    with ``narrow``."""
    idx: list[range | list[int]] = [range(n) for n in global_shape]
    for axis, p in enumerate(placements):
        kind = type(p).__name__
        if kind not in ("Shard", "StridedShard", "_StridedShard"):
            continue
        d = p.dim % len(idx)
        c, n = coordinate[axis], mesh_shape[axis]
        if kind == "Shard":
            idx[d] = _piece(idx[d], n, c)
        else:  # sub-piece c of each of split_factor chunks, concatenated
            chunks = [_piece(idx[d], int(p.split_factor), j)
                      for j in range(int(p.split_factor))]
            idx[d] = [i for part in chunks for i in _piece(part, n, c)]
    return idx


def _piece(idx: range | list[int], n: int, c: int) -> range | list[int]:
    """Piece ``c`` of ``torch.chunk(idx, n)``; empty where chunk has none.

    ``torch.chunk`` cuts pieces of ``ceil(len / n)`` and drops the empty
    tail; slicing piece ``c`` directly keeps this O(1) per rank (building
    all ``n`` pieces on each of ``n`` ranks is quadratic at 1024 ranks)."""
    size = -(-len(idx) // n)
    return idx[c * size:(c + 1) * size] if size else idx[:0]


def assert_coordinate(mesh: Any, *, msg: str = "") -> tuple[int, ...] | None:
    """This rank's coordinate in ``mesh``, checked against the rank tensor on
    every axis; returns the reference coordinate."""
    prefix = f"{msg}: " if msg else ""
    rank = _rank()
    grid = mesh.mesh
    ref = reference_coordinate(grid, rank)
    got = mesh.get_coordinate()
    got = None if got is None else tuple(int(c) for c in got)

    def where() -> str:  # built for a failure only: the rank tensor's list is not free
        return f"{prefix}rank {rank} in mesh {grid.tolist()}"

    if got != ref:
        raise AssertionError(f"{where()}: get_coordinate() is {got}, expected {ref}")
    if tuple(mesh.shape) != tuple(grid.shape):
        raise AssertionError(f"{where()}: mesh.shape {tuple(mesh.shape)}, "
                             f"rank tensor {tuple(grid.shape)}")
    if ref is None:
        return None
    # The per-axis answers of a mesh object already checked on this rank
    # (meshes are immutable); get_coordinate above is still asked each time.
    key = (id(mesh), rank)
    seen = _CHECKED_MESHES.get(key)
    if seen is not None and seen[0]() is mesh and seen[1] == ref:
        return ref
    _check_axes(mesh, grid, ref, where)
    if len(_CHECKED_MESHES) >= 8192:
        _CHECKED_MESHES.clear()
    try:
        _CHECKED_MESHES[key] = (weakref.ref(mesh), ref)
    except TypeError:  # a mesh type without weak references: checked every time
        pass
    return ref


_CHECKED_MESHES: dict = {}  # (id(mesh), rank) -> (its weakref, coordinate)


def _check_axes(mesh: Any, grid: torch.Tensor, ref: tuple[int, ...], where) -> None:
    """``get_local_rank`` and ``size`` of every axis (index, negative index,
    name) against the rank tensor."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    ndim = grid.ndim
    for axis in range(ndim):
        keys: list[Any] = [axis, axis - ndim]
        if names:
            keys.append(names[axis])
        for key in keys:
            local = int(mesh.get_local_rank(key))
            if local != ref[axis]:
                raise AssertionError(f"{where()}: get_local_rank({key!r}) is {local}, "
                                     f"expected {ref[axis]} (axis {axis})")
            if int(mesh.size(key)) != grid.shape[axis]:
                raise AssertionError(f"{where()}: size({key!r}) is {mesh.size(key)}, "
                                     f"expected {grid.shape[axis]}")
    if ndim == 1 and int(mesh.get_local_rank()) != ref[0]:
        raise AssertionError(f"{where()}: get_local_rank() is {mesh.get_local_rank()}, "
                             f"expected {ref[0]}")


class _Text:
    """A message built only when printed: the oracle checks every block on
    every rank, and almost every check passes."""

    __slots__ = ("_build",)

    def __init__(self, build) -> None:
        self._build = build

    def __str__(self) -> str:
        return self._build()

    def __format__(self, spec: str) -> str:
        return format(self._build(), spec)


def _pstr(placements: Sequence[Any]) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


def assert_layout(dt: Any, expected: torch.Tensor | None = None, *, rtol: float | None = None,
                  atol: float | None = None, equal_nan: bool = True, msg: str = "") -> None:
    """``dt``'s local block on this rank is the reference block of ``expected``.

    Checks the coordinate (``assert_coordinate``), the local shape, the
    runtime's offset for this block (dtensor), and, when ``expected`` is given
    and no axis is ``Partial``, the values (a ``Partial`` block is a piece:
    only its shape is checked here). A rank outside the mesh must hold an
    empty local tensor.
    """
    prefix = f"{msg}: " if msg else ""
    mesh = dt.device_mesh
    placements = tuple(dt.placements)
    coord = assert_coordinate(mesh, msg=msg)
    local = dt.to_local().detach()
    gshape = tuple(dt.shape)
    if coord is None:
        if local.numel() != 0 or local.dtype != dt.dtype:
            raise AssertionError(
                f"{prefix}rank {_rank()} is outside {mesh} and must hold an empty "
                f"{dt.dtype} local tensor, got {tuple(local.shape)} {local.dtype}")
        return
    idx = _block_indices(gshape, tuple(mesh.shape), placements, coord)
    shape = tuple(len(i) for i in idx)
    offset = tuple(i[0] if len(i) else 0 for i in idx)
    where = _Text(lambda: (
        f"{prefix}rank {_rank()} (mesh coordinate {coord} of {tuple(mesh.shape)}, "
        f"placements {_pstr(placements)}, global shape {list(gshape)}) holding global["
        + ", ".join(f"{o}:{o + s}" for o, s in zip(offset, shape, strict=True)) + "]"))
    if tuple(local.shape) != shape:
        raise AssertionError(f"{where}: local shape {tuple(local.shape)}, expected {shape} "
                             "(torch.chunk of each sharded dim at the mesh coordinate)")
    spec = getattr(dt, "_spec", None)
    if spec is not None and any(type(p).__name__ == "StridedShard" for p in placements):
        from dtensor.strided import block_runs  # no single offset: compare the rows

        runs = block_runs(gshape, tuple(mesh.shape), placements, coord)
        got = [[g for s, n in r for g in range(s, s + n)] for r in runs]
        if tuple(spec.local_shape(coord)) != shape or got != [list(i) for i in idx]:
            raise AssertionError(f"{where}: the runtime's layout math says rows {runs}, "
                                 f"shape {spec.local_shape(coord)}")
    elif spec is not None and hasattr(spec, "local_block"):
        r_shape, r_offset = spec.local_block(coord)
        bad = [d for d, n in enumerate(shape) if n and r_offset[d] != offset[d]]
        if tuple(r_shape) != shape or bad:
            raise AssertionError(f"{where}: the runtime's layout math says shape "
                                 f"{tuple(r_shape)} at offset {tuple(r_offset)}")
    if expected is None or any(type(p).__name__ == "Partial" for p in placements):
        return
    block = expected.detach()
    for d, i in enumerate(idx):
        if isinstance(i, range):  # consecutive indices: the same values, no copy
            if len(i) != block.shape[d]:
                block = block.narrow(d, i.start, len(i))
        else:
            block = block.index_select(d, torch.tensor(i, dtype=torch.long))
    compare_block(local, block, offset, where, "", rtol, atol, equal_nan)
