"""Tensor metadata, sharding specs, and the pure layout math behind them.

A ``DTensorSpec`` says where every element of a global tensor lives: the mesh,
one placement per mesh axis, and the global shape/stride/dtype. Specs are
frozen and slotted, and their hash is computed once at construction, so an op
may hand its input's spec to its output (aliasing) without any risk that a
later write changes both.

The layout functions here are pure: they take shapes and coordinates, never a
process group. Sharding follows ``torch.chunk``: with ``n`` pieces of a dim of
size ``s`` every piece has ``ceil(s / n)`` elements except the trailing ones,
which may be shorter or empty. Mesh axes apply left to right, so
``[Shard(0), Shard(0)]`` first splits dim 0 over axis 0, then splits each piece
again over axis 1.

Example:
    >>> shard_range(5, 4, 3)          # torch.chunk(arange(5), 4) has 3 pieces
    (5, 0)
    >>> local_block((5, 2), (2, 2), (Shard(0), Shard(0)), (0, 1))
    ((2, 1), (0, 2))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dtensor.errors import PlacementError, ShardDimError
from dtensor.placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    format_placements,
    replicated,
)

if TYPE_CHECKING:
    from dtensor.mesh import DeviceMesh

__all__ = [
    "DTensorSpec",
    "TensorMeta",
    "contiguous_stride",
    "cut_runs",
    "local_block",
    "local_shape",
    "normalize_placements",
    "shard_range",
    "strided_runs",
]

_DTYPE_SHORT = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of a contiguous tensor of ``shape``."""
    stride = []
    acc = 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Global shape, stride and dtype of a distributed tensor."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        # Canonical form: torch.Size and lists become plain tuples of ints, so
        # equal meaning gives equal value and equal hash.
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "stride", tuple(int(s) for s in self.stride))
        if len(self.shape) != len(self.stride):
            raise PlacementError(
                f"TensorMeta: shape {self.shape} and stride {self.stride} "
                "must have the same length"
            )

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        name = _DTYPE_SHORT.get(self.dtype, str(self.dtype).removeprefix("torch."))
        return f"{name}[{','.join(map(str, self.shape))}]"


def normalize_placements(
    placements: Sequence[Placement], mesh_ndim: int, tensor_ndim: int
) -> tuple[Placement, ...]:
    """Validate placements against a mesh and a tensor rank; canonicalise them.

    Negative shard dims become non-negative. Raises ``PlacementError`` naming
    what was expected and what was given.
    """
    key = (placements, mesh_ndim, tensor_ndim)
    try:
        return _normalized[key]
    except (KeyError, TypeError):
        pass
    out = _normalize(placements, mesh_ndim, tensor_ndim)
    if isinstance(placements, tuple) and len(_normalized) < 65536:
        _normalized[key] = out
    return out


_normalized: dict = {}


def _normalize(placements, mesh_ndim: int, tensor_ndim: int) -> tuple[Placement, ...]:
    if isinstance(placements, Placement):
        placements = (placements,)
    try:
        placements = tuple(placements)
    except TypeError:
        raise PlacementError(
            f"placements: expected a sequence of Placement, got {placements!r}"
        ) from None
    if len(placements) != mesh_ndim:
        raise PlacementError(
            f"placements: expected {mesh_ndim} (one per mesh axis), got "
            f"{len(placements)}: {format_placements(placements)}. Pass one of "
            "Shard(d)/Replicate()/Partial() for each mesh axis."
        )
    out = []
    for axis, p in enumerate(placements):
        if not isinstance(p, Placement):
            raise PlacementError(
                f"placements[{axis}]: expected Shard/Replicate/Partial, got {p!r}"
            )
        if isinstance(p, (Shard, StridedShard)):
            dim = p.dim + tensor_ndim if p.dim < 0 else p.dim
            if not 0 <= dim < tensor_ndim:
                raise ShardDimError(
                    f"placements[{axis}] = {p}: tensor has {tensor_ndim} dims, "
                    f"valid shard dims are {-tensor_ndim}..{tensor_ndim - 1}"
                    if tensor_ndim
                    else f"placements[{axis}] = {p}: a 0-d tensor cannot be "
                    "sharded; use Replicate() or Partial()"
                )
            if isinstance(p, StridedShard) and p.split_factor == 1:
                p = Shard(dim)  # one piece first: plain Shard, one canonical value
            elif dim != p.dim:
                p = Shard(dim) if isinstance(p, Shard) else StridedShard(dim, p.split_factor)
        out.append(p)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DTensorSpec:
    """Mesh, placements and global metadata of a DTensor. Immutable.

    Build with ``DTensorSpec(mesh, placements, tensor_meta)``; placements are
    validated and normalised. Derive changed specs with ``with_placements`` or
    ``with_meta`` rather than mutating (mutation raises).
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    tensor_meta: TensorMeta
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        placements = normalize_placements(
            self.placements, self.mesh.ndim, self.tensor_meta.ndim
        )
        object.__setattr__(self, "placements", placements)
        for p in placements:
            if p.kind == "partial" and (p.reduce_op in _DTYPE_BOUND
                                        or p.reduce_op.startswith("norm")):
                _check_partial_dtype(p, self.tensor_meta.dtype)
        object.__setattr__(
            self, "_hash", hash((self.mesh, placements, self.tensor_meta))
        )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # NOTE: the cached hash is only valid in this process (str and dtype
        # hashes differ between processes), so a loaded spec recomputes it.
        return DTensorSpec, (self.mesh, self.placements, self.tensor_meta)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, DTensorSpec):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.placements == other.placements
            and self.tensor_meta == other.tensor_meta
            and self.mesh == other.mesh
        )

    # Convenience views ----------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor_meta.shape

    @property
    def stride(self) -> tuple[int, ...]:
        return self.tensor_meta.stride

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor_meta.dtype

    @property
    def ndim(self) -> int:
        return self.tensor_meta.ndim

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.mesh

    def with_placements(self, placements: Sequence[Placement]) -> DTensorSpec:
        placements = tuple(placements)
        if placements == self.placements:
            return self
        key = (self, placements)
        derived = _derived.get(key)
        if derived is None:
            derived = DTensorSpec(self.mesh, placements, self.tensor_meta)
            if len(_derived) < 65536:
                _derived[key] = derived
        return derived

    def with_meta(self, tensor_meta: TensorMeta) -> DTensorSpec:
        if tensor_meta == self.tensor_meta:
            return self
        return DTensorSpec(self.mesh, self.placements, tensor_meta)

    @classmethod
    def replicated(cls, mesh: DeviceMesh, tensor_meta: TensorMeta) -> DTensorSpec:
        """A full copy on every rank of ``mesh``."""
        return cls(mesh, replicated(mesh), tensor_meta)

    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def has_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    def local_block(
        self, coordinate: Sequence[int] | None
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(local shape, global offset) of the shard at ``coordinate``."""
        return local_block(self.shape, self.mesh.shape, self.placements, coordinate)

    def local_shape(self, coordinate: Sequence[int] | None) -> tuple[int, ...]:
        """Shape of the block at ``coordinate`` (``StridedShard`` included)."""
        return local_shape(self.shape, self.mesh.shape, self.placements, coordinate)

    def __str__(self) -> str:
        return f"{self.tensor_meta}{format_placements(self.placements)}"


# Specs derived by with_placements, shared: safe because specs are immutable.
_derived: dict = {}

# Partial reduce ops that only some dtypes support.
_DTYPE_BOUND = frozenset(("product", "band", "bor", "bxor"))


def _check_partial_dtype(p: Partial, dtype: torch.dtype) -> None:
    """Refuse a Partial op the dtype cannot be reduced with (before any rank
    communicates: every rank builds the same spec, so all raise alike)."""
    if p.reduce_op.startswith("norm"):
        # Pieces are norms: real floats (the root of a power sum is one).
        ok = dtype.is_floating_point
        need = "a floating dtype (its pieces are p-norms)"
    elif p.reduce_op == "product":
        # NOTE: complex values travel as (real, imag) pairs; a product of
        # pairs is not the complex product.
        ok = not dtype.is_complex
        need = "a real dtype"
    else:
        ok = dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex)
        need = "an integer or bool dtype"
    if not ok:
        raise PlacementError(
            f"{p!r}: needs {need}, got {dtype}. Cast first (x.to(torch.float32) "
            "or x.to(torch.int64)) or use Partial('sum'/'avg'/'max'/'min')"
        )


def shard_range(size: int, num_pieces: int, index: int) -> tuple[int, int]:
    """(start, length) of piece ``index`` when ``size`` is chunked ``num_pieces`` ways.

    Matches ``torch.chunk``: pieces of ``ceil(size / num_pieces)``; trailing
    pieces are shorter or empty (start clamps to ``size``).
    """
    if num_pieces <= 0:
        raise PlacementError(f"shard_range: num_pieces must be >= 1, got {num_pieces}")
    piece = -(-size // num_pieces)
    start = min(index * piece, size)
    return start, max(0, min(piece, size - start))


def local_block(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int] | None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of the block held at mesh ``coordinate``.

    A ``coordinate`` of ``None`` (a rank outside the mesh) holds nothing: every
    dim of its local shape is 0, and a 0-d tensor becomes shape ``(0,)``
    (a 0-d tensor cannot be empty).
    """
    shape = list(global_shape)
    offset = [0] * len(shape)
    if coordinate is None:
        return (tuple(0 for _ in shape) or (0,)), tuple(offset)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            start, length = shard_range(shape[p.dim], mesh_shape[axis], coordinate[axis])
            offset[p.dim] += start
            shape[p.dim] = length
        elif isinstance(p, StridedShard):
            # Callers index global data by offset: refuse rather than misread.
            raise PlacementError(
                f"local_block: placements {format_placements(tuple(placements))} hold "
                f"interleaved rows on axis {axis} ({p}); a block has no single offset. "
                "Use dtensor.strided.block_runs for its rows or local_shape for its "
                "shape, or redistribute to Shard/Replicate first"
            )
    return tuple(shape), tuple(offset)


def strided_runs(
    size: int, num_pieces: int, split_factor: int, index: int
) -> tuple[tuple[int, int], ...]:
    """(start, length) runs of piece ``index`` of a ``size``-row block cut
    ``num_pieces`` ways by ``StridedShard(_, split_factor)``: sub-piece
    ``index`` of each chunk in order; empty runs dropped, touching ones merged.

    Example:
        >>> strided_runs(5, 2, 2, 0)      # chunks [0,1,2] [3,4] -> [0,1] + [3]
        ((0, 2), (3, 1))
    """
    runs: list[tuple[int, int]] = []
    for j in range(split_factor):
        outer, outer_len = shard_range(size, split_factor, j)
        start, length = shard_range(outer_len, num_pieces, index)
        if length == 0:
            continue
        if runs and runs[-1][0] + runs[-1][1] == outer + start:
            runs[-1] = (runs[-1][0], runs[-1][1] + length)
        else:
            runs.append((outer + start, length))
    return tuple(runs)


def cut_runs(size: int, p: Placement, n: int, index: int) -> tuple[tuple[int, int], ...]:
    """Runs of piece ``index`` of ``n`` cut from ``size`` rows by Shard/StridedShard ``p``."""
    if isinstance(p, StridedShard):
        return strided_runs(size, n, p.split_factor, index)
    start, length = shard_range(size, n, index)
    return ((start, length),) if length else ()


def local_shape(global_shape: Sequence[int], mesh_shape: Sequence[int],
                placements: Sequence[Placement], coordinate: Sequence[int] | None,
                ) -> tuple[int, ...]:
    """Shape of the block at ``coordinate``; see ``local_block`` (None: empty)."""
    if coordinate is None:
        return local_block(global_shape, mesh_shape, placements, None)[0]
    shape = list(global_shape)
    for axis, p in enumerate(placements):
        if isinstance(p, (Shard, StridedShard)):
            runs = cut_runs(shape[p.dim], p, mesh_shape[axis], coordinate[axis])
            shape[p.dim] = sum(length for _, length in runs)
    return tuple(shape)
