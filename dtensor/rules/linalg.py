"""Batched linear algebra: ops that work on the last one or two dims of each
operand (the matrix, or a vector of Householder scalars) and treat every
leading (batch) index apart, so a shard of a batch dim stays where it is
and nothing is sent: ``linalg_householder_product``, ``cholesky_inverse``,
``linalg_matrix_exp`` (as PyTorch's DTensor does). Not ops that raise on
some values (``cholesky`` of a matrix that is not positive-definite): a
rank whose block raises alone would leave the others waiting; replicated,
every rank raises alike.

Per mesh axis the rule picks the cheapest of: every operand replicated, or
every operand cut alike on one batch dim (the output too). A shard an
operand lacks costs a slice if it is replicated, else a gather (or a
reduction of pieces, which none of these is linear in). A batch shard the
matrix operand did not already hold also counts gathering the output later:
slicing a replicated matrix to cut the output moves more than gathering a
small operand (``householder_product`` of a replicated matrix and a cut
``tau``). A batch dim shorter than the mesh axis is never cut: some ranks
would hold nothing, and the output's gather would move all of it.
Example: ``householder_product(A, tau)`` with both ``Shard(0)`` returns
``Shard(0)``, with no collective.
"""

from __future__ import annotations

import math

import torch

from dtensor.placement import Replicate, Shard
from dtensor.sharding import Sharding

__all__ = ["RULES"]

aten = torch.ops.aten


def _move(p, want, numel: int) -> float:
    if p == want:
        return 0.0
    if isinstance(p, Replicate):
        return 0.01 * numel  # a slice
    return float(numel)  # a gather, or reducing pieces


def batched_rule(trailing: tuple[int, ...]):
    """Rule for an op whose operand ``i`` has ``trailing[i]`` non-batch dims
    after batch dims shared by every operand, and one output shaped as
    operand 0."""

    def rule(call):
        specs = call.specs
        if len(specs) != len(trailing) or any(s is None for s in specs):
            return None
        batch = specs[0].shape[: specs[0].ndim - trailing[0]]
        if any(s.ndim != len(batch) + t or tuple(s.shape[: len(batch)]) != tuple(batch)
               for s, t in zip(specs, trailing, strict=True)):
            return None  # batch dims broadcast, or a malformed call: replicate
        sizes = [math.prod(s.shape) for s in specs]
        n_out = sizes[0]
        want = []
        for axis in range(specs[0].mesh.ndim):
            ranks = specs[0].mesh.size(axis)
            best = (sum(_move(s.placements[axis], Replicate(), n)
                        for s, n in zip(specs, sizes, strict=True)), Replicate())
            for d in range(len(batch)):
                if batch[d] < ranks:
                    continue
                c = sum(_move(s.placements[axis], Shard(d), n)
                        for s, n in zip(specs, sizes, strict=True))
                if specs[0].placements[axis] != Shard(d):
                    c += n_out  # the output's gather later
                if c < best[0]:
                    best = (c, Shard(d))
            want.append(best[1])
        want = tuple(want)
        return Sharding((want,) * len(specs), (want,))

    return rule


RULES: dict = {
    aten.linalg_householder_product.default: batched_rule((2, 1)),
    aten.cholesky_inverse.default: batched_rule((2,)),
    aten.linalg_matrix_exp.default: batched_rule((2,)),
}
