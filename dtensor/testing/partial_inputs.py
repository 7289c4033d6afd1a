"""Partial inputs as users meet them: random pieces whose reduction is the value.

``distribute_tensor(x, mesh, [Partial()])`` makes one canonical layout (the
value on one coordinate and zeros elsewhere, or the value everywhere), and
many wrong rules for Partial inputs are right on it: a rule keeping a
``Partial(sum)`` through ``relu`` passes when every other piece is zero. Real
Partial tensors (a row-parallel matmul's output, a gradient before its
reduce) hold arbitrary pieces. Here, per ``Partial`` mesh axis:

- ``sum``: random pieces on every coordinate but a drawn holder, which holds
  the value minus their sum;
- ``avg``: the value plus random offsets that sum to zero over the axis;
- ``max`` / ``min``: the value minus (plus) random non-negative offsets, zero
  at each element's holder: the drawn coordinate shifted by a random amount
  per element, so two operands (each with its own seed) rarely hold their
  extremes on the same rank and a rule adding max pieces elementwise shows.

Offsets depend on (seed, mesh axis, coordinate on that axis, global index)
only, so pieces over several Partial axes, with mixed reduce ops too, reduce
to the value in any order of the axes. Integer-valued data gets integer
offsets (exact in every dtype); other floats get random float offsets,
except in 16-bit floats, where a sum or mean of pieces would round: there
the holder keeps the value (``sum``: zeros elsewhere; ``avg``: the value
everywhere). Bool pieces are random subsets (``sum``/``max``) or supersets
(``min``) of the value.

Example:
    >>> split = PartialSplit(holders=(1,), seed=7)
    >>> dt = from_pieces(get_impl("dtensor"), x, mesh, [Partial("sum")], split)
    >>> # rank 0 holds random numbers, rank 1 holds x minus them
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from dtensor.placement import Partial, Placement
from dtensor.testing.impl import exact_split
from dtensor.testing.oracle import reference_block

__all__ = ["PartialSplit", "from_pieces", "partial_splits", "piece"]


@dataclass(frozen=True, slots=True)
class PartialSplit:
    """Which coordinate holds the value on each mesh axis, and the offsets' seed."""

    holders: tuple[int, ...]
    seed: int

    def __repr__(self) -> str:
        return f"PartialSplit(holders={self.holders}, seed={self.seed})"

    def for_operand(self, k: int) -> PartialSplit:
        """The split of an op's ``k``-th tensor operand (its own offsets)."""
        return self if k == 0 else PartialSplit(self.holders, self.seed + 7919 * k)


def partial_splits(*, mesh_ndim: int, max_holder: int = 3
                   ) -> st.SearchStrategy[PartialSplit]:
    """Splits for a ``mesh_ndim``-D mesh; shrinks towards holder 0 and seed 0
    (a holder past an axis' size wraps around)."""
    holder = st.integers(0, max_holder)
    return st.builds(PartialSplit, st.tuples(*[holder] * mesh_ndim),
                     st.integers(0, 2**16))


def _offsets(shape, dtype, n: int, seed: int, axis: int, exact: bool) -> torch.Tensor:
    """``n`` offset tensors of ``shape`` (float64, or int64 when ``exact``)."""
    g = torch.Generator().manual_seed(seed * 131 + axis)
    if exact:
        return torch.randint(-3, 4, (n, *shape), generator=g)
    return torch.randn((n, *shape), generator=g, dtype=torch.float64)


def _split_axis(v: torch.Tensor, op: str, n: int, c: int, holder: int, seed: int,
                axis: int, exact: bool) -> torch.Tensor:
    """Coordinate ``c``'s piece (of ``n`` on ``axis``) of global value ``v``."""
    h = holder % n
    if op in ("max", "min"):
        g = torch.Generator().manual_seed(seed * 131 + axis + 65)
        held = (torch.randint(0, n, v.shape, generator=g) + h) % n == c
    if v.dtype == torch.bool:
        g = torch.Generator().manual_seed(seed * 131 + axis)
        mask = torch.rand((n, *v.shape), generator=g) < 0.5
        if op == "avg" or (op == "sum" and c == h):
            return v
        if op == "min":
            return torch.where(held, v, v | mask[c])
        return torch.where(held, v, v & mask[c]) if op == "max" else v & mask[c]
    low = v.dtype in (torch.float16, torch.bfloat16) and not exact
    if low and op in ("sum", "avg"):
        return v if c == h or op == "avg" else torch.zeros_like(v)
    d = _offsets(v.shape, v.dtype, n, seed, axis, exact)
    wide = v.to(torch.float64) if v.is_floating_point() else v.to(torch.int64)
    if op in ("max", "min"):
        off = torch.where(held, 0, d[c].abs())
        out = wide - off if op == "max" else wide + off
    else:
        others = d.sum(0) - d[h]
        if op == "sum":
            out = wide - others if c == h else d[c].to(wide.dtype).expand_as(wide)
        elif op == "avg":
            out = wide - others if c == h else wide + d[c]
        else:
            raise ValueError(f"partial pieces: unknown reduce op {op!r}; expected "
                             "one of sum, avg, max, min")
    return out.to(v.dtype)


def piece(x: torch.Tensor, mesh_shape: Sequence[int], placements: Sequence[Placement],
          coordinate: Sequence[int] | None, split: PartialSplit, *,
          exact: bool | None = None) -> torch.Tensor:
    """The local block of ``x`` at ``coordinate`` under ``placements``, with
    ``Partial`` axes split into random pieces (see the module docstring).

    ``exact`` (default ``exact_split(x)``) picks integer offsets; pass one
    value for every operand of an op so pieces of different kinds never mix.
    """
    if coordinate is None:  # outside the mesh: nothing
        return torch.empty(tuple(0 for _ in x.shape) or (0,), dtype=x.dtype)
    idx = reference_block(tuple(x.shape), tuple(mesh_shape), tuple(placements),
                          tuple(coordinate))
    exact = exact_split(x) if exact is None else exact
    v = x.detach()
    for axis, p in enumerate(placements):
        if isinstance(p, Partial):
            holder = split.holders[axis] if axis < len(split.holders) else 0
            v = _split_axis(v, p.reduce_op, mesh_shape[axis], coordinate[axis], holder,
                            split.seed, axis, exact)
    for d, i in enumerate(idx):
        v = v.index_select(d, i)
    return v.contiguous()


def from_pieces(impl: Any, x: torch.Tensor, mesh: Any, placements: Sequence[Placement],
                split: PartialSplit, *, exact: bool | None = None) -> Any:
    """A DTensor of ``impl`` holding ``x`` under ``placements`` (dtensor's
    placement values), built from this rank's block with random Partial pieces
    (``from_local``, independent of the runtime's redistribute)."""
    coord = mesh.get_coordinate()
    coord = None if coord is None else tuple(int(c) for c in coord)
    local = piece(x, tuple(mesh.shape), placements, coord, split, exact=exact)
    if coord is None:
        from dtensor.spec import local_block

        shape, _ = local_block(x.shape, tuple(mesh.shape), tuple(placements), None)
        local = torch.empty(shape, dtype=x.dtype)
    return impl.DTensor.from_local(
        local, mesh, impl.placements(placements), shape=tuple(x.shape),
        stride=x.stride() if x.is_contiguous() else None,
    )
