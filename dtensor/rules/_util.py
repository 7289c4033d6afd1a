"""Shared helpers for rule modules: argument binding and shard arithmetic."""

from __future__ import annotations

import math

import torch

from dtensor.placement import Placement, Replicate, Shard

__all__ = [
    "bind",
    "broadcast_shape",
    "is_float",
    "norm_dim",
    "num_shards",
    "reduced_shard",
    "returns",
    "shard_through_broadcast",
    "strided_aware",
    "takes_strided",
]


def strided_aware(rule):
    """Mark ``rule`` as one that reads ``StridedShard`` placements: dispatch
    hands it operands as they are. Other rules see those axes ``Replicate``
    (and the operands are gathered to that), so a rule that does not know
    the layout never claims a plain shard of interleaved rows."""
    rule.takes_strided = True
    return rule


def takes_strided(rule) -> bool:
    """Whether ``rule`` was marked by ``strided_aware``."""
    return getattr(rule, "takes_strided", False)


def bind(call) -> dict:
    """Schema argument name -> value (specs in place of tensors), defaults filled."""
    out = {}
    args, kwargs = call.args, call.kwargs
    for i, a in enumerate(call.func._schema.arguments):
        if not a.kwarg_only and i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            out[a.name] = None
    return out


def broadcast_shape(*shapes) -> tuple[int, ...]:
    """The shape ``shapes`` broadcast to (``torch.broadcast_shapes``, which
    costs ~30 us a call in Python reference code; this, ~2 us)."""
    ndim = max(map(len, shapes), default=0)
    out = [1] * ndim
    for shape in shapes:
        off = ndim - len(shape)
        for i, n in enumerate(shape):
            m = out[off + i]
            if n != m and n != 1:
                if m != 1:
                    raise RuntimeError(
                        f"shapes {', '.join(str(tuple(s)) for s in shapes)} do not "
                        f"broadcast: size {m} and {n} at dim {off + i - ndim}"
                    )
                out[off + i] = n
    return tuple(out)


def reduced_shard(p: Shard, dims, keepdim: bool) -> Placement:
    """Where a ``Shard(d)`` lands after reducing ``dims``: ``Replicate()`` if
    ``d`` is reduced (its pieces were combined), else ``d`` renumbered for
    the dims that ``keepdim=False`` drops."""
    if p.dim in dims:
        return Replicate()
    return Shard(p.dim if keepdim else p.dim - sum(1 for r in dims if r < p.dim))


def returns(func) -> int:
    """Number of tensor results in ``func``'s schema."""
    return len(func._schema.returns)


def norm_dim(dim: int, ndim: int) -> int:
    """Non-negative dim (a 0-d tensor accepts 0 and -1 as its only dim)."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"dim {dim} out of range for a tensor of {ndim} dims")
    return dim % n


def num_shards(spec, dim: int) -> int:
    """Into how many pieces the mesh splits tensor dim ``dim``."""
    return math.prod(
        spec.mesh.shape[a]
        for a, p in enumerate(spec.placements)
        if isinstance(p, Shard) and p.dim == dim
    )


def shard_through_broadcast(p: Shard, shape, out_shape) -> Placement:
    """What an operand of ``shape``, broadcast to ``out_shape``, needs on a mesh
    axis where the result is sharded by ``p``: the shard of its matching dim,
    or ``Replicate`` where it lacks that dim or broadcasts it (size 1)."""
    d = p.dim - (len(out_shape) - len(shape))
    if d < 0 or (shape[d] == 1 and out_shape[p.dim] != 1):
        return Replicate()
    return Shard(d)


def is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex
