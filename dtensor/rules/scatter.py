"""Ops that write into a copy of ``self``: scatter, scatter_add,
select_scatter, slice_scatter, index_put (and ``index_put_``, ``x[i] = v``),
index_add, index_copy, index_fill.

Shards of the dims an op does not address stay when every tensor it reads
there is cut alike (the written values' and an aligned index's sizes along
that dim equal ``self``'s, or the values broadcast along it). The index is
whole otherwise: a write lands on the rank whose block it addresses only if
the addressed dim is whole there.

With a replicated index, each output element of an overwriting op is, on
every rank alike, one element of ``self`` or one written value, so pieces
of any of sum, avg, max, min pass: pieces of ``self`` and of the written
values combine as they are, and a replicated one of the two joins the
other's pieces (made a piece without communication). The adding ops
(``scatter_add``, ``index_add``, ``index_put(accumulate=True)``) give the
sum of ``self`` and the written values, so only linear pieces (sum, avg)
pass. A scalar written value is the same on every rank: it is a piece only
of an idempotent kind (avg, max, min). Each mesh axis takes whichever of
these layouts moves the fewest bytes, the output's own gather included
(pieces that cannot pass may go onto a shard: a reduce-scatter, not an
all-reduce).
"""

from __future__ import annotations

import math

import torch

from dtensor.placement import Partial, Replicate, Shard
from dtensor.rules._util import bind, norm_dim, shard_through_broadcast
from dtensor.sharding import Sharding, writes_self

__all__ = ["RULES"]

aten = torch.ops.aten

_PICK = frozenset(("sum", "avg", "max", "min"))
_ADD = frozenset(("sum", "avg"))
_SCALAR = frozenset(("avg", "max", "min"))


def _plan(specs, cuts, writer, kinds, inplace=False) -> Sharding:
    """Per mesh axis, one layout for every operand.

    ``cuts[i]`` maps a dim ``d`` of ``self`` (operand 0) that may stay
    sharded to the placement operand ``i`` then needs, and has one key per
    such dim (every operand's map has the same keys). ``writer`` is the
    operand of written values (None: a scalar), ``kinds`` the Partial kinds
    that pass.

    Each axis takes the cheapest of: a shard of a free dim, the pieces that
    pass, or replicated, in wire bytes then collectives, counting the moves
    of the operands and making the output whole. The output is counted
    because it has ``self``'s size: a shard taken from a smaller written
    value, or pieces kept from small operands, can leave more to move than
    gathering those operands. Ties keep ``self``'s own shard, then pieces,
    then another shard, then replicated. An in-place op keeps ``self``'s
    layout where it can: anything else is computed replicated and written
    back into it.
    """
    want = [[] for _ in specs]
    out = []
    for axis in range(specs[0].mesh.ndim):
        n = specs[0].mesh.shape[axis]
        have = [s.placements[axis] for s in specs]
        options = []
        own = have[0]
        if isinstance(own, Shard) and own.dim in cuts[0]:
            options.append(([c[own.dim] for c in cuts], own))
        kind = _passing(have, writer, kinds)
        if kind is not None:
            options.append(([kind if i in (0, writer) else Replicate()
                             for i in range(len(specs))], kind))
        options += [([c[d] for c in cuts], Shard(d)) for d in cuts[0] if Shard(d) != own]
        replicate = ([Replicate()] * len(specs), Replicate())
        options.append(replicate)
        if inplace:
            options = [o for o in options if o[1] == own] or [replicate]

        def cost(option, have=have, n=n):
            ins, res = option
            moves = [_move(p, q, s, n) for p, q, s in zip(have, ins, specs, strict=True)]
            moves.append(_move(res, Replicate(), specs[0], n))
            return sum(m[0] for m in moves), sum(m[1] for m in moves)

        ins, res = min(options, key=cost)
        for w, q in zip(want, ins, strict=True):
            w.append(q)
        out.append(res)
    return Sharding(tuple(map(tuple, want)), (tuple(out),), shapes=(specs[0].shape,))


def _move(p, q, spec, n: int) -> tuple[float, int]:
    """(wire bytes, collectives) of turning ``p`` into ``q`` on an axis of
    ``n`` ranks, as ring collectives move them; a cut dim is padded to a
    multiple of ``n`` (every rank sends rank 0's ceil-sized piece)."""
    if p == q or isinstance(p, Replicate) or n == 1:
        return 0.0, 0  # kept, sliced, or made a piece in place
    nbytes = math.prod(spec.shape) * spec.dtype.itemsize
    if isinstance(p, Partial) and not isinstance(q, Shard):
        return 2 * (n - 1) / n * nbytes, 1  # all-reduce
    # A gather (then a slice or a piece made in place), or a reduce-scatter.
    length = spec.shape[(p if isinstance(p, Shard) else q).dim]
    return (0.0 if length == 0 else (n - 1) * -(-length // n) * nbytes / length), 1


def _passing(have, writer, kinds):
    """The Partial kind this axis keeps, or None."""
    if writer is None:
        p = have[0]
        return p if isinstance(p, Partial) and p.reduce_op in kinds & _SCALAR else None
    pair = (have[0], have[writer])
    pieces = {p for p in pair if isinstance(p, Partial)}
    if len(pieces) != 1 or not all(isinstance(p, (Partial, Replicate)) for p in pair):
        return None
    (p,) = pieces
    return p if p.reduce_op in kinds else None


def _same_cut(specs, dims_of):
    """``{d: placements per operand}`` for dims ``d`` of ``self`` every
    operand can be cut along: ``dims_of[i](d)`` is operand ``i``'s matching
    dim (None: not cut there, it must then hold the whole dim)."""
    x = specs[0]
    cuts = [{} for _ in specs]
    for d in range(x.ndim):
        row = []
        for dim_of in dims_of:
            e = dim_of(d)
            if e is False:
                break
            row.append(Replicate() if e is None else Shard(e))
        else:
            for c, p in zip(cuts, row, strict=True):
                c[d] = p
    return cuts


# scatter / scatter_add -----------------------------------------------------------
def _scatter(call, kinds):
    specs = call.specs
    x, index = specs[0], specs[1]
    dim = norm_dim(bind(call)["dim"], x.ndim)

    def aligned(s):
        # An index element and the value it writes sit at the same position
        # along every dim but ``dim``: those dims are cut alike only when
        # their sizes match.
        def dim_of(d):
            ok = s.ndim == x.ndim and d != dim and s.shape[d] == x.shape[d]
            return d if ok else False
        return dim_of

    if x.ndim == 0 or index.ndim != x.ndim:
        cuts = [{} for _ in specs]
    else:
        cuts = _same_cut(specs, [lambda d: d if d != dim else False] + [
            aligned(s) for s in specs[1:]])
    return _plan(specs, cuts, 2 if len(specs) > 2 else None, kinds)


def scatter_rule(call):
    """``scatter`` overwrites: pieces of any pick kind pass."""
    return _scatter(call, _PICK)


def scatter_add_rule(call):
    return _scatter(call, _ADD)


# select_scatter / slice_scatter --------------------------------------------------
def select_scatter_rule(call):
    x = call.specs[0]
    if x.ndim == 0:
        return None
    dim = norm_dim(bind(call)["dim"], x.ndim)
    cuts = _same_cut(call.specs, [
        lambda d: d if d != dim else False,
        lambda d: d if d < dim else d - 1])
    return _plan(call.specs, cuts, 1, _PICK)


def slice_scatter_rule(call):
    x, src = call.specs
    if x.ndim == 0 or src.ndim != x.ndim:
        return None
    dim = norm_dim(bind(call)["dim"], x.ndim)
    cuts = _same_cut(call.specs, [lambda d: d if d != dim else False] * 2)
    return _plan(call.specs, cuts, 1, _PICK)


# index_add / index_copy / index_fill ----------------------------------------------
def _index_dim(call, kinds):
    specs = call.specs
    x = specs[0]
    dim = norm_dim(bind(call)["dim"], x.ndim)
    writer = 2 if len(specs) > 2 else None

    def source(d):
        s = specs[2]
        if s.ndim == 0:
            return None  # a 0-d value (index_fill) is written whole
        return d if s.ndim == x.ndim and s.shape[d] == x.shape[d] else False

    dims_of = [lambda d: d if d != dim else False, lambda d: None]
    if writer is not None:
        dims_of.append(source)
    cuts = _same_cut(specs, dims_of) if x.ndim else [{} for _ in specs]
    return _plan(specs, cuts, writer, kinds)


def index_add_rule(call):
    return _index_dim(call, _ADD)


def index_overwrite_rule(call):
    """``index_copy``/``index_fill`` overwrite: pieces of any pick kind pass
    (a scalar fill value: idempotent kinds only)."""
    return _index_dim(call, _PICK)


# index_put -----------------------------------------------------------------------
def _put_layout(x, indices):
    """For each dim of ``x`` no index addresses, its position in the indexed
    result (``x[indices]``), and that result's number of dims; None where the
    indices are of a kind this rule does not reason about."""
    taken, spots, nd = set(), [], 0
    at = 0
    for ix in indices:
        if ix is None:
            at += 1
            continue
        if ix.dtype in (torch.bool, torch.uint8):
            width, out_nd = ix.ndim, 1
        elif ix.dtype in (torch.int64, torch.int32):
            width, out_nd = 1, ix.ndim
        else:
            return None
        spots.append(at)
        taken.update(range(at, at + width))
        at += width
        nd = max(nd, out_nd)
    if at > x.ndim:
        return None
    rest = [d for d in range(x.ndim) if d not in taken]
    first = min(spots, default=0)
    together = sorted(taken) == list(range(first, first + len(taken)))
    pos = {}
    for k, d in enumerate(rest):
        # Indices next to each other put their result dims where they were;
        # indices apart put them first.
        pos[d] = (d if d < first else d - len(taken) + nd) if together else nd + k
    return pos, len(rest) + nd


def index_put_rule(call):
    a = bind(call)
    specs = call.specs
    x, values = specs[0], specs[-1]
    layout = _put_layout(x, a["indices"]) if x.ndim else None
    n_index = len(specs) - 2

    def value_dim(d):
        pos, nd = layout
        if d not in pos:
            return False
        shape = [1] * nd
        shape[pos[d]] = x.shape[d]
        p = shard_through_broadcast(Shard(pos[d]), values.shape, shape)
        if isinstance(p, Shard) and values.shape[p.dim] != x.shape[d]:
            return False
        return p.dim if isinstance(p, Shard) else None

    if layout is None:
        cuts = [{} for _ in specs]
    else:
        cuts = _same_cut(specs, [lambda d: d if d in layout[0] else False]
                         + [lambda d: None] * n_index + [value_dim])
    return _plan(specs, cuts, len(specs) - 1, _ADD if a["accumulate"] else _PICK,
                 inplace=writes_self(call.func))


RULES: dict = {
    aten.scatter.src: scatter_rule,
    aten.scatter.value: scatter_rule,
    aten.scatter_add.default: scatter_add_rule,
    aten.select_scatter.default: select_scatter_rule,
    aten.slice_scatter.default: slice_scatter_rule,
    aten.index_add.default: index_add_rule,
    aten.index_copy.default: index_overwrite_rule,
    aten.index_fill.int_Scalar: index_overwrite_rule,
    aten.index_fill.int_Tensor: index_overwrite_rule,
    aten.index_put.default: index_put_rule,
    aten.index_put_.default: index_put_rule,
}
