"""``from_local(run_check=True)``: the mesh's members agree on what they wrap.

Each member's block metadata (dimensions, dtype, meta-ness, requires_grad,
and a digest of the placements/shape/stride arguments, then the block's
shape and strides) is all-gathered over
the mesh, so every member sees every member's and raises the same error,
naming the ranks that differ, instead of failing alone and leaving the
others blocked in a later collective. Then the blocks' shapes are gathered:
without ``shape=`` the global shape is inferred from all of them (uneven
``torch.chunk`` layouts included), with it every block is checked against it.
Last, as PyTorch documents, values under ``Replicate`` are taken from the
first rank of each replicated mesh axis.

Costs two small all-gathers plus one broadcast per ``Replicate`` axis; it is
opt-in, as in PyTorch.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from dtensor import _comm
from dtensor.errors import PlacementError
from dtensor.mesh import DeviceMesh, device_of, unravel
from dtensor.placement import Placement, Replicate, format_placements
from dtensor.spec import local_shape

__all__ = ["digest", "run_check"]

# A stable code per dtype: the same torch build gives the same order everywhere.
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_FIELDS = ("ndim", "dtype", "meta", "requires_grad", "arguments")


def digest(text: str) -> int:
    """A 56-bit digest of ``text`` (fits an int64 tensor), equal on every rank."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")


def _digest(placements, shape, stride) -> int:
    def norm(x):
        return None if x is None else tuple(int(i) for i in x)

    return digest(repr((tuple(placements), norm(shape), norm(stride))))


def _decode(field: str, value: int):
    if field == "dtype":
        return _DTYPES[value] if 0 <= value < len(_DTYPES) else f"dtype#{value}"
    if field in ("meta", "requires_grad"):
        return bool(value)
    if field == "arguments":
        return f"digest {value:#x}"
    return value


def _who(values: list, ranks: Sequence[int]) -> str:
    """``rank 0,1: a; rank 2: b`` for the distinct values in ``values``."""
    groups: dict = {}
    for rank, v in zip(ranks, values, strict=True):
        groups.setdefault(v, []).append(rank)
    return "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {v}"
        for v, rs in groups.items()
    )


def _gather(row: list[int], mesh: DeviceMesh) -> list[list[int]]:
    """Every member's ``row`` (equal lengths), in the mesh's row-major rank order."""
    t = torch.tensor(row, dtype=torch.int64, device=device_of(mesh))
    if mesh.size() == 1:
        return [row]
    group = _comm.group_for(mesh.ranks)
    return [x.cpu().tolist() for x in _comm.all_gather(t, group)]


def _coordinates(mesh: DeviceMesh) -> list[tuple[int, ...]]:
    return [unravel(k, mesh.shape) for k in range(mesh.size())]


def _infer_shape(
    shapes: list[tuple[int, ...]], mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[int, ...]:
    """Global shape whose chunks the blocks would be: sizes summed along shard axes.

    Summed over the blocks at coordinate 0 of every other axis; the caller
    then checks every block against the result.
    """
    coords = _coordinates(mesh)
    out = list(shapes[0])
    for dim in range(len(out)):
        axes = {a for a, p in enumerate(placements) if p.is_shard(dim)}
        if axes:
            out[dim] = sum(
                shapes[k][dim]
                for k, c in enumerate(coords)
                if all(c[a] == 0 for a in range(mesh.ndim) if a not in axes)
            )
    return tuple(out)


def run_check(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
    normalize,
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(block to wrap, global shape), agreed by every member of ``mesh``.

    Call on members only. ``normalize(placements, ndim)`` canonicalises the
    placements; it runs after the members agree on ``ndim``, so a placement
    that fits some ranks' blocks and not others' fails on every rank alike.
    Raises ``PlacementError`` (a ``ValueError``) on every member.
    """
    where = f"from_local(run_check=True) on {mesh}"
    header = [
        local.ndim,
        _DTYPES.index(local.dtype),
        int(local.is_meta),
        int(local.requires_grad),
        _digest(placements, shape, stride),
    ]
    rows = _gather(header, mesh)
    ranks = mesh.ranks
    differ = [
        f"{field}: {_who([_decode(field, r[i]) for r in rows], ranks)}"
        for i, field in enumerate(_FIELDS)
        if len({r[i] for r in rows}) > 1
    ]
    if differ:
        raise PlacementError(
            f"{where}: ranks disagree on their local blocks (every rank must pass "
            f"the same placements, shape and stride, and blocks of one dtype and "
            f"number of dims); got " + " | ".join(differ)
        )
    placements = normalize(placements, local.ndim)
    n = local.ndim
    rows = _gather([*local.shape, *local.stride(), int(local.is_contiguous())], mesh)
    shapes = [tuple(r[:n]) for r in rows]
    strides = [tuple(r[n : 2 * n]) for r in rows]
    if shape is None and not all(r[-1] for r in rows) and len(set(strides)) > 1:
        # The global stride derives from the blocks' (as in PyTorch): they
        # must agree unless all are contiguous (uneven contiguous blocks differ).
        raise PlacementError(
            f"{where}: ranks disagree on their blocks' strides (a non-contiguous "
            f"block, e.g. transposed, on some ranks); got stride: {_who(strides, ranks)}. "
            "Pass .contiguous() blocks, or shape= and stride="
        )
    if shape is None:
        shape = _infer_shape(shapes, mesh, placements)
        how = "inferred from the blocks"
    else:
        shape = tuple(int(s) for s in shape)
        how = "given"
    expected = [local_shape(shape, mesh.shape, placements, c) for c in _coordinates(mesh)]
    bad = [k for k in range(len(ranks)) if shapes[k] != expected[k]]
    if bad:
        detail = ", ".join(
            f"rank {ranks[k]} has {shapes[k]}, expected {expected[k]}" for k in bad
        )
        raise PlacementError(
            f"{where}: blocks do not fit global shape {shape} ({how}) with "
            f"{format_placements(placements)}: {detail}. Blocks must be the "
            "torch.chunk pieces of the global tensor; pass shape= for uneven shards"
        )
    if not local.is_meta and math.prod(mesh.shape) > 1:
        local = _replicas_from_first(local, mesh, placements)
    return local, shape


def _replicas_from_first(local: torch.Tensor, mesh: DeviceMesh, placements) -> torch.Tensor:
    values = None
    for axis, p in enumerate(placements):
        group = mesh.axis_group(axis)
        if isinstance(p, Replicate) and group is not None:
            src = local.detach() if values is None else values
            values = _comm.broadcast(src.contiguous(), 0, group)
    if values is None:
        return local
    if local.requires_grad:
        return _TakeValues.apply(local, values)
    return values


class _TakeValues(torch.autograd.Function):
    """Forward: the broadcast values. Backward: the gradient, to the original block.

    The broadcast is not a function of this rank's block; the gradient goes
    to the block the caller passed, as if it held those values all along.
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, values: torch.Tensor):
        return values

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None
