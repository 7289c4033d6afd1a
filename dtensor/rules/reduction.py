"""Reductions over dims: sum, mean, prod, amax/amin, max/min, argmax/argmin,
norms, var/std, any/all, logsumexp, and scans/sorts along one dim.

Dims that are not reduced keep their shards, so a reduction over an
unsharded dim never communicates. A sum over a sharded dim gives
``Partial(sum)``; a mean gives ``Partial(sum)`` of local sums divided by the
global count (a mean of uneven local means would be wrong). A product over
a sharded dim gives ``Partial(product)`` of local products (an empty piece
holds 1, the identity); complex products keep gathering, as ``Partial``
cannot multiply complex pieces. Everything else that reduces a sharded dim
(max and friends: a NaN or an empty piece breaks a max of pieces; argmax
needs global indices) first gathers that dim, except the extremes:
the whole-tensor ``max()`` / ``min()`` and ``amax``/``amin`` over dims take
the local extreme and one all-reduce of the result per sharded mesh axis
(see ``extreme_rule``, ``extreme_dims_rule``); ``max``/``min``/``argmax``/
``argmin`` along one sharded dim all-gather each rank's (value, global index)
pairs, not the dim (see ``extreme_along_dim_rule``).
"""

from __future__ import annotations

import math

import torch

from dtensor import _comm
from dtensor.placement import (
    Partial,
    Replicate,
    Shard,
    is_linear_partial,
    partial_to_replicate,
)
from dtensor.rules._util import bind, norm_dim, reduced_shard, returns
from dtensor.sharding import Sharding
from dtensor.spec import local_block

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

    want, out = [], []
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
    return Sharding((tuple(want),), (tuple(out),) * n, local=local, shapes=(shape,) * n)


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


def aminmax_rule(call):
    """``aminmax()`` over every dim: ``extreme_rule``'s min and max, one
    one-element all-reduce each per sharded mesh axis."""
    a = bind(call)
    if a.get("dim") is not None:
        return _aminmax_dim(call, a)
    if a.get("keepdim"):
        return _OTHER(call)
    layout = _extreme_layout(call.specs[0])
    if layout is None:
        return _OTHER(call)
    axes, want, rep = layout
    lo, hi = _extreme_local("min", axes), _extreme_local("max", axes)

    def local(func, coord, out_specs, args, kwargs):
        return lo(func, coord, out_specs, args, kwargs), hi(func, coord, out_specs, args, kwargs)

    return Sharding((want,), (rep, rep), local=local, shapes=((), ()))


def _aminmax_dim(call, a):
    """``aminmax(dim=d)`` along a sharded dim: ``amin`` and ``amax`` over it
    as ``extreme_dims_rule`` does them, two all-reduces of the output per mesh
    axis sharding ``d`` (was a gather of the dim)."""
    spec = call.specs[0]
    dims = (norm_dim(a["dim"], spec.ndim),) if spec.ndim else ()
    keepdim = bool(a.get("keepdim") or False)
    layout = _extreme_dims_layout(spec, dims, keepdim) if dims else None
    if layout is None:
        return _OTHER(call)
    axes, want, out = layout
    lo = _dims_extreme_local("min", dims, keepdim, axes)
    hi = _dims_extreme_local("max", dims, keepdim, axes)

    def local(func, coord, out_specs, args, kwargs):
        return lo(func, coord, out_specs, args, kwargs), hi(func, coord, out_specs, args, kwargs)

    shape = _out_shape(spec.shape, dims, keepdim)
    return Sharding((want,), (out, out), local=local, shapes=(shape, shape))


def extreme_rule(call):
    """``max()`` / ``min()`` over every dim: the local extreme, then one
    all-reduce of one element per sharded mesh axis; the result is replicated.

    Partial inputs are reduced first (a max of partial sums is not the max).
    An empty global tensor keeps the fallback (torch raises there); an empty
    local piece (a trailing rank of an uneven shard) sends the reduction's
    identity. Float values travel as order-preserving integers so that a NaN
    held by one rank wins (Gloo's float max/min can drop it).
    """
    if len(call.specs) != 1:
        return None
    layout = _extreme_layout(call.specs[0])
    if layout is None:
        return _OTHER(call)
    axes, want, rep = layout
    how = "max" if call.func is aten.max.default else "min"
    return Sharding((want,), (rep,), local=_extreme_local(how, axes), shapes=((),))


def _extreme_layout(spec):
    """For a whole-tensor extreme of ``spec``: the sharded mesh axes, the
    placements wanted (shards kept, partial values reduced first) and the
    replicated result's; None where the gathering fallback must serve (no
    shard, an empty tensor, a dtype without an order-preserving key)."""
    axes = tuple(i for i, p in enumerate(spec.placements) if isinstance(p, Shard))
    if not axes or math.prod(spec.shape) == 0 or spec.dtype not in _KEY_DTYPE:
        return None
    want = tuple(p if isinstance(p, Shard) else Replicate() for p in spec.placements)
    return axes, want, (Replicate(),) * len(want)


# dtype -> integer type its order-preserving key travels as (small types widen).
_KEY_DTYPE = {
    torch.float64: torch.int64, torch.float32: torch.int32,
    torch.float16: torch.int32, torch.bfloat16: torch.int32,
    torch.int64: torch.int64, torch.int32: torch.int32,
    torch.int16: torch.int32, torch.int8: torch.int32, torch.uint8: torch.int32,
}


def _to_key(x: torch.Tensor, how: str) -> torch.Tensor:
    """A one-element integer whose integer max/min is the float max/min of
    the ranks' values, a NaN on any rank winning; empty ``x``: the identity."""
    if x.numel() == 0:
        return torch.full((), _identity(how, x.dtype), dtype=_KEY_DTYPE[x.dtype])
    return _keys(torch.amax(x) if how == "max" else torch.amin(x), how)


def _identity(how: str, dtype) -> int:
    """The key an empty piece sends: every value's key beats (or ties) it."""
    info = torch.iinfo(_KEY_DTYPE[dtype])
    return info.min if how == "max" else info.max


def _keys(v: torch.Tensor, how: str) -> torch.Tensor:
    """``v``'s order-preserving integer keys, element-wise; a NaN gets the
    key that wins the ``how`` reduction (amax/max keep a NaN, so must the
    integer reduce)."""
    kt = _KEY_DTYPE[v.dtype]
    if not v.dtype.is_floating_point:
        return v.to(kt)
    info = torch.iinfo(kt)
    nan = torch.isnan(v)
    if kt is torch.int32:
        v = v.to(torch.float32)
    bits = v.contiguous().view(kt)
    # IEEE bits order like integers for >= +0; below, the magnitude bits run
    # backwards: flipping them makes the whole line monotone (-0 just below +0).
    key = torch.where(bits < 0, bits ^ info.max, bits)
    return torch.where(nan, torch.full_like(key, info.max if how == "max" else info.min), key)


def _from_key(key: torch.Tensor, how: str, dtype) -> torch.Tensor:
    if not dtype.is_floating_point:
        return key.to(dtype)
    info = torch.iinfo(key.dtype)
    nan = key == (info.max if how == "max" else info.min)
    bits = torch.where(key < 0, key ^ info.max, key)
    value = bits.view(torch.float32 if key.dtype is torch.int32 else torch.float64)
    return torch.where(nan, torch.full_like(value, math.nan), value).to(dtype)


def _combined_keys(key: torch.Tensor, how: str, mesh, axes, dtype) -> torch.Tensor:
    """The extreme over the mesh ``axes`` of each rank's ``key``s, as ``dtype``."""
    for axis in axes:
        group = mesh.axis_group(axis)
        if group is not None:
            key = _comm.all_reduce(key, how, group)
    return _from_key(key, how, dtype)


def _extreme_local(how: str, axes: tuple[int, ...]):
    def local(func, coord, out_specs, args, kwargs):
        x = args[0]
        return _combined_keys(_to_key(x, how), how, out_specs[0].mesh, axes, x.dtype)

    return local


def _extreme_dims_layout(spec, dims: tuple[int, ...], keepdim: bool):
    """For an extreme over ``dims`` of ``spec``: the mesh axes sharding a
    reduced dim, the placements wanted (shards kept, partial values reduced
    first: a max of partial sums is not the max) and the result's (reduced
    shards replicated, the others kept); None where the gathering fallback
    must serve (no reduced dim sharded, an empty tensor, a dtype without an
    order-preserving key)."""
    axes = tuple(
        i for i, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim in dims
    )
    if not axes or math.prod(spec.shape) == 0 or spec.dtype not in _KEY_DTYPE:
        return None
    want, out = [], []
    for p in spec.placements:
        if isinstance(p, Shard):
            want.append(p)
            out.append(reduced_shard(p, dims, keepdim))
        else:
            want.append(Replicate())
            out.append(Replicate())
    return axes, tuple(want), tuple(out)


def _out_shape(shape, dims: tuple[int, ...], keepdim: bool) -> tuple[int, ...]:
    return tuple(1 if d in dims else n for d, n in enumerate(shape) if keepdim or d not in dims)


def extreme_dims_rule(call):
    """``amax`` / ``amin`` over dims that include a sharded dim: the local
    extreme, then one all-reduce of the (local) result per mesh axis sharding
    a reduced dim, as order-preserving integer keys (a NaN held by one rank
    wins; Gloo's float max can drop it). An empty local piece of a reduced
    dim sends the reduction's identity. Dims not reduced keep their shards;
    an empty global tensor and dtypes without a key keep the fallback."""
    if len(call.specs) != 1:
        return None
    spec = call.specs[0]
    a = bind(call)
    dims = _reduced_dims(a.get("dim", None), spec.ndim)
    keepdim = bool(a.get("keepdim") or False)
    layout = _extreme_dims_layout(spec, dims, keepdim)
    if layout is None:
        return _OTHER(call)
    axes, want, out = layout
    how = "max" if call.func is aten.amax.default else "min"
    return Sharding((want,), (out,), local=_dims_extreme_local(how, dims, keepdim, axes),
                    shapes=(_out_shape(spec.shape, dims, keepdim),))


def _dims_extreme_local(how: str, dims: tuple[int, ...], keepdim: bool, axes):
    """A rule's ``local``: this rank's amax/amin over ``dims`` (the identity
    key for an empty piece), one all-reduce of its keys per mesh axis in
    ``axes``."""
    def local(func, coord, out_specs, args, kwargs):
        x, mesh = args[0], out_specs[0].mesh
        if any(x.shape[d] == 0 for d in dims):
            key = torch.full(_out_shape(x.shape, dims, keepdim), _identity(how, x.dtype),
                             dtype=_KEY_DTYPE[x.dtype])
        else:
            v = torch.amax(x, dims, keepdim) if how == "max" else torch.amin(x, dims, keepdim)
            key = _keys(v, how)
        return _combined_keys(key, how, mesh, axes, x.dtype)

    return local


def extreme_along_dim_rule(call):
    """``max.dim`` / ``min.dim`` / ``argmax`` / ``argmin`` along one sharded
    dim: each rank takes its local (value, index), the index shifted by its
    shard's start to a global index, then one all-gather per mesh axis
    sharding the dim of the (value key, index) pairs (2 x the output, in the
    key's integer type when the dim's indices fit it, else int64),
    and every rank picks alike: the extreme value, a NaN winning (torch
    returns the first NaN), ties to the smallest global index (torch returns
    the first extreme; -0 ties +0 as torch compares them equal). An empty
    local piece sends the identity with the largest index, losing every
    comparison. ``argmax`` without a dim (flattened), unsharded dims, empty
    tensors and dtypes without a key keep the fallback."""
    if len(call.specs) != 1:
        return None
    spec = call.specs[0]
    a = bind(call)
    if a.get("dim") is None or spec.ndim == 0:
        return _OTHER(call)
    dim = norm_dim(a["dim"], spec.ndim)
    keepdim = bool(a.get("keepdim") or False)
    layout = _extreme_dims_layout(spec, (dim,), keepdim)
    if layout is None:
        return _OTHER(call)
    axes, want, out = layout
    func = call.func
    how = "max" if func in (aten.max.dim, aten.argmax.default) else "min"
    index_only = func in (aten.argmax.default, aten.argmin.default)
    floating = spec.dtype.is_floating_point
    gshape, mesh_shape = spec.shape, spec.mesh.shape
    # A float32 key is 4 bytes: its index travels as 4 bytes too where it fits.
    pt = _KEY_DTYPE[spec.dtype]
    if gshape[dim] >= torch.iinfo(pt).max:
        pt = torch.int64
    last = torch.iinfo(pt).max  # an empty piece's index: loses every tie

    def local(func, coord, out_specs, args, kwargs):
        x = args[0]
        if x.shape[dim] == 0:
            shape = _out_shape(x.shape, (dim,), keepdim)
            key = torch.full(shape, _identity(how, x.dtype), dtype=pt)
            index = torch.full(shape, last, dtype=pt)
        else:
            v, index = torch.max(x, dim, keepdim) if how == "max" else torch.min(x, dim, keepdim)
            key = _keys(v, how).to(pt)
            index = (index + local_block(gshape, mesh_shape, want, coord)[1][dim]).to(pt)
        pair = torch.stack([key, index])
        mesh = out_specs[0].mesh
        for axis in axes:
            group = mesh.axis_group(axis)
            if group is not None:
                pair = _pick(_comm.all_gather(pair, group), how, floating)
        index = pair[1].to(torch.int64)
        if index_only:
            return index
        return _from_key(pair[0].to(_KEY_DTYPE[x.dtype]), how, x.dtype), index

    shape = _out_shape(gshape, (dim,), keepdim)
    n = returns(func)
    return Sharding((want,), (out,) * n, local=local, shapes=(shape,) * n)


def _pick(pairs, how: str, floating: bool) -> torch.Tensor:
    """The winning (key, index) of the ranks' stacked pairs, element-wise."""
    best = pairs[0]
    for other in pairs[1:]:
        bk, ok = best[0], other[0]
        if floating:
            # -0's key sits just below +0's; torch compares them equal, so
            # they tie and the index decides.
            bk = torch.where(bk == -1, torch.zeros_like(bk), bk)
            ok = torch.where(ok == -1, torch.zeros_like(ok), ok)
        wins = ok > bk if how == "max" else ok < bk
        wins |= (ok == bk) & (other[1] < best[1])
        best = torch.where(wins, other, best)
    return best


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
    aten.amax.default: extreme_dims_rule,
    aten.amin.default: extreme_dims_rule,
    aten.max.default: extreme_rule,
    aten.min.default: extreme_rule,
    aten.max.dim: extreme_along_dim_rule,
    aten.min.dim: extreme_along_dim_rule,
    aten.argmax.default: extreme_along_dim_rule,
    aten.argmin.default: extreme_along_dim_rule,
    aten.aminmax.default: aminmax_rule,
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
}
