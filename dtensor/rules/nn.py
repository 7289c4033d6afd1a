"""Neural-network ops: layer norm, embedding, nll loss (and their backward).

Layer norm keeps shards on the batch dims (those before the normalised
shape); its weight and bias gradients sum over the batch, so they come out
``Partial(sum)`` where the batch is sharded. Embedding lookups keep the
indices' shards (replicated table), the table's column shards, or its row
(vocabulary) shards with replicated indices: each coordinate looks up the
rows it holds and the output is ``Partial(sum)``, the table never gathered;
a column-sharded table against sharded indices stays, the indices gathered,
where they are the smaller; pieces of a table (sum, max or min) are looked up
as pieces where reducing the output moves the fewest bytes, else the table is
reduced (whole or onto a column shard) first.
The embedding gradient comes out replicated from replicated indices and
output gradient: its rule cannot see the table's layout, and a row-sharded
gradient for a replicated table would be gathered again at the optimizer
step, while a replicated one reaches a row-sharded table by a local slice. The
negative log-likelihood (``nll_loss`` on (N, C) and ``nll_loss2d`` on
(N, C, H, W), where N-d cross entropy lands) keeps a sharded batch (N, H, W,
never C) for ``reduction='none'`` and ``'sum'`` (a partial sum); ``'mean'``
divides by a global weight total, so its forward all-reduces the local sum
and weight total together (two elements, never the batch); its backward
receives that global total and keeps the batch sharded.

Element-wise losses of two same-shaped operands (``mse_loss``,
``smooth_l1_loss``, ``huber_loss``, ``soft_margin_loss``) keep any shard:
``'none'`` is point-wise, ``'sum'`` a partial sum of local sums, and
``'mean'`` a partial sum of local sums divided by the global element count
(a mean of uneven local means would be wrong), so one all-reduce of one
element makes the loss full instead of gathering both operands. Their
backward ops are element-wise given a replicated scalar gradient ('sum',
'mean': the local 'sum' gradient over the global count) or one sharded like
the operands ('none').
"""

from __future__ import annotations

import math

import torch

from dtensor import _comm
from dtensor.placement import (
    Partial,
    Replicate,
    Shard,
    format_placements,
    is_linear_partial,
    replicated,
)
from dtensor.rules._util import bind
from dtensor.rules.join import _cheapest, _picks_through
from dtensor.rules.pointwise import pointwise_rule
from dtensor.sharding import Sharding
from dtensor.spec import local_block

__all__ = ["RULES"]

aten = torch.ops.aten


def _batch_only(spec, limit: int):
    """Shards on dims below ``limit`` stay; everything else is replicated."""
    return tuple(
        p if isinstance(p, Shard) and p.dim < limit else Replicate() for p in spec.placements
    )


def _sum_over_batch(want):
    return tuple(Partial("sum") if isinstance(p, Shard) else Replicate() for p in want)


def layer_norm_rule(call):
    x = call.specs[0]
    a = bind(call)
    axis = x.ndim - len(a["normalized_shape"])
    want = _batch_only(x, axis)
    inputs = (want,) + (replicated(x.mesh),) * (len(call.specs) - 1)
    return Sharding(inputs, (want, want, want))


def layer_norm_backward_rule(call):
    a = bind(call)
    x = call.specs[1]
    axis = x.ndim - len(a["normalized_shape"])
    want = _batch_only(x, axis)
    if want == replicated(x.mesh):
        want = _batch_only(call.specs[0], axis)
    inputs = (want, want, want, want) + (replicated(x.mesh),) * (len(call.specs) - 4)
    reduced = _sum_over_batch(want)
    return Sharding(inputs, (want, reduced, reduced))


def embedding_rule(call):
    """``embedding(weight, indices)`` keeps, per mesh axis: the indices' shard
    (table replicated there), the table's column shard (``Shard(1)``: the
    output's last dim), or the table's row shard (``Shard(0)``, the
    vocabulary) with replicated indices. For the row shard each coordinate
    looks up only the rows it holds and reads the others as zero rows, so the
    output is ``Partial(sum)`` there: exactly one coordinate contributes each
    row and the table never moves. ``padding_idx`` and ``scale_grad_by_freq``
    only change backward, which autograd records with the global indices, so
    every argument of this op leaves the masked lookup exact (``max_norm`` is
    a separate op, ``embedding_renorm_``)."""
    weight, indices = call.specs
    if weight.ndim != 2:
        return None
    ww, wi, out = [], [], []
    vocab = False
    # Against sharded indices, a column-sharded table stays where gathering
    # the indices moves fewer bytes than gathering the table.
    keep_cols = (math.prod(indices.shape) * indices.dtype.itemsize
                 < math.prod(weight.shape) * weight.dtype.itemsize)
    shape = (*indices.shape, weight.shape[1])
    out_bytes = math.prod(shape) * weight.dtype.itemsize
    for axis, (pw, pi) in enumerate(zip(weight.placements, indices.placements, strict=True)):
        if isinstance(pw, Partial) or (isinstance(pi, Partial) and pw == Replicate()):
            # Pieces: a lookup of table pieces gives output pieces, whose
            # reduction moves the output, larger than the table wherever rows
            # are looked up more than once in all; so the table's pieces stay
            # only where that moves the fewest bytes, else the table is
            # reduced whole, or onto a column shard (the output gathered), or
            # the indices onto a shard of theirs.
            choices = [(pw, Replicate(), pw)] if _picks_through(pw) else []
            choices.append((Replicate(),) * 3)
            choices.append((Shard(1), Replicate(), Shard(indices.ndim)))
            choices += [(Replicate(), Shard(d), Shard(d)) for d in range(indices.ndim)]
            a, b, c = _cheapest([(weight, pw), (indices, pi)], shape, out_bytes,
                                weight.mesh.shape[axis], choices)
            ww.append(a), wi.append(b), out.append(c)
        elif isinstance(pi, Shard) and not (pw == Shard(1) and keep_cols):
            ww.append(Replicate()), wi.append(pi), out.append(pi)
        elif isinstance(pw, Shard) and pw.dim == 1:
            ww.append(pw), wi.append(Replicate()), out.append(Shard(indices.ndim))
        elif isinstance(pw, Shard) and pw.dim == 0:
            ww.append(pw), wi.append(Replicate()), out.append(Partial("sum"))
            vocab = True
        else:
            ww.append(Replicate()), wi.append(Replicate()), out.append(Replicate())
    ww, wi, out = tuple(ww), tuple(wi), tuple(out)
    if not vocab:
        return Sharding((ww, wi), (out,))
    local = _vocab_lookup(tuple(weight.shape), tuple(weight.mesh.shape), ww)
    return Sharding((ww, wi), (out,), local=local, shapes=(shape,))


def _vocab_lookup(shape: tuple[int, ...], mesh_shape: tuple[int, ...], ww):
    """This coordinate's part of a lookup in a row-sharded table: its rows
    ``[start, start + rows)`` (``torch.chunk`` pieces, possibly none), the
    other indices read as zero rows."""
    vocab = shape[0]

    def local(func, coord, out_specs, args, kwargs):
        table, ids = args[0], args[1]
        (rows, _), (start, _) = local_block(shape, mesh_shape, ww, coord)
        # A wrong index must not turn into a silent zero row: single device
        # raises, and so does every coordinate holding that index.
        if ids.numel():
            ok = ((ids >= 0) & (ids < vocab)).all()
            if ids.device.type == "cpu":
                if not bool(ok):
                    bad = ids[(ids < 0) | (ids >= vocab)][0].item()
                    raise IndexError(
                        f"{func}: index {bad} out of range for a table of {vocab} rows "
                        f"(weight {format_placements(ww)})"
                    )
            else:  # no host sync on accelerators, like the op's own check
                torch._assert_async(ok)
        if rows == 0:  # a trailing piece of an uneven table holds no rows
            return table.new_zeros((*ids.shape, table.shape[1]))
        shifted = ids - start
        outside = (shifted < 0) | (shifted >= rows)
        # padding_idx -1: it only shapes backward, and may lie off this piece.
        kwargs = {k: v for k, v in kwargs.items() if k != "padding_idx"}
        out = func(table, shifted.masked_fill(outside, 0), -1, *args[3:], **kwargs)
        return out.masked_fill_(outside.unsqueeze(-1), 0)

    return local


def embedding_backward_rule(call):
    grad, indices = call.specs
    a = bind(call)
    last = grad.ndim - 1
    wg, wi, out = [], [], []
    for pg, pi in zip(grad.placements, indices.placements, strict=True):
        batch = pg if isinstance(pg, Shard) and pg.dim < last else (
            Shard(pi.dim) if isinstance(pi, Shard) else None
        )
        if batch is not None and not a["scale_grad_by_freq"]:
            wg.append(batch), wi.append(batch), out.append(Partial("sum"))
        elif isinstance(pg, Shard) and pg.dim == last:
            wg.append(pg), wi.append(Replicate()), out.append(Shard(1))
        elif is_linear_partial(pg):
            wg.append(pg), wi.append(Replicate()), out.append(pg)
        else:
            wg.append(Replicate()), wi.append(Replicate()), out.append(Replicate())
    return Sharding((tuple(wg), tuple(wi)), (tuple(out),))


def _nll_layout(x, target, grad=None):
    """Per mesh axis, the placements ``(self, target)`` of a negative
    log-likelihood take: a shard of a batch dim (``N`` and, for
    ``nll_loss2d``, ``H`` and ``W``) stays, self's first, else target's
    (else that of ``grad``, a per-sample gradient shaped like target); the
    class dim ``C`` (self's dim 1) is never split, since each sample's loss
    reads its whole row of classes. Self's dim ``d`` is target's ``d - 1``
    past the class dim."""
    rep = replicated(x.mesh)
    if x.ndim < 2 or target.ndim != x.ndim - 1:
        return rep, rep
    xw, tw = [], []
    others = grad.placements if grad is not None else rep
    for p, q, r in zip(x.placements, target.placements, others, strict=True):
        q = q if isinstance(q, Shard) else r
        if isinstance(p, Shard) and p.dim != 1:
            d = p.dim
        elif isinstance(q, Shard):
            d = q.dim + 1 if q.dim else 0
        else:
            xw.append(Replicate()), tw.append(Replicate())
            continue
        xw.append(Shard(d)), tw.append(Shard(d - 1 if d else 0))
    return tuple(xw), tuple(tw)


def nll_loss_rule(call):
    """``nll_loss_forward`` / ``nll_loss2d_forward(self, target, weight,
    reduction, ignore_index)`` on a sharded batch: 'none' keeps target's
    shard, 'sum' is a partial sum (loss and weight total), 'mean' divides
    the global sum by the global weight total (one all-reduce of both)."""
    a = bind(call)
    x, target = call.specs[0], call.specs[1]
    rep = replicated(x.mesh)
    xw, tw = _nll_layout(x, target)
    inputs = (xw, tw) + (rep,) * (len(call.specs) - 2)
    partial = _sum_over_batch(xw)
    if a["reduction"] == 1 and xw != rep:  # mean: over the global weight total
        axes = tuple(i for i, p in enumerate(xw) if isinstance(p, Shard))
        return Sharding(inputs, (rep, rep), local=_nll_mean_local(axes), shapes=((), ()))
    out = tw if a["reduction"] == 0 else partial
    return Sharding(inputs, (out, partial))


def _reduction_sum(func, args, kwargs):
    """``args``/``kwargs`` of a loss call with its reduction set to 'sum'
    (local pieces are summed before any global divisor is applied)."""
    names = [a.name for a in func._schema.arguments]
    i = names.index("reduction")
    if i < len(args):
        return (*args[:i], 2, *args[i + 1:]), kwargs
    return args, {**kwargs, "reduction": 2}


def _nll_mean_local(axes: tuple[int, ...]):
    """The local 'sum' loss and weight total travel in one all-reduce of two
    elements; the mean is their quotient (the total is data-dependent:
    ignored targets and class weights)."""

    def local(func, coord, out_specs, args, kwargs):
        args, kwargs = _reduction_sum(func, args, kwargs)
        buf = torch.stack(func(*args, **kwargs))
        mesh = out_specs[0].mesh
        for axis in axes:
            group = mesh.axis_group(axis)
            if group is not None:
                buf = _comm.all_reduce(buf, "sum", group)
        return buf[0] / buf[1], buf[1]

    return local


def nll_loss_backward_rule(call):
    """``nll_loss_backward`` / ``nll_loss2d_backward(grad_output, self,
    target, weight, reduction, ignore_index, total_weight)``: the gradient
    keeps the batch shard. 'mean' divides by ``total_weight``, which its
    forward made global (replicated); 'sum' and 'none' never read it, so it
    stays as it came (a partial total is not reduced for nothing)."""
    a = bind(call)
    grad, x, target = call.specs[0], call.specs[1], call.specs[2]
    rep = replicated(x.mesh)
    mean = a["reduction"] == 1
    if a["reduction"] != 0:
        xw, tw = _nll_layout(x, target)
    elif grad.shape == target.shape:
        xw, tw = _nll_layout(x, target, grad)
    else:
        xw, tw = rep, rep
    gwant = tw if a["reduction"] == 0 else rep
    inputs = (gwant, xw, tw) + (rep,) * (len(call.specs) - 4) + (rep if mean else None,)
    return Sharding(inputs, (xw,))


def elementwise_loss_rule(call):
    """``loss(input, target, reduction, ...)`` of same-shaped operands: both
    take input's shard (else target's) per mesh axis; partial values are
    reduced first (the losses are not linear)."""
    if len(call.specs) != 2:
        return None
    x, t = call.specs
    if x.shape != t.shape:
        return None
    want = tuple(
        p if isinstance(p, Shard) else q if isinstance(q, Shard) else Replicate()
        for p, q in zip(x.placements, t.placements, strict=True)
    )
    reduction = bind(call)["reduction"]
    if reduction == 0:  # 'none'
        return Sharding((want, want), (want,), shapes=(tuple(x.shape),))
    out = _sum_over_batch(want)
    local = None
    if reduction == 1 and out != want:  # 'mean' over shards: global count
        local = _loss_mean_as_sum(math.prod(x.shape))
    return Sharding((want, want), (out,), local=local, shapes=((),))


def _loss_mean_as_sum(count: int):
    """A piece's 'sum' (loss, or gradient of the loss) over the global
    element count: forward pieces add up to the global mean, and a gradient
    piece is its elements' share of it."""

    def local(func, coord, out_specs, args, kwargs):
        args, kwargs = _reduction_sum(func, args, kwargs)
        s = func(*args, **kwargs)  # 'sum' of the local piece (0 when empty)
        # NOTE: 0/0 must stay NaN like the single-device mean of an empty loss.
        return s / count if count else s / 0.0

    return local


def elementwise_loss_backward_rule(call):
    """``loss_backward(grad_output, input, target, reduction, ...)`` of
    same-shaped operands: the gradient takes the operands' shard (input's,
    else target's, else, for 'none', grad_output's). Each element's gradient
    is local; 'none' needs grad_output sharded alike, 'sum' and 'mean' a
    replicated scalar, and 'mean' divides by the global element count (the op
    on a piece would divide by the piece's)."""
    if len(call.specs) != 3:
        return None
    g, x, t = call.specs
    if x.shape != t.shape:
        return None
    reduction = bind(call)["reduction"]
    # grad_output is 0-d (what autograd passes for 'sum'/'mean') or, as one
    # device also accepts, self's shape: then it is element-wise like 'none'.
    per_element = g.shape == x.shape
    if not per_element and (g.shape or reduction == 0):
        return None
    shards = zip(x.placements, t.placements, g.placements, strict=True)
    want = tuple(
        p if isinstance(p, Shard) else q if isinstance(q, Shard)
        else r if per_element and isinstance(r, Shard) else Replicate()
        for p, q, r in shards
    )
    shape = (tuple(x.shape),)
    if reduction == 0:  # 'none'
        return Sharding((want, want, want), (want,), shapes=shape)
    rep = replicated(x.mesh)
    local = None
    if reduction == 1 and want != rep:
        local = _loss_mean_as_sum(math.prod(x.shape))
    g_want = want if per_element and g.shape else rep
    return Sharding((g_want, want, want), (want,), local=local, shapes=shape)


RULES: dict = {
    aten.mse_loss.default: elementwise_loss_rule,
    aten.smooth_l1_loss.default: elementwise_loss_rule,
    aten.huber_loss.default: elementwise_loss_rule,
    aten.soft_margin_loss.default: elementwise_loss_rule,
    aten.mse_loss_backward.default: elementwise_loss_backward_rule,
    aten.smooth_l1_loss_backward.default: elementwise_loss_backward_rule,
    aten.huber_loss_backward.default: elementwise_loss_backward_rule,
    aten.soft_margin_loss_backward.default: elementwise_loss_backward_rule,
    aten.native_layer_norm.default: layer_norm_rule,
    aten.native_layer_norm_backward.default: layer_norm_backward_rule,
    aten.embedding.default: embedding_rule,
    aten.embedding_dense_backward.default: embedding_backward_rule,
    aten.nll_loss_forward.default: nll_loss_rule,
    aten.nll_loss_backward.default: nll_loss_backward_rule,
    aten.nll_loss2d_forward.default: nll_loss_rule,
    aten.nll_loss2d_backward.default: nll_loss_backward_rule,
    aten.masked_fill.Tensor: pointwise_rule,
    aten.masked_fill_.Tensor: pointwise_rule,
}
