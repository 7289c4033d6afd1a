"""Matrix products: mm, bmm, mv, dot, vdot, addmm, baddbmm, addmv, addbmm, addr.

Each op is an einsum over dim letters (mm: ``mk,kn->mn``). Per mesh axis the
rule picks the cheapest of: both replicated; one output letter sharded (the
operands holding it sharded on it, the others replicated); a contracted
letter sharded on both operands (output ``Partial(sum)``); one partial
operand times a replicated one (output keeps the partial). Cost counts the
elements each operand must move to reach its layout (slicing a replicated
operand is nearly free; a shard of another dim is a gather, then a slice),
and a ``Partial(sum)`` output counts the reduction it needs before it is read
whole, as does a sharded output of an outer product (``addr``: it holds more
than its operands together, so gathering an operand costs less than
gathering the output later). A shard the operands did not lay out (one moved
from another dim) is kept only where replicating every operand costs more
than that move plus gathering the output later. Pieces of a max/min, which
must be reduced first, go onto a shard (reduce-scatter) where gathering or
reducing the smaller output later costs less than replicating them
(all-reduce). ``matmul``, ``linear`` and ``einsum`` decompose into these ops
and views before they reach the dispatcher.

``StridedShard`` operands (a view that merged a cut inner dim into a row or
a column dim) are read as they are (``strided_aware``): a letter cut by
``StridedShard(_, sf)`` is one more kind of cut, offered as Shard is (the
operands holding the letter cut alike, the output cut so where it holds
the letter). A contracted letter is a ``Partial(sum)`` only when both
operands hold it cut the same way, Shard or StridedShard of the same split
factor; the rows each rank sums over are then the same. A StridedShard is
kept only where no operand's shard is gathered for it (each keeps its
layout, is cut from a whole copy, or has its pieces reduced): few rules
read interleaved rows, so the next op that does not gathers them anyway,
and a gather paid to keep them seldom pays off. Otherwise the strided
operand is gathered (or cut as a plain shard), as for any rule that does
not read the layout.
"""

from __future__ import annotations

import math

import torch

from dtensor.placement import Partial, Replicate, Shard, StridedShard, is_linear_partial
from dtensor.rules._util import shard_through_broadcast, strided_aware
from dtensor.sharding import Sharding

__all__ = ["RULES", "einsum_rule"]

aten = torch.ops.aten

_INF = float("inf")


def _cut(p) -> bool:
    return isinstance(p, (Shard, StridedShard))


def _cost(p, w, numel: int) -> float:
    if p == w:
        return 0.0
    if isinstance(w, Replicate):
        return float(numel)
    if _cut(w):
        # from another shard: gathered, then sliced (as a gather costs)
        return 0.01 * numel if isinstance(p, Replicate) else float(numel)
    # w is Partial: only a replicated operand may become partial cheaply.
    return 0.01 * numel if isinstance(p, Replicate) else _INF


def _cutters(pa, pb):
    """Ways to cut a letter on this axis: Shard, and StridedShard of each
    split factor an operand holds (so an operand keeps its interleaved rows)."""
    factors = sorted({p.split_factor for p in (pa, pb) if isinstance(p, StridedShard)})
    return (Shard, *(lambda d, sf=sf: StridedShard(d, sf) for sf in factors))


def _candidates(la: str, lb: str, lo: str, pa, pb, pbias=None):
    yield Replicate(), Replicate(), Replicate()
    for cut in _cutters(pa, pb):
        for i, letter in enumerate(lo):
            wa = cut(la.index(letter)) if letter in la else Replicate()
            wb = cut(lb.index(letter)) if letter in lb else Replicate()
            yield wa, wb, cut(i)
        for letter in la:
            if letter in lb and letter not in lo:
                # the same cut of both: each rank sums over the same indices
                yield cut(la.index(letter)), cut(lb.index(letter)), Partial("sum")
    if is_linear_partial(pa):
        yield pa, Replicate(), pa
    if is_linear_partial(pb):
        yield Replicate(), pb, pb
    if is_linear_partial(pbias) and pbias not in (pa, pb):
        # the bias's pieces kept: a replicated operand becomes pieces (local)
        yield pbias, Replicate(), pbias


def _extreme(p) -> bool:
    return isinstance(p, Partial) and p.reduce_op in ("max", "min")


def _later(o, pa, pb, wa, wb, na: int, nb: int, out_shape, ranks: int | None,
           gathered: bool = False) -> float:
    """What a choice costs after the op. Usually only a tie-break against a
    partial output; with ``gathered`` (an outer product) a sharded output
    counts its gather too. With pieces of a max/min, which must be reduced here,
    reducing one onto a shard (reduce-scatter) costs half of replicating it
    (all-reduce), but leaves the output to gather (sharded) or reduce
    (partial sum) later: the cheaper depends on the output's size. Not with
    a bias (``ranks`` None): its own pieces would need reducing too."""
    no = math.prod(out_shape)
    if ranks is None or not (_extreme(pa) or _extreme(pb)):
        # Partial sums are reduced before they are read whole: counted as one
        # reduce-scatter of the output, so a small operand is gathered rather
        # than a large output left to reduce (bmm of (b, m, 1) by (b, 1, n)).
        if isinstance(o, Partial):
            return 1e-3 + no
        return float(no) if gathered and _cut(o) else 0.0
    if _cut(o) and out_shape[o.dim] < ranks:
        return _INF  # some ranks would hold nothing, yet pay the reduction
    more = (na if _extreme(pa) and isinstance(wa, Replicate) else 0) + (
        nb if _extreme(pb) and isinstance(wb, Replicate) else 0)
    return more + (2 * no if isinstance(o, Partial) else no if _cut(o) else 0)


def _free(p, w) -> bool:
    """Operand layout ``w`` gathers no shard of ``p``: kept, cut from a whole
    copy, or pieces reduced whole (as they would be before any other use)."""
    return p == w or isinstance(p, Replicate) or (
        isinstance(p, Partial) and isinstance(w, Replicate))


def _resharded(p, w) -> bool:
    return _cut(p) and _cut(w) and p != w


def _choose(la, lb, lo, a, b, out_shape, bias=None):
    """Per mesh axis, the cheapest candidate; a bias (its spec) counts what
    it must move to the output's layout too. Where the cheapest moves an
    operand from a shard of one dim to another (a gather, then a slice) and
    replicating every operand costs no more than that plus gathering the
    output later, all are replicated: the output comes out whole."""
    na, nb = math.prod(a.shape), math.prod(b.shape)
    no = math.prod(out_shape)
    nbias = math.prod(bias.shape) if bias is not None else 0
    grows = not (set(la) & set(lb)) - set(lo)  # no contracted letter
    wa_all, wb_all, out = [], [], []
    for axis, (pa, pb) in enumerate(zip(a.placements, b.placements, strict=True)):
        best = whole = None
        ranks = None if bias is not None else a.mesh.size(axis)
        pbias = bias.placements[axis] if bias is not None else None
        for wa, wb, o in _candidates(la, lb, lo, pa, pb, pbias):
            # A shard of an output dim shorter than the axis leaves some ranks
            # empty: no work is split, and gathering it later moves the whole
            # output, so that gather counts as for an outer product (a 1x1
            # matrix_power: replicating both factors once beats gathering
            # every product's shard again).
            short = _cut(o) and out_shape[o.dim] < a.mesh.size(axis)
            strided = any(isinstance(w, StridedShard) for w in (wa, wb, o))
            if strided and not (_free(pa, wa) and _free(pb, wb)):
                continue
            c = _cost(pa, wa, na) + _cost(pb, wb, nb) + _later(
                o, pa, pb, wa, wb, na, nb, out_shape, ranks, grows or short)
            moved = _resharded(pa, wa) or _resharded(pb, wb)
            if bias is not None:
                wbias = _through(o, bias.shape, out_shape) if _cut(o) else o
                if strided and not _free(pbias, wbias):
                    continue
                c += _cost(pbias, wbias, nbias)
                moved = moved or _resharded(pbias, wbias)
            if whole is None:  # the first candidate: all replicated
                whole = (c, wa, wb, o)
            # of equal costs, one that keeps the operands' shards
            if best is None or (c, moved) < (best[0], best[4]):
                best = (c, wa, wb, o, moved)
        if best[4] and _cut(best[3]) and whole[0] <= best[0] + no:
            best = whole
        wa_all.append(best[1])
        wb_all.append(best[2])
        out.append(best[3])
    return tuple(wa_all), tuple(wb_all), tuple(out)


def _through(o, shape, out_shape):
    """The cut a bias of ``shape`` broadcast to ``out_shape`` needs where the
    output is cut by ``o``: the same cut of its matching dim, or Replicate."""
    w = shard_through_broadcast(Shard(o.dim), shape, out_shape)
    if isinstance(o, StridedShard) and isinstance(w, Shard):
        return StridedShard(w.dim, o.split_factor)
    return w


def _bias_want(bias, out_shape, out):
    # A partial output needs a partial bias (zeros elsewhere).
    return tuple(_through(p, bias.shape, out_shape) if _cut(p) else p for p in out)


def _broadcasts_to(shape, target) -> bool:
    lead = len(target) - len(shape)
    return lead >= 0 and all(n in (1, target[lead + i]) for i, n in enumerate(shape))


def einsum_rule(spec: str, bias: bool = False):
    """Rule for a two-operand product ``'ab,bc->ac'``, optionally after a bias."""
    ins, lo = spec.split("->")
    la, lb = ins.split(",")

    @strided_aware
    def rule(call):
        specs = call.specs
        if len(specs) != (3 if bias else 2):
            return None
        a, b = specs[-2], specs[-1]
        if a.ndim != len(la) or b.ndim != len(lb):
            return None
        sizes = dict(zip(la, a.shape, strict=True))
        # Output shape only when the contracted sizes agree (else the meta run
        # raises, and every rank replicates and fails alike).
        fits = all(sizes.get(c, n) == n for c, n in zip(lb, b.shape, strict=True))
        sizes.update(zip(lb, b.shape, strict=True))
        out_shape = tuple(sizes[c] for c in lo)
        wa, wb, out = _choose(la, lb, lo, a, b, out_shape, specs[0] if bias else None)
        shapes = (out_shape,) if fits else None
        if not bias:
            return Sharding((wa, wb), (out,), shapes=shapes, any_strides=True)
        if len(out_shape) < specs[0].ndim:
            return None
        fits = fits and _broadcasts_to(specs[0].shape, out_shape)
        wbias = _bias_want(specs[0], out_shape, out)
        return Sharding((wbias, wa, wb), (out,), shapes=shapes if fits else None,
                        any_strides=True)

    return rule


RULES: dict = {
    aten.mm.default: einsum_rule("mk,kn->mn"),
    aten.bmm.default: einsum_rule("bmk,bkn->bmn"),
    aten.mv.default: einsum_rule("mk,k->m"),
    aten.dot.default: einsum_rule("k,k->"),
    aten.vdot.default: einsum_rule("k,k->"),  # conj(a) . b: local pieces sum alike
    aten.addmm.default: einsum_rule("mk,kn->mn", bias=True),
    aten.baddbmm.default: einsum_rule("bmk,bkn->bmn", bias=True),
    aten.addmv.default: einsum_rule("mk,k->m", bias=True),
    aten.addbmm.default: einsum_rule("bmk,bkn->mn", bias=True),
    aten.addr.default: einsum_rule("m,n->mn", bias=True),
}
