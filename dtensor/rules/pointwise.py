"""Pointwise ops: unary, binary, ternary, with broadcasting and in-place forms.

The output keeps, per mesh axis, the operand shard (mapped through
broadcasting) that leaves the fewest operand bytes to move (of equals, the
lowest output dim: a later reduction over trailing feature dims, as a norm
or a loss does, then keeps it, and PyTorch breaks the tie alike), so
elementwise ops on identically placed operands never communicate and
differently placed ones move the least. Partial
operands survive only through linear ops (``neg``, ``add``/``sub`` of
partial sums and replicated values, ``mul``/``div`` of one partial operand
by replicated values, a second partial factor reduced) and through
``maximum``/``minimum`` of ``Partial("max")``/``Partial("min")`` pieces and
monotone non-decreasing unary ops (``clamp``, ``relu``, ``exp``...) of them;
any other op sees them reduced first.
"""

from __future__ import annotations

import math

import torch

from dtensor.placement import Partial, Placement, Replicate, Shard
from dtensor.rules._util import bind, broadcast_shape, shard_through_broadcast
from dtensor.sharding import Sharding, writes_self

__all__ = ["RULES", "pointwise_rule"]

aten = torch.ops.aten

# Linear in each operand, so partial sums may be combined without reducing.
_ADDITIVE = {aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor,
             aten.rsub.Tensor}
# Linear in exactly one operand (the partial one; for div, the numerator).
_MULTIPLICATIVE = {
    aten.mul.Tensor,
    aten.mul_.Tensor,
    aten.div.Tensor,
    aten.div_.Tensor,
}
_SCALING = {
    aten.mul.Scalar,
    aten.mul_.Scalar,
    aten.div.Scalar,
    aten.div_.Scalar,
    aten.neg.default,
    aten.neg_.default,
    aten.clone.default,
    aten.positive.default,
}


# Max/min of pieces and replicated values: max_i max(a_i, b) = max(max_i a_i, b)
# (fmax/fmin too: they differ from maximum/minimum only where a value is NaN).
_EXTREMUM = {aten.maximum.default: "max", aten.minimum.default: "min",
             aten.fmax.default: "max", aten.fmin.default: "min",
             aten.clamp_min.Tensor: "max", aten.clamp_max.Tensor: "min"}
# Monotone non-decreasing in their one tensor operand: f(max_i a_i) = max_i f(a_i)
# (and min), so Partial("max")/Partial("min") pieces pass through.
_MONOTONE = {
    aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default,
    aten.relu.default, aten.exp.default, aten.sigmoid.default, aten.tanh.default,
    aten.floor.default, aten.ceil.default, aten.trunc.default,
}


def _partial_inputs(func, specs, axis: int) -> tuple[Placement, tuple[Placement, ...]] | None:
    """(output partial, each operand's placement) where the op keeps a
    ``Partial`` operand on mesh ``axis`` partial; None where it must be reduced.

    Kept as in PyTorch: ``add``/``sub`` of pieces of one linear kind and
    replicated values (the replicated value becomes a piece: the value on one
    coordinate, zeros elsewhere; local), ``mul``/``div`` of one piece by
    replicated values (a second partial factor is reduced: one all-reduce,
    not two), scaling ops, and ``maximum``/``minimum`` of ``Partial("max")``/
    ``Partial("min")`` pieces with replicated values (other partials reduced).
    """
    kinds = [s.placements[axis] for s in specs]
    if any(isinstance(p, Shard) for p in kinds):
        return None
    partial = [p for p in kinds if isinstance(p, Partial)]
    if func in _MONOTONE:
        if len(kinds) == 1 and kinds[0] in (Partial("max"), Partial("min")):
            return kinds[0], (kinds[0],)
        return None
    if func in _EXTREMUM:
        keep = Partial(_EXTREMUM[func])
        if keep not in partial:
            return None
        return keep, tuple(keep if p == keep else Replicate() for p in kinds)
    if not all(p.is_linear for p in partial):
        return None
    if func in _SCALING:
        if isinstance(kinds[0], Partial) and all(isinstance(p, Replicate) for p in kinds[1:]):
            return kinds[0], tuple(kinds)
        return None
    if func in _ADDITIVE:
        # NOTE: ``other`` may be a Python number (x + 1): adding it to every
        # piece of a partial sum would count it once per piece.
        if len(specs) != 2 or len(set(partial)) != 1:
            return None
        return partial[0], (partial[0], partial[0])
    if func in _MULTIPLICATIVE:
        # The numerator of a division; else the first partial factor, or out
        # of place the largest (the others are reduced: the fewest elements).
        first = 0 if func in (aten.div.Tensor, aten.div_.Tensor) else kinds.index(partial[0])
        if func == aten.mul.Tensor:
            first = max((i for i, p in enumerate(kinds) if isinstance(p, Partial)),
                        key=lambda i: (math.prod(specs[i].shape), -i))
        if not isinstance(kinds[first], Partial):
            return None
        return kinds[first], tuple(p if i == first else Replicate() for i, p in enumerate(kinds))
    return None


def _moved(specs, axis: int, choice: Shard, shape) -> int:
    """Bytes of the operands whose shard on mesh ``axis`` is not ``choice``
    (mapped through broadcasting): the ones a redistribute must move."""
    return sum(math.prod(s.shape) * s.dtype.itemsize for s in specs
               if isinstance(s.placements[axis], Shard)
               and s.placements[axis] != shard_through_broadcast(choice, s.shape, shape))


def pointwise_rule(call):
    specs = call.specs
    func = call.func
    if not specs:
        return None
    shape = broadcast_shape(*(s.shape for s in specs))
    ndim = len(shape)
    mesh_ndim = specs[0].mesh.ndim
    inplace = writes_self(func)

    def out_dim(s, d: int) -> int | None:
        """Output dim of input dim ``d``, or None where it is broadcast."""
        od = d + ndim - s.ndim
        if s.shape[d] == 1 and shape[od] != 1:
            return None
        return od

    out: list[Placement] = []
    partial_inputs: dict[int, tuple[Placement, ...]] = {}  # axis -> operands' placements
    for axis in range(mesh_ndim):
        kinds = [s.placements[axis] for s in specs]
        choice: Placement = Replicate()
        kept = _partial_inputs(func, specs, axis) if any(
            isinstance(p, Partial) for p in kinds) else None
        if kept is not None:
            choice, partial_inputs[axis] = kept
        else:
            options = []
            for s in specs[:1] if inplace else specs:
                p = s.placements[axis]
                if isinstance(p, Shard):
                    od = out_dim(s, p.dim)
                    # A dim already sharded on earlier axes may be sharded
                    # again (nested) only where this operand nests it the
                    # same way: then it moves nothing; from another operand
                    # the nesting would reshuffle blocks.
                    if od is not None and all(
                        s.placements[e] == Shard(p.dim)
                        for e, q in enumerate(out) if isinstance(q, Shard) and q.dim == od
                    ):
                        options.append(Shard(od))
            if options:  # the shard that moves the fewest operand bytes (lowest dim of equals)
                choice = min(options, key=lambda c: (_moved(specs, axis, c, shape), c.dim))
        out.append(choice)

    # Operands take the output's shards (nested ones in mesh-axis order);
    # one that lacks them is redistributed.
    inputs = []
    for i, s in enumerate(specs):
        want = []
        for axis, choice in enumerate(out):
            if isinstance(choice, Shard):
                want.append(shard_through_broadcast(choice, s.shape, shape))
            elif isinstance(choice, Partial):
                want.append(partial_inputs[axis][i])
            else:
                want.append(Replicate())
        inputs.append(tuple(want))
    if inplace and (inputs[0] != specs[0].placements or tuple(out) != specs[0].placements):
        return None  # self would need a new layout: compute replicated, write back
    n = len(func._schema.returns)
    return Sharding(tuple(inputs), (tuple(out),) * n, shapes=(shape,) * n)


def glu_rule(call):
    """``glu(x, dim)`` = ``a * sigmoid(b)`` of ``x``'s halves along ``dim``
    (and ``glu_backward(grad, x, dim)``): point-wise in every other dim, so
    shards of other dims stay and the output keeps them, nothing sent (the
    fallback gathered the input: twice the output's bytes). ``dim`` must be
    whole on each rank: its element ``i`` pairs with ``i + n/2``, which a cut
    puts on another rank. Partial values are reduced first (not linear).
    Operands take ``x``'s shards, else the gradient's (same dims, and the
    same sizes off ``dim``)."""
    specs = call.specs
    x = specs[-1]
    if any(s.ndim != x.ndim or s.mesh != x.mesh for s in specs):
        return None
    dim = bind(call)["dim"] % max(x.ndim, 1)
    want: list[Placement] = []
    for axis in range(x.mesh.ndim):
        cuts = [s.placements[axis] for s in reversed(specs)]
        cuts = [p for p in cuts if isinstance(p, Shard) and p.dim != dim]
        want.append(cuts[0] if cuts else Replicate())
    want = tuple(want)
    return Sharding((want,) * len(specs), (want,))


# Pointwise ops that torch does not tag pointwise (``log_sigmoid_forward``:
# the value and a same-shaped buffer, under ``F.logsigmoid`` and
# ``multilabel_soft_margin_loss``).
RULES: dict = {aten.rsub.Tensor: pointwise_rule,
               aten.glu.default: glu_rule,
               aten.glu_backward.default: glu_rule,
               aten.log_sigmoid_forward.default: pointwise_rule}
