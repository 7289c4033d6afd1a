"""Pointwise ops: unary, binary, ternary, with broadcasting and in-place forms.

The output keeps the first input's shards (mapped through broadcasting), so
elementwise ops on identically placed operands never communicate. Partial
operands survive only through linear ops (``neg``, ``add``/``sub`` of partial
sums, ``mul``/``div`` of one partial operand by replicated values); any other
op sees them reduced first.
"""

from __future__ import annotations

import torch

from dtensor.placement import Partial, Placement, Replicate, Shard
from dtensor.rules._util import broadcast_shape, shard_through_broadcast
from dtensor.sharding import Sharding, writes_self

__all__ = ["RULES", "pointwise_rule"]

aten = torch.ops.aten

# Linear in each operand, so partial sums may be combined without reducing.
_ADDITIVE = {aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor}
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


def _partial_ok(func, specs, axis: int) -> bool:
    kinds = [s.placements[axis] for s in specs]
    partial = [p for p in kinds if isinstance(p, Partial)]
    if not all(p.is_linear for p in partial):
        return False
    if func in _SCALING:
        return len(specs) == 1 or all(isinstance(p, Replicate) for p in kinds[1:])
    if func in _ADDITIVE:
        # NOTE: ``other`` may be a Python number (x + 1): adding it to every
        # piece of a partial sum would count it once per piece.
        return len(specs) == 2 and len(set(kinds)) == 1
    if func in _MULTIPLICATIVE:
        if len(partial) != 1:
            return False
        if func in (aten.div.Tensor, aten.div_.Tensor) and not isinstance(kinds[0], Partial):
            return False
        return all(isinstance(p, (Partial, Replicate)) for p in kinds)
    return False


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
    for axis in range(mesh_ndim):
        kinds = [s.placements[axis] for s in specs]
        choice: Placement = Replicate()
        if any(isinstance(p, Partial) for p in kinds) and _partial_ok(func, specs, axis):
            choice = next(p for p in kinds if isinstance(p, Partial))
        else:
            candidates = specs[:1] if inplace else specs
            for s in candidates:
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
                        choice = Shard(od)
                        break
        out.append(choice)

    # Operands take the output's shards (nested ones in mesh-axis order);
    # one that lacks them is redistributed.
    inputs = []
    for s in specs:
        want = []
        for axis, choice in enumerate(out):
            if isinstance(choice, Shard):
                want.append(shard_through_broadcast(choice, s.shape, shape))
            elif isinstance(choice, Partial):
                p = s.placements[axis]
                want.append(p if isinstance(p, Partial) else Replicate())
            else:
                want.append(Replicate())
        inputs.append(tuple(want))
    if inplace and (inputs[0] != specs[0].placements or tuple(out) != specs[0].placements):
        return None  # self would need a new layout: compute replicated, write back
    n = len(func._schema.returns)
    return Sharding(tuple(inputs), (tuple(out),) * n, shapes=(shape,) * n)


RULES: dict = {}
