"""Vector norms of sharded tensors without gathering them.

A p-norm over a sharded dim is a function of per-shard partial results:
each rank computes its share (``sum |x|^p`` for finite ``p != 0``, the count
of non-zeros for ``p = 0``, ``max |x|`` for ``inf``, ``min |x|`` for
``-inf``), one all-reduce (sum, max or min) per sharded mesh axis combines
the shares, and finite ``p`` takes the ``1/p``-th root. The result is
replicated on those axes. Orders ``p >= 0`` and ``inf`` send nothing instead:
each rank's norm of its share is a piece of the result, ``Partial("norm<p>")``
on those axes, as PyTorch's ``_NormPartial``; its first use reduces it. Dims that are not reduced keep their shards, and
partial values are reduced first (a norm is not linear in its pieces).

``_foreach_norm`` (what ``clip_grad_norm_`` calls) sends nothing for an
order ``p >= 0`` or ``inf``: each rank's norm of its piece is the result's
piece under ``Partial("norm<p>")`` (``dtensor.placement.norm_partial``). A
``vector_norm`` of the same order over such pieces is again a piece of the
norm (``(sum_t sum_r x[t,r]**p) ** (1/p)`` in either order; max of maxes), and
``stack`` / ``cat`` keep them, so ``clip_grad_norm_``'s total stays partial
until its first use reduces **one** scalar per mesh axis. Negative orders
(no identity for empty pieces) reduce in the rule: one all-reduce per group
of elements sharded on the same mesh axes, carrying every norm of the group.

The rules are pure; the combining happens in their ``local`` functions,
which run at execution time (``Sharding.local``) and read ``ord`` from the
actual arguments, since cached plans are shared across float values.
"""

from __future__ import annotations

import math

import torch

from dtensor import _comm
from dtensor._norm_wire import combining_op, from_bits, nan_first_bits
from dtensor.placement import Partial, Replicate, Shard, norm_partial
from dtensor.rules._util import bind, broadcast_shape, norm_dim, reduced_shard
from dtensor.rules.pointwise import pointwise_rule
from dtensor.sharding import Sharding

__all__ = ["RULES", "combine_shares", "local_share"]

aten = torch.ops.aten


def _ord(value) -> float:
    return 2.0 if value is None else float(value)


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
    how = combining_op(p)
    buf = shares if how == "sum" else nan_first_bits(shares, how)
    for axis in axes:
        group = mesh.axis_group(axis)
        if group is not None:
            buf = _comm.all_reduce(buf, how, group)
    if how != "sum":
        return from_bits(buf, how, shares.dtype)
    if p == 0.0:
        return buf
    return buf.pow(1.0 / p)


def _reduced(spec, dims) -> tuple[int, ...]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(spec.ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted({norm_dim(d, spec.ndim) for d in dims}))


# Argument names per overload: (ord, dim, keepdim, dtype); None where absent.
# torch.norm and Tensor.norm of a DTensor reach linalg_vector_norm;
# pairwise_distance (and the triplet losses) reach norm.ScalarOpt_dim.
_NAMES = {
    aten.linalg_vector_norm.default: ("ord", "dim", "keepdim", "dtype"),
    aten.norm.ScalarOpt_dim: ("p", "dim", "keepdim", None),
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
    # Pieces of a p-norm (p > 0) stay pieces under a norm of the same order;
    # counts (p = 0) do not: the count of non-zero counts is not their sum.
    keep = _partial_of(a.get(names[0]))
    if keep is not None and keep.norm_order == 0:
        keep = None
    piece = _partial_of(a.get(names[0]))
    want, out, axes = [], [], []
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            want.append(p)
            if p.dim in dims and piece is not None:
                # Each rank's norm of its share is a piece of the norm (as in
                # PyTorch): nothing sent; the first use reduces the result.
                out.append(piece)
                continue
            out.append(reduced_shard(p, dims, keepdim))
            if p.dim in dims:
                axes.append(axis)
        elif keep is not None and p == keep:  # a norm of norm pieces: a piece
            want.append(p)
            out.append(p)
        else:  # partial pieces are reduced first; replicated stays
            want.append(Replicate())
            out.append(Replicate())
    shape = tuple(
        1 if d in dims else size
        for d, size in enumerate(spec.shape)
        if keepdim or d not in dims
    )
    local = _combined_norm(tuple(axes)) if axes else None
    if local is None and any(p == piece for p in out):
        local = _norm_piece
    return Sharding((tuple(want),), (tuple(out),), local=local, shapes=(shape,))


def _norm_piece(func, coord, out_specs, args, kwargs):
    """This rank's norm of its share; 0 for an empty share (the identity of
    pieces, norms being >= 0; torch refuses the inf-norm of an empty tensor)."""
    x, p, dims, keepdim, dtype = _runtime_args(func, args, kwargs)
    reduced = range(x.ndim) if dims is None else [norm_dim(d, x.ndim) for d in dims]
    if math.prod(x.shape[d] for d in reduced) == 0:
        p = 2.0
    return torch.linalg.vector_norm(x, p, dims, keepdim, dtype=dtype)


def _foreach_combined(groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]):
    """``groups``: (mesh axes, element indices) for elements sharded on those axes."""
    sharded = frozenset(i for _, idx in groups for i in idx)

    def local(func, coord, out_specs, args, kwargs):
        xs, p, dtype = _foreach_args(args, kwargs)
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


def _partial_of(order) -> Partial | None:
    """``Partial("norm<p>")`` for a norm's ``ord`` argument, None where there is none."""
    p = _ord(order)
    return norm_partial(p) if p >= 0 else None  # NaN and negative orders: none


def _foreach_args(args, kwargs):
    """(tensors, ord, dtype) of a ``_foreach_norm`` call."""
    a = dict(zip(("self", "ord", "dtype"), args, strict=False)) | kwargs
    return a["self"], _ord(a.get("ord", 2)), a.get("dtype")


def _foreach_pieces(func, coord, out_specs, args, kwargs):
    """Each rank's norms of its pieces, the results' pieces (no communication)."""
    xs, p, dtype = _foreach_args(args, kwargs)
    if _all_ok(xs, p):
        return list(torch._foreach_norm(xs, p, dtype=dtype))
    # inf-norm of an empty piece: torch refuses; 0 is the max's identity here
    # (norms are >= 0).
    return [torch.linalg.vector_norm(x, p, dtype=dtype) if x.numel()
            else torch.linalg.vector_norm(x, 2.0, dtype=dtype)
            for x in xs]


def _all_ok(xs, p: float) -> bool:
    """``_foreach_norm`` may run on the local pieces as they are."""
    return (p >= 0 and p != math.inf) or all(x.numel() for x in xs)


def foreach_norm_rule(call):
    """Shard -> ``Partial("norm<p>")`` pieces for ``p >= 0`` or ``inf``, no
    communication; other orders per element like ``vector_norm_rule`` over all
    dims, with one all-reduce per group of elements sharded on the same mesh
    axes (and per axis)."""
    specs = call.specs
    if not specs:
        return None
    mesh = specs[0].mesh
    piece = _partial_of(bind(call).get("ord"))
    if piece is not None:
        want, out = [], []
        for spec in specs:
            want.append(tuple(p if isinstance(p, Shard) else Replicate()
                              for p in spec.placements))
            out.append(tuple(piece if isinstance(p, Shard) else Replicate()
                             for p in spec.placements))
        return Sharding(tuple(want), tuple(out), local=_foreach_pieces,
                        shapes=((),) * len(specs))
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


def dist_rule(call):
    """``dist(a, b, p)``: the p-norm of ``a - b`` (broadcast). The blocks of
    the broadcast difference partition it, so each rank's ``dist`` of its
    blocks is a piece of the result (``Partial("norm<p>")`` on the axes that
    cut it), nothing sent; the first use reduces one scalar. The operands
    take ``sub``'s layout (the point-wise rule): per mesh axis the operand
    shard, mapped through broadcasting, that leaves the fewest bytes to move;
    an operand that broadcasts along the cut dim (lacks it, or has size 1)
    is whole there, one that is replicated slices its block. Without this,
    operands of different shapes (``(5, 5, 5)`` and ``(5,)``) fell back to
    gathering the large one. Partial values are reduced first (a norm is not
    linear); orders without pieces (negative, -inf) keep the fallback."""
    if len(call.specs) != 2:
        return None
    a, b = call.specs
    piece = _partial_of(bind(call).get("p"))
    if piece is None or a.mesh != b.mesh:
        return None
    sub = pointwise_rule(call)  # dist is not linear: partial operands reduce first
    if sub is None:
        return None
    (out,) = sub.outputs
    pieces = tuple(piece if isinstance(p, Shard) else Replicate() for p in out)
    return Sharding(sub.inputs, (pieces,), local=_dist_pieces, shapes=((),))


def _dist_pieces(func, coord, out_specs, args, kwargs):
    x, y = args[0], args[1]
    if math.prod(broadcast_shape(x.shape, y.shape)) == 0:
        # an empty block: 0, the identity of pieces (norms >= 0; the inf
        # norm of an empty tensor raises)
        return x.new_zeros(())
    return func(x, y, *args[2:], **kwargs)


RULES: dict = {
    aten.dist.default: dist_rule,
    **dict.fromkeys(_NAMES, vector_norm_rule),
    aten._foreach_norm.Scalar: foreach_norm_rule,
}
