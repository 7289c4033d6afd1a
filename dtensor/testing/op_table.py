"""The op table: ops with their single-device reference.

Each ``OpCase`` row applies the same Python function to DTensors and to plain
tensors (the single-device reference), and says which inputs it takes:
``shapes`` draws the input shapes for the property suite (``OPS``: the rows
that have one), ``example`` gives fixed shapes for tests/test_ops_dist.py,
``dtypes`` the dtypes it is defined for. ``reduction`` rows get looser float
tolerances (a sum over shards rounds in a different order).

Example:
    >>> case = OPS_BY_NAME["sum_dim0"]
    >>> case.fn(torch.ones(3, 2))
    tensor([3., 3.])
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
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

__all__ = ["FAMILIES", "OPS", "OPS_BY_NAME", "TABLE", "OpCase", "draw_op",
           "op_tolerances", "reference"]

#: Families the property suite draws from (every one has rows in ``OPS``).
FAMILIES = ("pointwise", "reduction", "matmul", "view")

_FLOAT = (torch.float32, torch.float64, torch.bfloat16)
_NUMERIC = (*_FLOAT, torch.int64)


class OpCase(NamedTuple):
    """One op: ``fn(*inputs)`` on DTensors must equal ``fn`` on full tensors.

    ``shapes``: a strategy for the input shapes (None: the row is not in the
    property suite); ``example``: fixed input shapes for the distributed op
    test (None: not in it); ``partial``: floating inputs may be ``Partial``.
    """

    name: str
    family: str  # pointwise | reduction | matmul | view | inplace | nn | creation
    fn: Callable[..., Any]
    shapes: st.SearchStrategy[tuple[tuple[int, ...], ...]] | None
    dtypes: tuple[torch.dtype, ...] = DTYPES
    example: tuple[tuple[int, ...], ...] | None = None
    partial: bool = True

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

_A = ((5, 3),)  # the usual example: one 5 x 3 input (uneven on 2 and 4 ranks)
_AB = ((5, 3), (5, 3))
_T = torch.tensor  # index and target tensors built inside the rows
_TARGET = [0, 2, 1, 1, 0]


def _index_from(values, n: int):
    """Indices in [0, n) made from float ``values`` (any fill, NaN and inf
    included), so an index can be drawn, and placed, like any input."""
    return (values.nan_to_num(0.0, 0.0, 0.0).abs().clamp(max=1e6) * 7).to(torch.int64) % max(n, 1)


def _row(name, family, fn, example, *, partial=True):
    """A row of the distributed op test only (fixed shapes, float32)."""
    return OpCase(name, family, fn, None, (torch.float32,), example, partial)


#: The one op table: rows with ``shapes`` run in the property suite
#: (``OPS``), rows with an ``example`` in tests/test_ops_dist.py.
TABLE: tuple[OpCase, ...] = (
    # pointwise: unary, binary with broadcasting/type promotion, ternary, scalars
    OpCase("add_scalar", "pointwise", lambda x: x + 1, _one(), _NUMERIC, _A),
    OpCase("mul_scalar", "pointwise", lambda x: x * 3, _one(), _NUMERIC, _A),
    OpCase("neg", "pointwise", lambda x: -x, _one(), _NUMERIC, _A),
    OpCase("abs", "pointwise", torch.abs, _one(), _NUMERIC, _A),
    OpCase("exp", "pointwise", torch.exp, _one(), (torch.float32, torch.float64), _A),
    OpCase("logical_not", "pointwise", torch.logical_not, _one(), DTYPES, _A),
    OpCase("add", "pointwise", torch.add, _same_two(), _NUMERIC, _AB),
    OpCase("mul", "pointwise", torch.mul, _same_two(), DTYPES, _AB),
    OpCase("sub", "pointwise", torch.sub, _same_two(), _NUMERIC, _AB),
    OpCase("maximum", "pointwise", torch.maximum, _same_two(), _NUMERIC, _AB),
    OpCase("eq", "pointwise", torch.eq, _same_two(), DTYPES, _AB),
    OpCase("to_float64", "pointwise", lambda x: x.to(torch.float64), _one(), DTYPES, _A),
    _row("relu", "pointwise", torch.relu, ((4, 3),)),
    _row("gelu", "pointwise", F.gelu, ((4, 3),)),
    _row("add_bcast", "pointwise", torch.add, ((5, 3), (3,))),
    _row("add_bcast_col", "pointwise", torch.add, ((5, 3), (5, 1))),
    _row("sub_alpha", "pointwise", lambda a, b: torch.sub(a, b, alpha=2), ((4, 4), (4, 4))),
    _row("div", "pointwise", torch.div, ((5, 3), (1, 3))),
    _row("mul_scalar_add", "pointwise", lambda a: a * 2.5 + 1, _A),
    _row("int_promote", "pointwise", lambda a: a.to(torch.int64) + 1.5, _A, partial=False),
    _row("where", "pointwise", lambda c, a, b: torch.where(c > 0, a, b),
         ((5, 3), (5, 3), (3,))),
    _row("addcmul", "pointwise", torch.addcmul, ((4, 3), (4, 3), (4, 3))),
    _row("lerp", "pointwise", lambda a, b: torch.lerp(a, b, 0.3), ((4, 3), (4, 3))),
    _row("zero_d_plain", "pointwise", lambda a: a * torch.tensor(3.0), _A),
    _row("comparison", "pointwise", lambda a, b: a < b, _AB),
    _row("masked_fill", "pointwise", lambda a: a.masked_fill(a > 0, 0.5), _A),
    _row("clamp", "pointwise", lambda a: a.clamp(-0.5, 0.5), _A),
    _row("masked_fill_t", "pointwise", lambda a: a.masked_fill(a > 0, _T(0.5)), _A),
    # in-place and out=
    _row("add_", "inplace", lambda a, b: a.add_(b), _AB),
    _row("mul_", "inplace", lambda a, b: a.mul_(b), ((5, 3), (3,))),
    _row("copy_", "inplace", lambda a, b: a.copy_(b), _AB),
    _row("copy_bcast", "inplace", lambda a, b: a.copy_(b), ((5, 3), (3,))),
    _row("add_out", "inplace", lambda a, b, o: (torch.add(a, b, out=o), o)[1],
         ((5, 3), (5, 3), (5, 3))),
    _row("fill_", "inplace", lambda a: a.fill_(2.0), _A),
    _row("zero_", "inplace", lambda a: a.zero_(), _A),
    _row("masked_fill_", "inplace", lambda a: a.masked_fill_(a > 0, _T(0.5)), _A),
    # reductions
    OpCase("sum", "reduction", lambda x: x.sum(), _one(), _NUMERIC, _A),
    OpCase("sum_dim0", "reduction", lambda x: x.sum(0), _one(1), _NUMERIC, _A),
    OpCase("sum_last_keepdim", "reduction", lambda x: x.sum(-1, keepdim=True), _one(1),
           _NUMERIC, _A),
    OpCase("mean", "reduction", lambda x: x.mean(), _one(), _FLOAT, _A),
    OpCase("mean_dim0", "reduction", lambda x: x.mean(0), _one(1), _FLOAT, _A),
    OpCase("amax_dim0", "reduction", lambda x: x.amax(0), _one(1), _NUMERIC, _A),
    OpCase("amin_last", "reduction", lambda x: x.amin(-1), _one(1), _NUMERIC, _A),
    # Values with an index: a tie between ranks along a sharded dim must go
    # to the first index, as on one device (the small and int fills tie often).
    OpCase("max_dim0_indices", "reduction", lambda x: x.max(0).indices, _one(1), _NUMERIC, _A),
    OpCase("argmin_last", "reduction", lambda x: x.argmin(-1), _one(1), _NUMERIC, _A),
    OpCase("any", "reduction", lambda x: x.any(), _one(), DTYPES, _A),
    _row("sum0", "reduction", lambda a: a.sum(0), _A),
    _row("sum_dims", "reduction", lambda a: a.sum((0, 2)), ((3, 4, 5),)),
    _row("mean1", "reduction", lambda a: a.mean(-1, keepdim=True), ((3, 5),)),
    _row("prod", "reduction", lambda a: a.prod(1), _A),
    _row("amin_all", "reduction", lambda a: a.amin(), _A),
    _row("max_dim", "reduction", lambda a: tuple(a.max(0)), _A),
    _row("min_dim", "reduction", lambda a: tuple(a.min(1, keepdim=True)), _A),
    _row("max_all", "reduction", torch.max, _A),
    _row("argmax", "reduction", lambda a: a.argmax(0), _A),
    _row("argmin_all", "reduction", lambda a: a.argmin(), _A),
    _row("norm", "reduction", lambda a: a.norm(), _A),
    _row("norm_dim", "reduction", lambda a: torch.linalg.vector_norm(a, 3, dim=1), _A),
    _row("var", "reduction", lambda a: a.var(0), _A),
    _row("std", "reduction", lambda a: a.std(1, correction=0), _A),
    _row("any_dim", "reduction", lambda a: (a > 1).any(0), _A),
    _row("all", "reduction", lambda a: (a > -3).all(), _A),
    _row("logsumexp", "reduction", lambda a: a.logsumexp(1), _A),
    _row("cumsum", "reduction", lambda a: a.cumsum(1), _A),
    _row("sort", "reduction", lambda a: tuple(a.sort(0)), _A),
    _row("topk", "reduction", lambda a: tuple(a.topk(2, 1)), _A),
    _row("sort_stable", "reduction", lambda a: tuple(a.sort(dim=1, stable=True)), _A),
    _row("prod_all", "reduction", lambda a: a.prod(), _A),
    _row("min_all", "reduction", lambda a: a.min(), _A),
    _row("all_dim", "reduction", lambda a: (a > -3).all(1), _A),
    _row("all_dims", "reduction", lambda a: torch.all(a > -3, dim=(0,)), _A),
    _row("any_dims", "reduction", lambda a: torch.any(a > 1, dim=(0, 1)), _A),
    _row("aminmax", "reduction", lambda a: tuple(torch.aminmax(a, dim=0)), _A),
    _row("count_nonzero", "reduction", lambda a: torch.count_nonzero(a > 0, dim=(0,)), _A),
    _row("nansum", "reduction", lambda a: a.nansum(0), _A),
    _row("var_mean", "reduction", lambda a: tuple(torch.var_mean(a, dim=1)), _A),
    _row("std_mean", "reduction", lambda a: tuple(torch.std_mean(a, dim=0)), _A),
    _row("cummax", "reduction", lambda a: tuple(a.cummax(1)), _A),
    _row("cummin", "reduction", lambda a: tuple(a.cummin(0)), _A),
    _row("cumprod", "reduction", lambda a: a.cumprod(1), _A),
    _row("logcumsumexp", "reduction", lambda a: a.logcumsumexp(1), _A),
    # matmul family
    OpCase("mm", "matmul", torch.mm, _mm, _NUMERIC, ((5, 4), (4, 3))),
    OpCase("bmm", "matmul", torch.bmm, _bmm, _NUMERIC, ((3, 5, 4), (3, 4, 2))),
    OpCase("matmul_mv", "matmul", torch.matmul, _mv, _NUMERIC, ((5, 4), (4,))),
    OpCase("dot", "matmul", torch.dot, _dot, _NUMERIC, ((5,), (5,))),
    _row("mm_same", "matmul", lambda a: torch.mm(a, a), ((4, 4),)),
    _row("addmm", "matmul", torch.addmm, ((3,), (5, 4), (4, 3))),
    _row("addmm_2d", "matmul", lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2),
         ((5, 3), (5, 4), (4, 3))),
    _row("baddbmm", "matmul", torch.baddbmm, ((3, 5, 2), (3, 5, 4), (3, 4, 2))),
    _row("matmul_3d_2d", "matmul", torch.matmul, ((2, 5, 4), (4, 3))),
    _row("linear", "matmul", F.linear, ((5, 4), (3, 4), (3,))),
    _row("mv", "matmul", torch.mv, ((5, 4), (4,))),
    _row("addmv", "matmul", torch.addmv, ((5,), (5, 4), (4,))),
    _row("addbmm", "matmul", torch.addbmm, ((5, 2), (3, 5, 4), (3, 4, 2))),
    _row("addr", "matmul", torch.addr, ((5, 3), (5,), (3,))),
    _row("einsum", "matmul", lambda a, b: torch.einsum("bij,bjk->bik", a, b),
         ((2, 3, 4), (2, 4, 5))),
    # views and shape ops
    OpCase("view_flat", "view", lambda x: x.view(-1), _one(), DTYPES, _A),
    OpCase("reshape_flat", "view", lambda x: x.reshape(-1), _one(), DTYPES, _A),
    OpCase("flatten", "view", torch.flatten, _one(), DTYPES, ((4, 3, 2),)),
    OpCase("transpose", "view", lambda x: x.transpose(0, -1), _one(1), DTYPES, _A),
    OpCase("permute_rev", "view", lambda x: x.permute(tuple(reversed(range(x.ndim)))),
           _one(), DTYPES, ((2, 3, 5),)),
    OpCase("t", "view", torch.t, _one(0, 2), DTYPES, _A),
    OpCase("unsqueeze0", "view", lambda x: x.unsqueeze(0), _one(), DTYPES, _A),
    OpCase("squeeze", "view", torch.squeeze, _one(), DTYPES, ((5, 1, 2),)),
    OpCase("select0", "view", lambda x: x[0], _one(1), DTYPES, _A),
    OpCase("narrow_last", "view", lambda x: x.narrow(-1, 0, x.shape[-1] // 2), _one(1),
           DTYPES, _A),
    OpCase("clone", "view", torch.clone, _one(), DTYPES, _A),
    OpCase("contiguous_t", "view", lambda x: x.transpose(0, -1).contiguous(), _one(1),
           DTYPES, _A),
    _row("view_merge", "view", lambda a: a.view(-1), ((4, 3),)),
    _row("view_merge_uneven", "view", lambda a: a.view(15), _A),
    _row("view_split", "view", lambda a: a.view(2, 3, 4), ((6, 4),)),
    _row("reshape", "view", lambda a: a.reshape(3, 2, 4), ((6, 4),)),
    _row("flatten1", "view", lambda a: a.flatten(1), ((4, 3, 2),)),
    _row("unflatten", "view", lambda a: a.unflatten(1, (2, 3)), ((4, 6),)),
    _row("permute", "view", lambda a: a.permute(2, 0, 1), ((2, 3, 5),)),
    _row("unsqueeze", "view", lambda a: a.unsqueeze(1), _A),
    _row("squeeze_dim", "view", lambda a: a.squeeze(0), ((2, 3),)),
    _row("squeeze_dims", "view", lambda a: a.squeeze((1,)), ((5, 1, 2),)),
    _row("expand", "view", lambda a: a.expand(2, 5, 3), _A),
    _row("expand_one", "view", lambda a: a.expand(4, 3), ((1, 3),)),
    _row("slice", "view", lambda a: a[1:4, ::2], _A),
    _row("slice_all", "view", lambda a: a[:, 1:], _A),
    _row("select_col", "view", lambda a: a[:, 1], _A),
    _row("narrow", "view", lambda a: a.narrow(1, 1, 2), _A),
    _row("split", "view", lambda a: a.split(2, 0), _A),
    _row("split_sizes", "view", lambda a: a.split([1, 2], 1), _A),
    _row("chunk", "view", lambda a: a.chunk(2, 1), ((5, 4),)),
    _row("unbind", "view", lambda a: a.unbind(1), _A),
    _row("cat", "view", lambda a, b: torch.cat([a, b], 0), ((5, 3), (2, 3))),
    _row("cat1", "view", lambda a, b: torch.cat([a, b], 1), ((5, 3), (5, 2))),
    _row("stack", "view", lambda a, b: torch.stack([a, b], 1), _AB),
    _row("index_select", "view", lambda a: a.index_select(0, _T([4, 0, 2])), _A),
    _row("gather", "view", lambda a: a.gather(1, _T([[0, 2]] * 5)), _A),
    # the index is a second drawn input with its own placements
    OpCase("gather_last_drawn_index", "view",
           lambda a, b: a.gather(-1, _index_from(b, a.shape[-1])), _same_two(1),
           (torch.float32,), _AB),
    OpCase("gather_dim0_drawn_index", "view",
           lambda a, b: a.gather(0, _index_from(b, a.shape[0])), _same_two(1),
           (torch.float32,), _AB),
    _row("flip", "view", lambda a: a.flip(0), _A),
    _row("roll", "view", lambda a: a.roll(1, 0), _A),
    _row("getitem_adv", "view", lambda a: a[_T([1, 3])], _A),
    _row("conj_view", "view", lambda a: torch.view_as_real(
        torch.view_as_complex(a).conj().resolve_conj()), ((5, 3, 2),)),
    _row("neg_view", "view", lambda a: torch.ops.aten._neg_view(a), _A),
    # constructors, copies, conversions
    _row("zeros_like", "creation", torch.zeros_like, _A),
    _row("ones_like", "creation", torch.ones_like, _A),
    _row("empty_like_shape", "creation", lambda a: torch.empty_like(a).shape, _A),
    _row("full_like", "creation", lambda a: torch.full_like(a, 7.0), _A),
    _row("new_zeros", "creation", lambda a: a.new_zeros(2, 2), _A),
    _row("new_empty_shape", "creation", lambda a: a.new_empty(2, 2).shape, _A),
    _row("new_empty_strided_shape", "creation",
         lambda a: a.new_empty_strided((2, 2), (2, 1)).shape, _A),
    _row("equal", "creation", lambda a: torch.equal(a, a * 1), _A),
    _row("new_ones", "creation", lambda a: a.new_ones(2, 2), _A),
    _row("new_full", "creation", lambda a: a.new_full((2, 2), 3.0), _A),
    _row("contiguous", "creation", lambda a: a.t().contiguous(), _A),
    _row("to_int", "creation", lambda a: (a * 3).to(torch.int32), _A),
    # nn
    _row("softmax", "nn", lambda a: a.softmax(1), _A),
    _row("log_softmax", "nn", lambda a: a.log_softmax(0), _A),
    _row("layer_norm", "nn", lambda a, w, b: F.layer_norm(a, (3,), w, b), ((5, 3), (3,), (3,))),
    _row("rms_norm", "nn", lambda a, w: F.rms_norm(a, (3,), w), ((5, 3), (3,))),
    _row("embedding", "nn", lambda w: F.embedding(_T([[1, 0], [4, 4], [2, 3]]), w), _A),
    _row("embedding_backward", "nn", lambda g: torch.ops.aten.embedding_dense_backward(
        g, _T([[1, 0], [4, 4], [2, 3]]), 5, -1, False), ((3, 2, 3),)),
    _row("cross_entropy", "nn", lambda a: F.cross_entropy(a, _T(_TARGET)), _A),
    _row("cross_entropy_sum", "nn",
         lambda a: F.cross_entropy(a, _T(_TARGET), reduction="sum"), _A),
    _row("nll_none", "nn", lambda a: F.nll_loss(a, _T(_TARGET), reduction="none"), _A),
    _row("mse_loss", "nn", F.mse_loss, _AB),
    # dtensor/rules/batched.py: slices along some dims are independent
    _row("kthvalue", "reduction", lambda a: tuple(a.kthvalue(2, 1)), _A),
    _row("mode", "reduction", lambda a: tuple(a.mode(1)), _A),
    _row("median_dim", "reduction", lambda a: tuple(a.median(1)), _A),
    _row("nanmedian_dim", "reduction", lambda a: tuple(a.nanmedian(0, keepdim=True)), _A),
    _row("histc_range", "reduction", lambda a: torch.histc(a, 5, -1.0, 1.0), _A),
    _row("as_strided_self", "view",
         lambda a: a.as_strided(a.size(), a.stride(), a.storage_offset()), _A),
    _row("prims_view_of", "view", lambda a: torch.ops.prims.view_of(a), _A),
    _row("max_pool2d", "nn", lambda a: tuple(F.max_pool2d(a, 2, return_indices=True)),
         ((3, 2, 4, 5),)),
    _row("max_pool2d_backward", "nn", lambda g, x: torch.ops.aten.max_pool2d_with_indices_backward(
        g, x, [2, 2], [2, 2], [0, 0], [1, 1], False,
        torch.ops.aten.max_pool2d_with_indices(x, [2, 2])[1]), ((3, 2, 2, 2), (3, 2, 4, 5))),
    _row("avg_pool2d", "nn", lambda a: F.avg_pool2d(a, 2), ((3, 2, 4, 5),)),
    _row("avg_pool2d_backward", "nn", lambda g, x: torch.ops.aten.avg_pool2d_backward(
        g, x, [2, 2], [2, 2], [0, 0], False, True, None), ((3, 2, 2, 2), (3, 2, 4, 5))),
    _row("adaptive_avg_pool2d", "nn", lambda a: F.adaptive_avg_pool2d(a, 3), ((3, 2, 4, 5),)),
    _row("adaptive_avg_pool2d_backward", "nn",
         lambda g, x: torch.ops.aten._adaptive_avg_pool2d_backward(g, x),
         ((3, 2, 3, 3), (3, 2, 4, 5))),
    _row("adaptive_max_pool2d", "nn",
         lambda a: tuple(F.adaptive_max_pool2d(a, 3, return_indices=True)), ((3, 2, 4, 5),)),
    _row("max_pool3d", "nn", lambda a: tuple(F.max_pool3d(a, 2, return_indices=True)),
         ((3, 2, 2, 4, 4),)),
    _row("avg_pool3d", "nn", lambda a: F.avg_pool3d(a, 2), ((3, 2, 2, 4, 4),)),
    _row("group_norm", "nn", lambda a: F.group_norm(a, 2), ((3, 4, 5),)),
    _row("fill", "creation", lambda a: torch.fill(a, 2.0), _A),
    _row("fill_", "creation", lambda a: (a * 1).fill_(2.0), _A),
    _row("logsigmoid", "pointwise", F.logsigmoid, _A),
    # dtensor/rules/spatial.py: transformed dims whole, the others independent
    _row("fft", "reduction", lambda a: (torch.fft.rfft(a, dim=1), torch.fft.irfft(
        a.to(torch.complex64), dim=0), torch.fft.fft(a.to(torch.complex64), dim=1)), _A),
    _row("upsample_1d", "nn", lambda a: tuple(F.interpolate(a, size=7, mode=m) for m in (
        "nearest", "nearest-exact", "linear")), ((3, 2, 5),)),
    _row("upsample_2d", "nn", lambda a: tuple(F.interpolate(
        a, size=(3, 7), mode=m, antialias=aa) for m, aa in (
        ("nearest", False), ("nearest-exact", False), ("bilinear", False),
        ("bicubic", False), ("bilinear", True), ("bicubic", True))), ((3, 2, 4, 5),)),
    _row("upsample_3d", "nn", lambda a: tuple(F.interpolate(a, size=(3, 2, 5), mode=m) for m in (
        "nearest", "nearest-exact", "trilinear")), ((3, 2, 2, 4, 4),)),
    _row("grid_sample_2d", "nn", lambda a, g: F.grid_sample(a, g, align_corners=False),
         ((3, 2, 4, 5), (3, 2, 3, 2))),
    _row("grid_sample_3d", "nn", lambda a, g: F.grid_sample(a, g, align_corners=True),
         ((3, 2, 2, 4, 4), (3, 2, 2, 3, 3))),
)

#: The property suite's rows (those with a shape strategy).
OPS: tuple[OpCase, ...] = tuple(case for case in TABLE if case.shapes is not None)

OPS_BY_NAME = {case.name: case for case in TABLE}


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


@functools.cache
def _family_cases(family: str):
    # One strategy object per family: a new one is validated on every draw.
    return st.sampled_from([c for c in OPS if c.family == family])


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
        case = data.draw(_family_cases(family))
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
