"""Reductions over dims: sum, mean, prod, amax/amin, max/min, argmax/argmin,
norms, var/std, any/all, logsumexp, and scans/sorts along one dim.

Dims that are not reduced keep their shards, so a reduction over an
unsharded dim never communicates. A sum over a sharded dim gives
``Partial(sum)``; a mean gives ``Partial(sum)`` of local sums divided by the
global count (a mean of uneven local means would be wrong). ``Partial(sum)``
and ``Partial(avg)`` pieces pass a sum or mean; a sum of ``Partial(avg)``
pieces reduces its result at once (``Sharding.settled``). A product over
a sharded dim gives ``Partial(product)`` of local products (an empty piece
holds 1, the identity); complex products keep gathering, as ``Partial``
cannot multiply complex pieces. Everything else that reduces a sharded dim
(max and friends: a NaN or an empty piece breaks a max of pieces; argmax
needs global indices) first gathers that dim, except the extremes, which
have their own module (``dtensor.rules.extremes``).
"""

from __future__ import annotations

import math

import torch

from dtensor.placement import (
    Partial,
    Replicate,
    Shard,
    is_linear_partial,
    partial_to_replicate,
)
from dtensor.rules._util import bind, norm_dim, returns
from dtensor.sharding import Sharding

__all__ = ["RULES"]

aten = torch.ops.aten


def _reduced_dims(dim, ndim: int) -> tuple[int, ...]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = (dim,)
    return tuple(sorted({norm_dim(d, ndim) for d in dim}))


def _reduction(kind: str, call):
    """kind: 'sum' (linear), 'mean' (linear, needs the global count), 'count'
    (sums pieces but is not linear in partial values), 'prod' (multiplies
    pieces), 'other'."""
    spec = call.specs[0]
    if len(call.specs) != 1:
        return None
    a = bind(call)
    ndim = spec.ndim
    dims = _reduced_dims(a.get("dim", None), ndim)
    keepdim = bool(a.get("keepdim") or False)
    if kind == "mean" and a.get("dtype") is not None and not (
        a["dtype"].is_floating_point or a["dtype"].is_complex
    ):
        return None
    keep_product = False
    if kind == "prod":
        dtype = _prod_dtype(spec.dtype, a.get("dtype"))
        if dtype.is_complex:
            kind = "other"  # Partial(product) refuses complex values
        else:
            # Products of product pieces are the product's pieces, in the
            # same dtype only: an int32 piece wraps where its int64 product
            # would not.
            keep_product = dtype == spec.dtype

    def out_dim(d: int) -> int:
        return d if keepdim else d - sum(1 for r in dims if r < d)

    want, out, settled = [], [], []
    partial_sum = False
    for p in spec.placements:
        if isinstance(p, Shard) and p.dim not in dims:
            want.append(p)
            out.append(Shard(out_dim(p.dim)))
        elif isinstance(p, Shard) and kind in ("sum", "mean", "count"):
            want.append(p)
            out.append(Partial("sum"))
            partial_sum = True
        elif isinstance(p, Shard) and kind == "prod":
            want.append(p)
            out.append(Partial("product"))
        elif is_linear_partial(p) and kind in ("sum", "mean"):
            want.append(p)
            out.append(p)
            if p.reduce_op == "avg" and kind == "sum":
                settled.append((len(out) - 1, Replicate()))
        elif keep_product and isinstance(p, Partial) and p.reduce_op == "product":
            want.append(p)
            out.append(p)
        else:
            want.append(Replicate())
            out.append(Replicate())
    n = returns(call.func)
    shape = tuple(
        1 if d in dims else size
        for d, size in enumerate(spec.shape)
        if keepdim or d not in dims
    )
    local = None
    if kind == "mean" and partial_sum:
        count = math.prod(spec.shape[d] for d in dims) if ndim else 1
        local = _mean_as_sum(count)
    done = None
    if settled:
        # A sum of average pieces reduces its (smaller) result at once: PyTorch's
        # DTensor reduces the operand here, so both hold the same layout after
        # the op, and a result kept as pieces would be reduced again by every
        # later op that reads it whole (``cov`` reads its weights' sum four
        # times). A mean keeps them, as PyTorch's does: batch norm writes the
        # mean into running statistics that stay pieces.
        whole = list(out)
        for axis, p in settled:
            whole[axis] = p
        done = (tuple(whole),) * n
    return Sharding((tuple(want),), (tuple(out),) * n, local=local, shapes=(shape,) * n,
                    settled=done)


def _prod_dtype(dtype: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    """The dtype ``torch.prod`` returns: the requested one, else int64 for
    integer and bool inputs, else the input's."""
    if requested is not None:
        return requested
    if dtype.is_floating_point or dtype.is_complex:
        return dtype
    return torch.int64


def _mean_as_sum(count: int):
    def local(func, coord, out_specs, args, kwargs):
        x = args[0]
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        dtype = kwargs.get("dtype")
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            dims = list(range(x.ndim))
        s = torch.sum(x, dims, keepdim=keepdim, dtype=dtype)
        # NOTE: 0/0 must stay NaN like the single-device mean of an empty dim.
        return s / count if count else s / 0.0

    return local


def reduction(kind: str):
    return lambda call: _reduction(kind, call)


def along_dim_rule(call):
    """Ops working along one ``dim`` of same-shaped operands (softmax, cumsum,
    sort, topk...): every operand takes the first one's shards, except on
    ``dim``, which must be whole; partial values are reduced first."""
    specs = call.specs
    first = specs[0]
    if any(s.shape != first.shape for s in specs):
        return None
    a = bind(call)
    dim = a.get("dim", -1)
    if dim is None:
        return None
    dim = norm_dim(dim, first.ndim)
    want = tuple(
        p if isinstance(p, Shard) and p.dim != dim else Replicate()
        for p in first.placements
    )
    n = sum(1 for r in call.func._schema.returns)
    return Sharding((want,) * len(specs), (want,) * n)


def linear_along_dim_rule(call):
    """cumsum: like ``along_dim_rule`` but partial sums pass through."""
    (spec,) = call.specs
    a = bind(call)
    dim = norm_dim(a["dim"], spec.ndim)
    want = tuple(
        p
        if (isinstance(p, Shard) and p.dim != dim) or is_linear_partial(p)
        else Replicate()
        for p in spec.placements
    )
    if a.get("dtype") is not None and not a["dtype"].is_floating_point:
        want = partial_to_replicate(want)
    return Sharding((want,), (want,))


_SUM = reduction("sum")
_MEAN = reduction("mean")
_OTHER = reduction("other")
_COUNT = reduction("count")
_PROD = reduction("prod")

RULES: dict = {
    aten.sum.default: _SUM,
    aten.sum.dim_IntList: _SUM,
    aten.mean.default: _MEAN,
    aten.mean.dim: _MEAN,
    aten.prod.default: _PROD,
    aten.prod.dim_int: _PROD,
    aten.linalg_vector_norm.default: _OTHER,
    aten.var.correction: _OTHER,
    aten.std.correction: _OTHER,
    aten.var_mean.correction: _OTHER,
    aten.std_mean.correction: _OTHER,
    aten.any.default: _OTHER,
    aten.any.dim: _OTHER,
    aten.any.dims: _OTHER,
    aten.all.default: _OTHER,
    aten.all.dim: _OTHER,
    aten.all.dims: _OTHER,
    aten.logsumexp.default: _OTHER,
    aten.nansum.default: _COUNT,
    aten.count_nonzero.dim_IntList: _COUNT,
    aten._softmax.default: along_dim_rule,
    aten._log_softmax.default: along_dim_rule,
    aten._softmax_backward_data.default: along_dim_rule,
    aten._log_softmax_backward_data.default: along_dim_rule,
    aten.sort.default: along_dim_rule,
    aten.sort.stable: along_dim_rule,
    aten.topk.default: along_dim_rule,
    aten.cummax.default: along_dim_rule,
    aten.cummin.default: along_dim_rule,
    aten.logcumsumexp.default: along_dim_rule,
    aten.cumprod.default: along_dim_rule,
    aten.cumsum.default: linear_along_dim_rule,
    aten.linalg_cross.default: along_dim_rule,  # 3-vectors along dim: whole there
}
