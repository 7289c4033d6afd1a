"""Ops that place values among sorted boundaries: bucketize, searchsorted.

Each output element depends on one value and the whole boundary row, so a
shard of the values stays (the boundaries whole along their last dim, cut
alike along the leading dims ``searchsorted`` batches over). The result is
the number of boundaries below each value (``right``: at or below), and the
boundaries are sorted (the ops are undefined otherwise): a contiguous block
of them counts those of its own below the value, and the blocks' counts add
up to the whole row's. So boundaries cut along their last dim against whole
values give ``Partial(sum)`` counts, which cost the output's all-reduce
where gathering the boundaries costs their own bytes; each mesh axis takes
the cheaper.
"""

from __future__ import annotations

import math

import torch

from dtensor.placement import Partial, Replicate, Shard
from dtensor.rules._util import bind
from dtensor.sharding import Sharding

__all__ = ["RULES"]

aten = torch.ops.aten


def _move(p, q, shape, nbytes: int, n: int) -> float:
    """Ring wire bytes of turning ``p`` into ``q`` on an axis of ``n`` ranks
    (a cut dim padded to a multiple of ``n``)."""
    if p == q or isinstance(p, Replicate) or n == 1:
        return 0.0  # kept, sliced, or made a piece in place
    if isinstance(p, Partial) and not isinstance(q, Shard):
        return 2 * (n - 1) / n * nbytes  # all-reduce
    length = shape[(p if isinstance(p, Shard) else q).dim]
    return 0.0 if length == 0 else (n - 1) * -(-length // n) * nbytes / length


def _nbytes(spec) -> int:
    return math.prod(spec.shape) * spec.dtype.itemsize


def _rule(seq, x, out_int32: bool) -> Sharding | None:
    """``seq``: the boundaries' spec; ``x``: the values' spec (None: a
    scalar). Input placements in that order."""
    if seq.ndim == 0 or (x is not None and seq.ndim > 1 and (
            x.ndim != seq.ndim or x.shape[:-1] != seq.shape[:-1])):
        return None
    shape = () if x is None else tuple(x.shape)
    out = (math.prod(shape) * (4 if out_int32 else 8), shape)
    last = seq.ndim - 1
    # dims cut alike in both: every dim of the values for 1-D boundaries
    # (boundaries whole), the batch dims of a batched searchsorted
    lead = set(range(last)) if seq.ndim > 1 else set()
    wx, ws, res = [], [], []
    for axis in range(seq.mesh.ndim):
        n = seq.mesh.shape[axis]
        ps = seq.placements[axis]
        px = Replicate() if x is None else x.placements[axis]
        options = []  # (values', boundaries', output's placements)
        for p in (px, ps):
            if isinstance(p, Shard) and x is not None and (p is px or p.dim in lead):
                opt = (p, p if p.dim in lead else Replicate(), p)
                if opt not in options:
                    options.append(opt)
        if ps == Shard(last):
            options.append((Replicate(), ps, Partial("sum")))
        if not options or options == [(Replicate(), ps, Partial("sum"))]:
            options.append((Replicate(), Replicate(), Replicate()))

        def cost(opt, px=px, ps=ps, n=n):
            qx, qs, r = opt
            c = _move(ps, qs, seq.shape, _nbytes(seq), n)
            if x is not None:
                c += _move(px, qx, x.shape, _nbytes(x), n)
            return c + _move(r, Replicate(), out[1], out[0], n)

        qx, qs, r = min(options, key=cost)
        wx.append(qx), ws.append(qs), res.append(r)
    inputs = (tuple(ws),) if x is None else (tuple(ws), tuple(wx))
    return Sharding(inputs, (tuple(res),), shapes=(shape,))


def bucketize_rule(call):
    b = bind(call)
    x = b["self"] if hasattr(b["self"], "placements") else None
    found = _rule(b["boundaries"], x, b["out_int32"])
    if found is None or x is None:
        return found
    return Sharding(found.inputs[::-1], found.outputs, shapes=found.shapes)  # values first


def searchsorted_rule(call):
    b = bind(call)
    if b["sorter"] is not None:
        return None
    x = b["self"] if hasattr(b["self"], "placements") else None
    return _rule(b["sorted_sequence"], x, b["out_int32"])


RULES: dict = {
    aten.bucketize.Tensor: bucketize_rule,
    aten.bucketize.Scalar: bucketize_rule,
    aten.searchsorted.Tensor: searchsorted_rule,
    aten.searchsorted.Scalar: searchsorted_rule,
}
