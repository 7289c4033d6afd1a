"""Ops that combine or pick elements: cat, stack, index_select, gather, take.

Operands' shards of the dims these ops leave alone stay; the joined dim of
``cat`` is whole; ``stack``'s new dim is never sharded. Each output element
is one input element, so pieces of one ``Partial`` kind join as they are and
a replicated operand joins them as a piece (no communication); an index
sharded apart from its source is met as the rules below say.
"""

from __future__ import annotations

import math

import torch

from dtensor._norm_wire import refuse_negative
from dtensor.placement import Partial, Replicate, Shard, is_linear_partial
from dtensor.rules._util import bind, norm_dim
from dtensor.sharding import Sharding

__all__ = ["RULES"]

aten = torch.ops.aten


# cat / stack -------------------------------------------------------------------------
def _nbytes(spec) -> int:
    return math.prod(spec.shape) * spec.dtype.itemsize


def _join(specs, dim: int, shift: bool):
    """Shared placements for concatenated operands; their output placements."""
    want, out = [], []
    for axis in range(specs[0].mesh.ndim):
        kinds = [s.placements[axis] for s in specs]
        choice = Replicate()
        partials = {k for k in kinds if isinstance(k, Partial)}
        if len(partials) == 1 and all(isinstance(k, (Partial, Replicate)) for k in kinds):
            # Each output element is one input element, so pieces of any one
            # kind join as they are, and a replicated operand joins them
            # without communication (a piece: the value on coordinate 0 and
            # the op's identity elsewhere, or everywhere for max/min), where
            # reducing them would send one all-reduce per operand (norm
            # pieces: clip_grad_norm_'s stack of per-tensor norms).
            choice = next(iter(partials))
        else:
            # A dim sharded on earlier axes is sharded again (nested) only
            # from an operand that nests it so itself: it moves nothing.
            shards = [k for s, k in zip(specs, kinds, strict=True)
                      if isinstance(k, Shard) and (shift or k.dim != dim) and all(
                          s.placements[e] == k for e, q in enumerate(want) if q == k)]
            n = specs[0].mesh.shape[axis]
            cut = sum(_nbytes(s) for s, k in zip(specs, kinds, strict=True) if isinstance(k, Shard))
            if shards and (len(dict.fromkeys(shards)) > 1
                           or all(specs[0].shape[k.dim] < n for k in shards)
                           or 2 * cut < sum(map(_nbytes, specs))):
                # Whole operands too where every shard moves something:
                # operands cut on different dims can move more onto any one
                # shard, and then out of it, than they move gathered; a dim
                # shorter than the axis leaves ranks holding nothing; an
                # output mostly made of whole operands would be cut only to
                # move all of it when it is made whole, where gathering the
                # few cut operands moves less (cartesian_prod's stack). Ties
                # keep the shard; one shard beside smaller whole operands
                # moves nothing and stays.
                shards.append(Replicate())
            if shards:
                choice = min(dict.fromkeys(shards), key=lambda k: _join_cost(specs, kinds, k, n))
        want.append(choice)
        if isinstance(choice, Shard) and shift and choice.dim >= dim:
            out.append(Shard(choice.dim + 1))
        else:
            out.append(choice)
    return tuple(want), tuple(out)


def _join_cost(specs, kinds, k, n: int) -> float:
    """Wire bytes of joining on ``k`` (a shard, or replicated) along an axis
    of ``n`` ranks: the operands moved onto it, then the output made whole.
    Gathering the output costs alike on every shard but for padding: a dim
    shorter than the axis leaves ranks empty, and each still sends a full
    piece. Ties go to the earliest operand's shard."""
    cost = 0.0
    for s, p in zip(specs, kinds, strict=True):
        if p == k or isinstance(p, Replicate):
            continue
        if isinstance(p, Partial) and not isinstance(k, Shard):
            cost += 2 * (n - 1) / n * _nbytes(s)  # all-reduce
        else:
            cost += _gather_bytes(s.shape, _nbytes(s), (p if isinstance(p, Shard) else k).dim, n)
    if not isinstance(k, Shard):
        return cost
    return cost + _gather_bytes(specs[0].shape, sum(map(_nbytes, specs)), k.dim, n)


def _gather_bytes(shape, nbytes: int, dim: int, n: int) -> float:
    """Ring wire bytes of gathering (or reduce-scattering) ``nbytes`` cut
    along ``dim`` of ``shape`` on ``n`` ranks: each sends a ceil-sized piece."""
    length = shape[dim]
    return 0.0 if length == 0 else (n - 1) * -(-length // n) * nbytes / length


def _joined(specs, want, out, shape=None) -> Sharding:
    """The Sharding of a cat/stack whose operands take ``want``.

    Replicated operands joining norm pieces stay as they are and become
    pieces inside the op (zeros off coordinate 0 of a finite p-norm axis):
    the same values ``Replicate -> Partial("norm<p>")`` gives, without a
    redistribute per operand (``clip_grad_norm_`` stacks one per replicated
    gradient every step), so the plan keeps a fast form.
    """
    axes = [a for a, p in enumerate(want) if isinstance(p, Partial) and p.norm_order is not None]
    keep = [i for i, s in enumerate(specs)
            if axes and any(s.placements[a] == Replicate() for a in axes)]
    shapes = None if shape is None else (shape,)
    if not keep:
        return Sharding((want,) * len(specs), (out,), shapes=shapes)
    inputs = []
    for i, s in enumerate(specs):
        if i in keep:
            inputs.append(tuple(s.placements[a] if a in axes and s.placements[a] == Replicate()
                                else p for a, p in enumerate(want)))
        else:
            inputs.append(want)
    zero = tuple((i, tuple(a for a in axes if specs[i].placements[a] == Replicate()
                           and not want[a].is_idempotent)) for i in keep)
    return Sharding(tuple(inputs), (out,), local=_norm_join_local(zero, want), shapes=shapes)


def _norm_join_local(zero, want):
    pieces = next(p for p in want if isinstance(p, Partial) and p.norm_order is not None)

    def local(func, coord, out_specs, args, kwargs):
        tensors = list(args[0])
        for i, axes in zero:
            t = tensors[i]
            # NOTE: the message is built only on failure (formatting the op
            # cost more than the check, three times per clip_grad_norm_).
            refuse_negative(t, _JoinOperand(func, i), pieces)
            for a in axes:
                if coord[a] != 0:
                    tensors[i] = torch.zeros_like(t)
                    break
        return func(tensors, *args[1:], **kwargs)

    return local


class _JoinOperand:
    """Names a replicated operand of a cat/stack in an error, when formatted."""

    __slots__ = ("func", "i")

    def __init__(self, func, i: int) -> None:
        self.func, self.i = func, i

    def __str__(self) -> str:
        return f"{self.func}: operand {self.i} (Replicate()) joining norm pieces"


def cat_rule(call):
    specs = call.specs
    if not specs or any(s.ndim != specs[0].ndim for s in specs) or specs[0].ndim == 0:
        return None
    dim = norm_dim(bind(call)["dim"], specs[0].ndim)
    want, out = _join(specs, dim, shift=False)
    return _joined(specs, want, out)


def stack_rule(call):
    specs = call.specs
    if not specs or any(s.shape != specs[0].shape for s in specs):
        return None
    dim = norm_dim(bind(call)["dim"], specs[0].ndim + 1)
    want, out = _join(specs, dim, shift=True)
    shape = list(specs[0].shape)
    shape.insert(dim, len(specs))
    return _joined(specs, want, out, tuple(shape))


# index_select / gather / take ------------------------------------------------------
def _picks_through(p) -> bool:
    """Pieces that a pick of elements keeps as pieces: partial sums, and
    max/min pieces (the max of picked elements is the pick of the max)."""
    return is_linear_partial(p) or p in (Partial("max"), Partial("min"))


def index_select_rule(call):
    x, index = call.specs
    dim = norm_dim(bind(call)["dim"], x.ndim)
    wx, wi, out = [], [], []
    for px, pi in zip(x.placements, index.placements, strict=True):
        if isinstance(px, Shard) and px.dim != dim:
            wx.append(px), wi.append(Replicate()), out.append(px)
        elif _picks_through(px):
            wx.append(px), wi.append(Replicate()), out.append(px)
        elif isinstance(pi, Shard) and x.ndim > 0:
            wx.append(Replicate()), wi.append(pi), out.append(Shard(dim))
        else:
            wx.append(Replicate()), wi.append(Replicate()), out.append(Replicate())
    return Sharding((tuple(wx), tuple(wi)), (tuple(out),))


def _move_bytes(spec, p, k, n: int) -> float:
    """Ring wire bytes of moving ``spec`` from ``p`` to ``k`` along an axis
    of ``n`` ranks: pieces all-reduce (or reduce-scatter onto a shard), a
    shard is gathered (then sliced), and a whole operand is cut locally."""
    if p == k or isinstance(p, Replicate):
        return 0.0
    if isinstance(p, Partial) and not isinstance(k, Shard):
        return 2 * (n - 1) / n * _nbytes(spec)
    return _gather_bytes(spec.shape, _nbytes(spec), (k if isinstance(p, Partial) else p).dim, n)


def _cheapest(operands, shape, nbytes: int, n: int, choices):
    """The first of ``choices`` (each ``(input placements..., output
    placement)``) that moves the fewest wire bytes along an axis of ``n``
    ranks: the ``operands`` (pairs of spec and placement) moved onto it,
    then the output (``shape``, ``nbytes``) made whole."""
    def cost(choice):
        *want, out = choice
        moved = sum(_move_bytes(s, p, k, n) for (s, p), k in zip(operands, want, strict=True))
        if isinstance(out, Partial):
            return moved + 2 * (n - 1) / n * nbytes
        if isinstance(out, Shard):
            return moved + _gather_bytes(shape, nbytes, out.dim, n)
        return moved
    return min(choices, key=cost)


def gather_rule(call):
    """``gather(x, dim, index)``: ``out[..i..] = x[..index[..i..]..]`` along
    ``dim`` and at the *same* position along every other dim, so a shard of
    another dim must cut x and the index alike (their sizes there must match);
    the index may be sharded along ``dim`` itself against a replicated x."""
    x, index = call.specs
    if x.ndim != index.ndim or x.ndim == 0:
        return None
    dim = norm_dim(bind(call)["dim"], x.ndim)
    wx, wi, out = [], [], []
    out_bytes = math.prod(index.shape) * x.dtype.itemsize
    for axis, (px, pi) in enumerate(zip(x.placements, index.placements, strict=True)):
        if (isinstance(px, Shard) and px.dim != dim and index.shape[px.dim] == x.shape[px.dim]
                and not (pi == Shard(dim) and _nbytes(x) < _nbytes(index))):
            # (an index cut along ``dim`` stays where moving it costs more than x)
            wx.append(px), wi.append(px), out.append(px)
        elif isinstance(px, Partial) or isinstance(pi, Partial):
            # Pieces of either: x's pieces looked up as pieces (the index made
            # whole, the output reduced), both reduced whole, or both
            # reduce-scattered onto a shared shard of another dim (the output
            # gathered), whichever moves the fewest bytes: pieces of both
            # reduce the index and then the output, where reduce-scattering
            # x and the index and gathering the smaller output can move less.
            choices = [(px, Replicate(), px)] if _picks_through(px) else []
            choices.append((Replicate(),) * 3)
            if isinstance(pi, Shard) and pi.dim == dim:
                choices.append((Replicate(), pi, pi))
            choices += [(Shard(d),) * 3 for d in range(x.ndim)
                        if d != dim and index.shape[d] == x.shape[d]]
            a, b, c = _cheapest([(x, px), (index, pi)], index.shape, out_bytes,
                                x.mesh.shape[axis], choices)
            wx.append(a), wi.append(b), out.append(c)
        elif _picks_through(px) and not isinstance(pi, Shard):
            wx.append(px), wi.append(Replicate()), out.append(px)
        elif isinstance(pi, Shard) and pi.dim == dim:
            wx.append(Replicate()), wi.append(pi), out.append(pi)
        elif isinstance(pi, Shard) and index.shape[pi.dim] == x.shape[pi.dim]:
            wx.append(pi), wi.append(pi), out.append(pi)  # x cut like the index
        else:
            wx.append(Replicate()), wi.append(Replicate()), out.append(Replicate())
    # Every shard of a dim other than ``dim`` cuts both operands alike, and
    # shards of ``dim`` come from the index alone: nested shards of one dim
    # (several axes) line up in mesh-axis order.
    return Sharding((tuple(wx), tuple(wi)), (tuple(out),))


def take_rule(call):
    """``take(x, index)``: x read as one flat tensor, so x is whole (or
    pieces, against a replicated index) and the output is cut as the index.
    Pieces of both: x's stay where the index (the output's size) has no
    more elements, so reducing the index and the output moves the least."""
    x, index = call.specs
    wx, wi, out = [], [], []
    for px, pi in zip(x.placements, index.placements, strict=True):
        if isinstance(pi, Shard):
            wx.append(Replicate()), wi.append(pi), out.append(pi)
        elif _picks_through(px) and (not isinstance(pi, Partial)
                                     or math.prod(index.shape) <= math.prod(x.shape)):
            wx.append(px), wi.append(Replicate()), out.append(px)
        else:
            wx.append(Replicate()), wi.append(Replicate()), out.append(Replicate())
    return Sharding((tuple(wx), tuple(wi)), (tuple(out),), shapes=(index.shape,))


RULES: dict = {
    aten.take.default: take_rule,
    aten.cat.default: cat_rule,
    aten.stack.default: stack_rule,
    aten.index_select.default: index_select_rule,
    aten.gather.default: gather_rule,
}
