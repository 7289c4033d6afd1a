"""Vector norms of sharded tensors without gathering them.

A p-norm over a sharded dim is a function of per-shard partial results:
each rank computes its share (``sum |x|^p`` for finite ``p != 0``, the count
of non-zeros for ``p = 0``, ``max |x|`` for ``inf``, ``min |x|`` for
``-inf``), one all-reduce (sum, max or min) per sharded mesh axis combines
the shares, and finite ``p`` takes the ``1/p``-th root. The result is
replicated on those axes. Dims that are not reduced keep their shards, and
partial values are reduced first (a norm is not linear in its pieces).

``_foreach_norm`` (what ``clip_grad_norm_`` calls) groups the list by the
mesh axes its elements are sharded on and sends **one** all-reduce per group
and axis, carrying every norm of the group, instead of one per tensor.

The rules are pure; the combining happens in their ``local`` functions,
which run at execution time (``Sharding.local``) and read ``ord`` from the
actual arguments, since cached plans are shared across float values.
"""

from __future__ import annotations

import math

import torch

from dtensor import _comm
from dtensor.placement import Replicate, Shard
from dtensor.rules._util import bind, norm_dim
from dtensor.sharding import Sharding

__all__ = ["RULES", "combine_shares", "local_share"]

aten = torch.ops.aten


def _ord(value) -> float:
    return 2.0 if value is None else float(value)


def _how(p: float) -> str:
    """The all-reduce that combines shares of the ``p``-norm."""
    if p == math.inf:
        return "max"
    if p == -math.inf:
        return "min"
    return "sum"


def local_share(x: torch.Tensor, p: float, dims, keepdim: bool, dtype) -> torch.Tensor:
    """This rank's share of the ``p``-norm of ``x`` over ``dims`` (None: all).

    An empty piece (a trailing rank of an uneven shard) contributes the
    identity of the combining reduction; ``linalg.vector_norm`` refuses the
    inf and negative norms of an empty tensor.
    """
    reduced = range(x.ndim) if dims is None else [norm_dim(d, x.ndim) for d in dims]
    extent = math.prod(x.shape[d] for d in reduced)
    if extent == 0:
        zero = torch.linalg.vector_norm(x, 2.0, dims, keepdim, dtype=dtype)
        return zero.fill_(math.inf) if p == -math.inf else zero
    n = torch.linalg.vector_norm(x, p, dims, keepdim, dtype=dtype)
    return n if p in (0.0, math.inf, -math.inf) else n.pow(p)


def combine_shares(shares: torch.Tensor, p: float, mesh, axes) -> torch.Tensor:
    """The ``p``-norms from shares held along mesh ``axes``: one all-reduce per
    axis (of the whole tensor ``shares``), then the root for finite ``p``."""
    how = _how(p)
    buf = shares if how == "sum" else _nan_first_bits(shares, how)
    for axis in axes:
        group = mesh.axis_group(axis)
        if group is not None:
            buf = _comm.all_reduce(buf, how, group)
    if how != "sum":
        return _from_bits(buf, how, shares.dtype)
    if p == 0.0:
        return buf
    return buf.pow(1.0 / p)


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _nan_first_bits(shares: torch.Tensor, how: str) -> torch.Tensor:
    """Shares of a ±inf norm (each >= 0, or NaN) as integers whose max / min
    is the float max / min with a NaN held by any rank winning.

    NOTE: Gloo's float max/min keep whichever operand compares first, so a
    NaN held by one rank could vanish. The bits of non-negative IEEE floats
    order as integers do, and a NaN with its sign bit clear (``abs``) lies
    above +inf: an integer max keeps it. For min a NaN becomes -1, below every
    non-negative float. One element per norm on the wire (was two: value
    and a NaN flag).
    """
    bits = shares.abs().view(_INT_OF_SIZE[shares.element_size()])
    if how == "min":
        bits = torch.where(torch.isnan(shares), torch.full_like(bits, -1), bits)
    return bits


def _from_bits(bits: torch.Tensor, how: str, dtype) -> torch.Tensor:
    if how == "min":
        nan = bits < 0
        return torch.where(nan, torch.full((), math.nan, dtype=dtype),
                           bits.clamp_min(0).view(dtype))
    return bits.view(dtype)


def _reduced(spec, dims) -> tuple[int, ...]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(spec.ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted({norm_dim(d, spec.ndim) for d in dims}))


# Argument names per overload: (ord, dim, keepdim, dtype); None where absent.
# torch.norm and Tensor.norm of a DTensor reach linalg_vector_norm (the
# aten.norm.* overloads keep the replicate fallback until a test reaches them).
_NAMES = {
    aten.linalg_vector_norm.default: ("ord", "dim", "keepdim", "dtype"),
}


def _runtime_args(func, args, kwargs):
    """(x, ord, dims, keepdim, dtype) from a call's actual arguments."""
    names = _NAMES[func]
    schema = func._schema.arguments
    values = {}
    for i, a in enumerate(schema):
        if not a.kwarg_only and i < len(args):
            values[a.name] = args[i]
        elif a.name in kwargs:
            values[a.name] = kwargs[a.name]
        elif a.has_default_value():
            values[a.name] = a.default_value
    ord_name, dim_name, keep_name, dtype_name = names
    dims = values.get(dim_name) if dim_name else None
    if isinstance(dims, int):
        dims = [dims]
    if dims is not None and len(dims) == 0:
        dims = None
    return (
        args[0],
        _ord(values.get(ord_name)),
        dims,
        bool(values.get(keep_name)) if keep_name else False,
        values.get(dtype_name) if dtype_name else None,
    )


def _combined_norm(axes: tuple[int, ...]):
    def local(func, coord, out_specs, args, kwargs):
        x, p, dims, keepdim, dtype = _runtime_args(func, args, kwargs)
        share = local_share(x, p, dims, keepdim, dtype)
        return combine_shares(share, p, out_specs[0].mesh, axes)

    return local


def vector_norm_rule(call):
    """Shards of kept dims stay; sharded reduced dims are combined (replicated)."""
    if len(call.specs) != 1:
        return None
    (spec,) = call.specs
    names = _NAMES[call.func]
    a = bind(call)
    dims = _reduced(spec, a.get(names[1]) if names[1] else None)
    keepdim = bool(a.get(names[2])) if names[2] else False
    want, out, axes = [], [], []
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Shard) and p.dim not in dims:
            want.append(p)
            out.append(Shard(p.dim if keepdim else p.dim - sum(1 for r in dims if r < p.dim)))
        elif isinstance(p, Shard):
            want.append(p)
            out.append(Replicate())
            axes.append(axis)
        else:  # partial pieces are reduced first; replicated stays
            want.append(Replicate())
            out.append(Replicate())
    shape = tuple(
        1 if d in dims else size
        for d, size in enumerate(spec.shape)
        if keepdim or d not in dims
    )
    local = _combined_norm(tuple(axes)) if axes else None
    return Sharding((tuple(want),), (tuple(out),), local=local, shapes=(shape,))


def _foreach_combined(groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]):
    """``groups``: (mesh axes, element indices) for elements sharded on those axes."""
    sharded = frozenset(i for _, idx in groups for i in idx)

    def local(func, coord, out_specs, args, kwargs):
        a = dict(zip(("self", "ord", "dtype"), args, strict=False)) | kwargs
        xs = a["self"]
        p = _ord(a.get("ord", 2))
        dtype = a.get("dtype")
        # One C call for all local pieces, unless an empty piece would make
        # it refuse (inf and negative norms have no identity in torch).
        if _all_ok(xs, p):
            norms = list(torch._foreach_norm(xs, p, dtype=dtype))
        else:
            norms = [None if i in sharded and not x.numel()
                     else torch.linalg.vector_norm(x, p, dtype=dtype)
                     for i, x in enumerate(xs)]
        mesh = out_specs[0].mesh
        root = p not in (0.0, math.inf, -math.inf)
        for axes, idx in groups:
            vals = [norms[i] for i in idx]
            if all(v is not None for v in vals):  # one stack and one pow per group
                shares = torch.stack(vals).pow(p) if root else torch.stack(vals)
            else:  # empty pieces of uneven shards: see local_share
                shares = torch.stack([
                    local_share(xs[i], p, None, False, dtype) if v is None
                    else v.pow(p) if root else v
                    for i, v in zip(idx, vals, strict=True)
                ])
            total = combine_shares(shares, p, mesh, axes)
            for i, t in zip(idx, total.unbind(), strict=True):
                norms[i] = t
        return norms

    return local


def _all_ok(xs, p: float) -> bool:
    """``_foreach_norm`` may run on the local pieces as they are."""
    return (p >= 0 and p != math.inf) or all(x.numel() for x in xs)


def foreach_norm_rule(call):
    """Per element like ``vector_norm_rule`` over all dims; one all-reduce per
    group of elements sharded on the same mesh axes (and per axis)."""
    specs = call.specs
    if not specs:
        return None
    mesh = specs[0].mesh
    want, groups = [], {}
    for i, spec in enumerate(specs):
        axes = tuple(a for a, p in enumerate(spec.placements) if isinstance(p, Shard))
        want.append(tuple(p if isinstance(p, Shard) else Replicate() for p in spec.placements))
        if axes:
            groups.setdefault(axes, []).append(i)
    rep = (Replicate(),) * mesh.ndim
    local = None
    if groups:
        local = _foreach_combined(tuple((k, tuple(v)) for k, v in groups.items()))
    return Sharding(tuple(want), (rep,) * len(specs), local=local, shapes=((),) * len(specs))


RULES: dict = {
    **dict.fromkeys(_NAMES, vector_norm_rule),
    aten._foreach_norm.Scalar: foreach_norm_rule,
}
