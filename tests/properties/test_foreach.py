"""Covers: dtensor/rules/foreach.py (the ``_foreach_*`` ops torch.optim and
``clip_grad_*`` call), through the public ops.

Property: a ``_foreach_*`` op on a list of DTensors, each member with its own
shape and placements (``Partial`` of every reduce op included), with a scalar,
a list of scalars, a second list of tensors, or one tensor shared by every
member (plain 0-d, or a replicated DTensor), in place or not, gives every
member its single-device result on every rank (values, local shape, offset,
placements through the per-rank oracle), and leaves an in-place op's inputs
as single device does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st

from dtensor.placement import REDUCE_OPS, Partial, Replicate
from dtensor.testing import assert_matches_single_device, mesh_layouts, placements, tensors
from dtensor.testing.impl import exact_split, once_per_value
from dtensor.testing.strategies import tensor_shapes


class ForeachCase(NamedTuple):
    name: str
    operand: str  # none | scalar | scalars | list | shared | two_lists
    fn: Callable  # fn(xs, other) -> list (out of place) or None (in place: xs)

    def __repr__(self) -> str:  # rank-independent (lockstep compares draws)
        return self.name


_f = torch
CASES = (
    ForeachCase("_foreach_add_(Scalar)", "scalar", lambda xs, o: _f._foreach_add_(xs, o)),
    ForeachCase("_foreach_add(Scalar)", "scalar", lambda xs, o: _f._foreach_add(xs, o)),
    ForeachCase("_foreach_mul_(Scalar)", "scalar", lambda xs, o: _f._foreach_mul_(xs, o)),
    ForeachCase("_foreach_mul(ScalarList)", "scalars", lambda xs, o: _f._foreach_mul(xs, o)),
    ForeachCase("_foreach_add_(ScalarList)", "scalars",
                lambda xs, o: _f._foreach_add_(xs, o)),
    ForeachCase("_foreach_div_(ScalarList)", "scalars",
                lambda xs, o: _f._foreach_div_(xs, o)),
    ForeachCase("_foreach_mul_(Tensor)", "shared", lambda xs, o: _f._foreach_mul_(xs, o)),
    ForeachCase("_foreach_add_(List)", "list",
                lambda xs, o: _f._foreach_add_(xs, o, alpha=2)),
    ForeachCase("_foreach_mul_(List)", "list", lambda xs, o: _f._foreach_mul_(xs, o)),
    ForeachCase("_foreach_maximum_(List)", "list",
                lambda xs, o: _f._foreach_maximum_(xs, o)),
    ForeachCase("_foreach_lerp_(Scalar)", "list", lambda xs, o: _f._foreach_lerp_(xs, o, 0.5)),
    ForeachCase("_foreach_addcmul_(Scalar)", "two_lists",
                lambda xs, o: _f._foreach_addcmul_(xs, o[0], o[1], value=0.5)),
    ForeachCase("_foreach_addcdiv_(ScalarList)", "two_lists",
                lambda xs, o: _f._foreach_addcdiv_(xs, o[0], [v.abs() + 1 for v in o[1]],
                                                   [0.5] * len(xs))),
    ForeachCase("_foreach_clamp_min_(Scalar)", "scalar",
                lambda xs, o: _f._foreach_clamp_min_(xs, o)),
    ForeachCase("_foreach_clamp_max_(Scalar)", "scalar",
                lambda xs, o: _f._foreach_clamp_max_(xs, o)),
    ForeachCase("_foreach_sqrt", "none", lambda xs, o: _f._foreach_sqrt([x.abs() for x in xs])),
    ForeachCase("_foreach_neg", "none", lambda xs, o: _f._foreach_neg(xs)),
)
_DT = (torch.float64, torch.float32)
_ADDS = tuple(c for c in CASES if c.name.startswith(("_foreach_add", "_foreach_lerp",
                                                      "_foreach_addc", "_foreach_clamp")))



def _member(data, layout, impl, shape, dtype, label, allow_partial=True):
    x = data.draw(tensors(shape=shape, dtype=dtype, fills=("arange", "small", "normal")),
                  label=label)
    ps = data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=x.ndim,
                              allow_partial=allow_partial,
                              mixed_reduce_ops=impl.mixed_partials), label=label + " placements")
    return x, ps


# One property draws the case: 17 cases as separate tests cost ~25 s of the
# main job; twice the profile's examples, drawn over the cases, cost ~3 s.
@settings(max_examples=2 * settings.default.max_examples)
@given(data=st.data())
def test_foreach_on_partial_members_matches_single_device(n_ranks, world, impl, data):
    # Partial-kept-through-a-shift cases first half the time: they are where
    # a rule that keeps Partial(sum) through an add shows.
    case = data.draw(st.one_of(st.sampled_from(_ADDS), st.sampled_from(CASES)), label="op")
    layout = data.draw(mesh_layouts(world_size=world.size), label="layout")
    dtype = data.draw(st.sampled_from(_DT), label="dtype")
    k = data.draw(st.integers(1, 3), label="list length")
    shapes = [data.draw(tensor_shapes(max_dims=2), label=f"shape {i}") for i in range(k)]
    members = [_member(data, layout, impl, s, dtype, f"x{i}") for i, s in enumerate(shapes)]
    _check_case(data, impl, layout, case, members, dtype)


# Every case meets the test's Partial kind in each example: drawn over the
# cases, one in ~7 placements per mesh axis is a given Partial kind, so a bug
# that shows only for one (case, kind) pair (an add that keeps Partial(sum))
# was drawn in too few of the main job's examples to be seen. One test per
# kind, so a parallel run (``-n``) spreads the sweep over workers (at 1,024
# simulated ranks all kinds in one test took ~160 s).
@pytest.mark.parametrize("op", REDUCE_OPS)
@settings(max_examples=max(2, settings.default.max_examples // 12))
@given(data=st.data())
def test_every_foreach_case_on_every_partial_kind(n_ranks, world, impl, op, data):
    layout = data.draw(mesh_layouts(world_size=world.size), label="layout")
    dtype = data.draw(st.sampled_from(_DT), label="dtype")
    shapes = [data.draw(tensor_shapes(max_dims=2), label=f"shape {i}") for i in range(2)]
    # The Partial goes on the widest mesh axis (a size-1 axis shows nothing).
    axis = max(range(layout.ndim), key=lambda a: layout.shape[a])
    for case in CASES:
        # The Partial member first in the first list, then (cases with
        # other tensors) in the other operand, the first list plain.
        wheres = ("self", "other") if case.operand in _TENSOR_OPERANDS else ("self",)
        for where in wheres:
            members = [_member(data, layout, impl, s, dtype, f"x{i}",
                               allow_partial=False) for i, s in enumerate(shapes)]
            partial = _on_axis(Partial(op), axis)
            if where == "self":
                members[0] = (members[0][0], partial(members[0][1]))
            _check_case(data, impl, layout, case, members, dtype,
                        other_partial=partial if where == "other" else None)


_TENSOR_OPERANDS = ("list", "two_lists", "shared")


def _on_axis(p, axis):
    return lambda ps: tuple(p if a == axis else q for a, q in enumerate(ps))


def _check_case(data, impl, layout, case, members, dtype, other_partial=None):
    """Run ``case`` on the members (``(tensor, placements)``) with drawn
    operands, on DTensors and on one device; compare every result.
    ``other_partial`` (placements -> placements) puts a Partial on the first
    member of the other list, or on the shared tensor."""
    mesh = impl.mesh(layout)
    shapes = [tuple(x.shape) for x, _ in members]
    k = len(members)
    xs = [x for x, _ in members]
    exact = all(exact_split(x) for x in xs)

    def dlist(items):
        return [impl.from_blocks(x, mesh, ps, exact=exact) for x, ps in items]

    plain_other, d_other = None, None
    if case.operand == "scalar":
        plain_other = d_other = data.draw(st.sampled_from((2, -1.5, 0.5)), label="scalar")
    elif case.operand == "scalars":
        plain_other = d_other = data.draw(st.lists(st.sampled_from((2, -1.5, 0.5, 3)),
                                                   min_size=k, max_size=k), label="scalars")
    elif case.operand == "shared":
        plain_other = torch.tensor(data.draw(st.sampled_from((2.0, -0.5)), label="value"),
                                   dtype=dtype)
        as_dtensor = data.draw(st.booleans(), label="shared as a replicated DTensor")
        if other_partial is not None:
            d_other = impl.from_blocks(plain_other, mesh,
                                       other_partial((Replicate(),) * layout.ndim))
        else:
            d_other = (impl.from_blocks(plain_other, mesh, (Replicate(),) * layout.ndim)
                       if as_dtensor else plain_other)
    elif case.operand in ("list", "two_lists"):
        n = 1 if case.operand == "list" else 2
        cols = [[_member(data, layout, impl, s, dtype, f"y{j}{i}") for i, s in enumerate(shapes)]
                for j in range(n)]
        if other_partial is not None:
            y, ps = cols[0][0]
            cols[0][0] = (y, other_partial(ps))
        exact = exact and all(exact_split(y) for col in cols for y, _ in col)
        plain = [[y for y, _ in col] for col in cols]
        dcols = [dlist(col) for col in cols]
        plain_other, d_other = (plain[0], dcols[0]) if n == 1 else (plain, dcols)
    dxs = dlist(members)
    expected = _reference(case, xs, plain_other)
    out = case.fn(dxs, d_other)
    where = (f"{case.name} on {[(tuple(x.shape), [str(q) for q in ps]) for x, ps in members]}"
             f" over {layout}")
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    if out is None:  # in place: the inputs hold the results
        out = dxs
    for i, (o, e) in enumerate(zip(out, expected, strict=True)):
        assert_matches_single_device(o, e, **tol, msg=f"{where}: member {i}")


def _reference(case, xs, other):
    """``case`` on one device: its results, or (in place) the written copies."""

    def run():
        ref_xs = [x.clone() for x in xs]
        out = case.fn(ref_xs, other)
        return ref_xs if out is None else out

    leaves = pytree.tree_leaves(other)
    tensors = [*xs, *(v for v in leaves if isinstance(v, torch.Tensor))]
    scalars = tuple(v for v in leaves if not isinstance(v, torch.Tensor))
    return once_per_value((case.name, len(xs), scalars), tensors, run)


@pytest.mark.world_size(2)
def test_foreach_mul_of_a_partial_sum_member_by_a_replicated_member(world, impl):
    """Found by the property above: a list times a list is not a scaling, so a
    Partial(sum) member is reduced first (each rank multiplying its pieces
    would give sum_r x_r*y_r, not x*y)."""
    from dtensor.testing import MeshLayout

    mesh = impl.mesh(MeshLayout((2,), (0, 1)))
    x = torch.tensor([[0.0, 1.0]])
    y = torch.tensor([[0.0, 1.0]])
    dx = impl.from_blocks(x, mesh, (Partial("sum"),))
    dy = impl.from_blocks(y, mesh, (Replicate(),))
    torch._foreach_mul_([dx], [dy])
    assert_matches_single_device(dx, x * y, msg="_foreach_mul_([P(sum) x], [R y])")
