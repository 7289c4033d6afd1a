"""A table of ops with their single-device reference, for property tests.

Each ``OpCase`` row applies the same Python function to DTensors and to plain
tensors (the single-device reference), and says which inputs it takes:
``shapes(draw_shape)`` returns the input shapes, ``dtypes`` the dtypes it is
defined for. ``reduction`` rows get looser float tolerances (a sum over
shards rounds in a different order).

Example:
    >>> case = OPS_BY_NAME["sum_dim0"]
    >>> case.fn(torch.ones(3, 2))
    tensor([3., 3.])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from hypothesis import strategies as st

from dtensor.placement import Partial
from dtensor.testing.strategies import (
    DTYPES,
    FILLS,
    dtypes,
    placements,
    tensor_shapes,
    tensors,
)

__all__ = ["FAMILIES", "OPS", "OPS_BY_NAME", "OpCase", "draw_op", "op_tolerances",
           "reference"]

FAMILIES = ("pointwise", "reduction", "matmul", "view")

_FLOAT = (torch.float32, torch.float64, torch.bfloat16)
_NUMERIC = (*_FLOAT, torch.int64)


class OpCase(NamedTuple):
    """One op: ``fn(*inputs)`` on DTensors must equal ``fn`` on full tensors."""

    name: str
    family: str  # pointwise | reduction | matmul | view
    fn: Callable[..., Any]
    shapes: st.SearchStrategy[tuple[tuple[int, ...], ...]]
    dtypes: tuple[torch.dtype, ...] = DTYPES

    def __repr__(self) -> str:  # rank-independent (no function addresses)
        return f"OpCase({self.name!r})"


def _one(min_dims: int = 0, max_dims: int = 3) -> st.SearchStrategy:
    return tensor_shapes(min_dims=min_dims, max_dims=max_dims).map(lambda s: (s,))


def _same_two(min_dims: int = 0) -> st.SearchStrategy:
    return tensor_shapes(min_dims=min_dims).map(lambda s: (s, s))


_side = st.integers(0, 5)
_mm = st.tuples(_side, _side, _side).map(lambda t: ((t[0], t[1]), (t[1], t[2])))
_bmm = st.tuples(_side, _side, _side, _side).map(
    lambda t: ((t[0], t[1], t[2]), (t[0], t[2], t[3])))
_mv = st.tuples(_side, _side).map(lambda t: ((t[0], t[1]), (t[1],)))
_dot = _side.map(lambda n: ((n,), (n,)))


OPS: tuple[OpCase, ...] = (
    # pointwise
    OpCase("add_scalar", "pointwise", lambda x: x + 1, _one(), _NUMERIC),
    OpCase("mul_scalar", "pointwise", lambda x: x * 3, _one(), _NUMERIC),
    OpCase("neg", "pointwise", lambda x: -x, _one(), _NUMERIC),
    OpCase("abs", "pointwise", torch.abs, _one(), _NUMERIC),
    OpCase("exp", "pointwise", torch.exp, _one(), (torch.float32, torch.float64)),
    OpCase("logical_not", "pointwise", torch.logical_not, _one()),
    OpCase("add", "pointwise", torch.add, _same_two(), _NUMERIC),
    OpCase("mul", "pointwise", torch.mul, _same_two()),
    OpCase("sub", "pointwise", torch.sub, _same_two(), _NUMERIC),
    OpCase("maximum", "pointwise", torch.maximum, _same_two(), _NUMERIC),
    OpCase("eq", "pointwise", torch.eq, _same_two()),
    OpCase("to_float64", "pointwise", lambda x: x.to(torch.float64), _one()),
    # reductions
    OpCase("sum", "reduction", lambda x: x.sum(), _one(), _NUMERIC),
    OpCase("sum_dim0", "reduction", lambda x: x.sum(0), _one(1), _NUMERIC),
    OpCase("sum_last_keepdim", "reduction", lambda x: x.sum(-1, keepdim=True), _one(1),
           _NUMERIC),
    OpCase("mean", "reduction", lambda x: x.mean(), _one(), _FLOAT),
    OpCase("mean_dim0", "reduction", lambda x: x.mean(0), _one(1), _FLOAT),
    OpCase("amax_dim0", "reduction", lambda x: x.amax(0), _one(1), _NUMERIC),
    OpCase("amin_last", "reduction", lambda x: x.amin(-1), _one(1), _NUMERIC),
    OpCase("any", "reduction", lambda x: x.any(), _one()),
    # matmul family
    OpCase("mm", "matmul", torch.mm, _mm, _NUMERIC),
    OpCase("bmm", "matmul", torch.bmm, _bmm, _NUMERIC),
    OpCase("matmul_mv", "matmul", torch.matmul, _mv, _NUMERIC),
    OpCase("dot", "matmul", torch.dot, _dot, _NUMERIC),
    # views
    OpCase("view_flat", "view", lambda x: x.view(-1), _one()),
    OpCase("reshape_flat", "view", lambda x: x.reshape(-1), _one()),
    OpCase("flatten", "view", torch.flatten, _one()),
    OpCase("transpose", "view", lambda x: x.transpose(0, -1), _one(1)),
    OpCase("permute_rev", "view", lambda x: x.permute(tuple(reversed(range(x.ndim)))), _one()),
    OpCase("t", "view", torch.t, _one(0, 2)),
    OpCase("unsqueeze0", "view", lambda x: x.unsqueeze(0), _one()),
    OpCase("squeeze", "view", torch.squeeze, _one()),
    OpCase("select0", "view", lambda x: x[0], _one(1)),
    OpCase("narrow_last", "view", lambda x: x.narrow(-1, 0, x.shape[-1] // 2), _one(1)),
    OpCase("clone", "view", torch.clone, _one()),
    OpCase("contiguous_t", "view", lambda x: x.transpose(0, -1).contiguous(), _one(1)),
)

OPS_BY_NAME = {case.name: case for case in OPS}


def op_tolerances(case: OpCase, dtype: torch.dtype) -> dict[str, float]:
    """rtol/atol for comparing ``case``'s result (empty: the dtype defaults)."""
    if case.family not in ("reduction", "matmul"):
        return {}
    return {
        torch.float32: {"rtol": 1e-4, "atol": 1e-4},
        torch.float64: {"rtol": 1e-9, "atol": 1e-9},
        torch.bfloat16: {"rtol": 3e-2, "atol": 0.5},
    }.get(dtype, {})


class DrawnOp(NamedTuple):
    case: OpCase
    dtype: torch.dtype
    inputs: list[torch.Tensor]  # global (single-device) inputs
    placements: list[tuple]  # dtensor placements per input


def draw_op(data: Any, *, mesh_ndim: int, family: str | None = None,
            case: OpCase | None = None, mixed_reduce_ops: bool = True,
            nonfinite_with_partial: bool = False) -> DrawnOp:
    """Draw (with ``st.data()``) inputs and placements for ``case``, or for an
    op drawn from ``family``.

    Non-finite values (the ``special`` fill) are drawn only when no input is
    ``Partial``, unless ``nonfinite_with_partial``: a ``Partial(sum)`` piece
    of 0 times ``inf`` is ``nan``, so linear propagation through ``Partial``
    holds for finite values only (a known limitation, tested separately).
    """
    if case is None:
        if family not in FAMILIES:
            raise ValueError(f"draw_op: family={family!r} must be one of {FAMILIES}")
        case = data.draw(st.sampled_from([c for c in OPS if c.family == family]))
    shapes = data.draw(case.shapes)
    dtype = data.draw(dtypes(include=case.dtypes))
    pls = [data.draw(placements(mesh_ndim=mesh_ndim, tensor_ndim=len(s),
                                mixed_reduce_ops=mixed_reduce_ops)) for s in shapes]
    partial = any(isinstance(p, Partial) for ps in pls for p in ps)
    fills = FILLS if nonfinite_with_partial or not partial else FILLS[:-1]
    xs = [data.draw(tensors(shape=s, dtype=dtype, fills=fills)) for s in shapes]
    return DrawnOp(case, dtype, xs, pls)


def reference(case: OpCase, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The single-device result; rejects the example (``assume``) where the op
    is undefined on a single device (e.g. ``amax`` over an empty dim)."""
    from hypothesis import assume

    try:
        return case.fn(*inputs)
    except (RuntimeError, IndexError, ValueError):
        assume(False)
        raise
