"""Covers: dtensor/dispatch (spec-aliasing metadata ops, in-place ops, in-place
views) and dtensor/tensor.py, on alias families.

Property: build an alias family of a DTensor (``detach``, ``alias``,
``view_as``, same-shape ``view``), apply a drawn sequence of in-place ops —
value ops (``add_``, ``mul_``, ``zero_``, ``fill_``) and in-place view ops
(``t_``, ``transpose_``, ``swapdims_``, ``unsqueeze_``, ``squeeze_``,
``as_strided_``) — each to one drawn member, and the same to the same
family of a plain tensor. Every member must then hold what the plain member
holds (shape, values, and its block on every rank, through the per-rank
oracle); a member no in-place view touched keeps its spec. This is the bug
class of a spec-aliasing ``detach`` fast path: one member's in-place view
must never reshape another. An op the runtime refuses (a ``ShardingError``
on every rank, e.g. ``as_strided_``) must leave the family unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dtensor.placement import Shard
from dtensor.testing import assert_matches_single_device, distributed_inputs, dtypes


def _member(t, how: str):
    if how == "detach":
        return t.detach()
    if how == "alias":
        return torch.ops.aten.alias.default(t)
    if how == "view_as":
        return t.view_as(t)
    return t.view(tuple(t.shape))


MEMBERS = ("detach", "alias", "view_as", "view")


class InplaceOp(NamedTuple):
    name: str
    view: bool  # changes the target's shape/strides (not its values)
    ok: Callable[[torch.Tensor], bool]  # defined for this (single-device) member
    fn: Callable[[torch.Tensor], object]


def _any(t):
    return True


OPS = (
    InplaceOp("add_(1)", False, _any, lambda t: t.add_(1)),
    InplaceOp("mul_(2)", False, _any, lambda t: t.mul_(2)),
    InplaceOp("zero_()", False, _any, lambda t: t.zero_()),
    InplaceOp("fill_(3)", False, _any, lambda t: t.fill_(3)),
    InplaceOp("t_()", True, lambda t: t.ndim <= 2, lambda t: t.t_()),
    InplaceOp("transpose_(0, -1)", True, lambda t: t.ndim >= 1, lambda t: t.transpose_(0, -1)),
    InplaceOp("swapdims_(0, -1)", True, lambda t: t.ndim >= 1, lambda t: t.swapdims_(0, -1)),
    InplaceOp("unsqueeze_(0)", True, _any, lambda t: t.unsqueeze_(0)),
    InplaceOp("unsqueeze_(-1)", True, _any, lambda t: t.unsqueeze_(-1)),
    InplaceOp("squeeze_()", True, _any, lambda t: t.squeeze_()),
    InplaceOp("squeeze_(0)", True, lambda t: t.ndim >= 1, lambda t: t.squeeze_(0)),
    InplaceOp("as_strided_(same)", True, _any,
              lambda t: t.as_strided_(tuple(t.shape), tuple(t.stride()))),
)
_BY_NAME = {op.name: op for op in OPS}


@given(data=st.data())
def test_inplace_ops_on_one_member_leave_the_alias_family_as_single_device(
        n_ranks, world, impl, data):
    from dtensor.errors import ShardingError

    inp = data.draw(distributed_inputs(
        world_size=world.size, mesh_factory=impl.mesh, mixed_reduce_ops=impl.mixed_partials,
        dtype=dtypes(include=(torch.float32, torch.int64)),
        fills=("arange", "small")), label="input")
    hows = data.draw(st.lists(st.sampled_from(MEMBERS), min_size=1, max_size=3),
                     label="family")
    x = impl.from_blocks(inp.tensor, inp.mesh, inp.placements)
    family = [x] + [_member(x, h) for h in hows]
    plain = inp.tensor.clone()
    family_ref = [plain] + [_member(plain, h) for h in hows]
    names = ["x"] + [f"x.{h}" for h in hows]
    specs = [getattr(m, "_spec", None) for m in family]
    steps = data.draw(st.lists(st.tuples(st.integers(0, len(family) - 1),
                                         st.sampled_from([op.name for op in OPS])),
                               min_size=1, max_size=3), label="in-place steps")
    reshaped: set[int] = set()
    log = []
    for i, name in steps:
        op = _BY_NAME[name]
        if not op.ok(family_ref[i]):
            continue
        try:
            op.fn(family[i])
        except ShardingError as e:  # refused (the same on every rank): nothing changed
            log.append(f"{names[i]}.{name} refused: {str(e)[:80]}")
            continue
        op.fn(family_ref[i])
        log.append(f"{names[i]}.{name}")
        if op.view:
            reshaped.add(i)
    what = f"after {log} on {inp}"
    errors = []
    for j, (m, ref) in enumerate(zip(family, family_ref, strict=True)):
        try:  # every member is checked (each check may reduce a Partial: collective)
            assert_matches_single_device(m, ref, msg=f"{names[j]} {what}")
        except AssertionError as e:
            errors.append(e)
    if errors:
        raise errors[0]
    for j, m in enumerate(family):
        if j in reshaped or specs[j] is None:
            continue
        assert m._spec == specs[j], (
            f"rank {world.rank}: {names[j]} was not reshaped by any in-place view, yet its "
            f"spec changed from {specs[j]} to {m._spec} {what}")


# Regressions found by the property above: an in-place view used to move its
# target into a new layout (new storage) whenever the out-of-place view
# needed one, and the rest of the family stopped seeing the target's writes.
_PARTIAL_VIEWS = (
    ("t_()", lambda t: t.t_()),
    ("transpose_(0, 1)", lambda t: t.transpose_(0, 1)),
    ("swapdims_(1, 0)", lambda t: t.swapdims_(1, 0)),
    ("unsqueeze_(0)", lambda t: t.unsqueeze_(0)),
    ("squeeze_()", lambda t: t.squeeze_()),
    ("squeeze_(1)", lambda t: t.squeeze_(1)),
)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("op", ["max", "min"])
def test_inplace_views_on_a_nonlinear_partial_keep_the_alias(world, impl, op):
    from dtensor.testing import MeshLayout

    mesh = impl.mesh(MeshLayout((2,), (0, 1)))
    sign = 1 if op == "max" else -1
    for name, view in _PARTIAL_VIEWS:
        # Pieces 0 and -1 (max 0) or 0 and 1 (min 0): the reduced value is 0.
        local = torch.zeros(2, 1) - sign * world.rank
        x = impl.DTensor.from_local(local, mesh, (impl.Partial(op),), shape=(2, 1))
        y = x.detach()
        plain = torch.zeros(2, 1)
        plain_y = plain.detach()
        view(x)
        view(plain)
        x.add_(1)
        plain.add_(1)
        what = f"y = x.detach(); x.{name}; x.add_(1) on P({op})"
        assert_matches_single_device(x, plain, msg=f"x after {what}")
        assert_matches_single_device(y, plain_y, msg=f"y after {what}")


@pytest.mark.world_size(2)
def test_inplace_view_on_partial_max_keeps_the_alias(world, impl):
    from dtensor.testing import MeshLayout

    mesh = impl.mesh(MeshLayout((2,), (0, 1)))
    local = torch.zeros(1, 1) - world.rank  # pieces 0 and -1: max 0
    x = impl.DTensor.from_local(local, mesh, (impl.Partial("max"),), shape=(1, 1))
    y = x.detach()
    x.t_()
    x.add_(1)
    assert_matches_single_device(y, torch.ones(1, 1), msg="x.detach() after x.t_(); x.add_(1)")


@pytest.mark.world_size(2)
def test_inplace_views_that_move_a_shard_keep_the_block(world, impl):
    # The shard follows its dim: no rank's block moves, so the storage stays.
    from dtensor.testing import MeshLayout

    mesh = impl.mesh(MeshLayout((2,), (0, 1)))
    full = torch.arange(6.0).reshape(3, 2)
    for name, view in (("t_()", lambda t: t.t_()), ("unsqueeze_(1)", lambda t: t.unsqueeze_(1)),
                       ("transpose_(0, 1)", lambda t: t.transpose_(0, 1))):
        x = impl.from_blocks(full, mesh, (Shard(0),))
        y = x.detach()
        ptr = x.to_local().data_ptr() if x.to_local().numel() else None
        plain = full.clone()
        plain_y = plain.detach()
        view(x)
        view(plain)
        if ptr is not None:
            assert x.to_local().data_ptr() == ptr, f"rank {world.rank}: x.{name} moved S(0)'s block"
        x.mul_(2)
        plain.mul_(2)
        assert_matches_single_device(x, plain, msg=f"x after x.{name}; x.mul_(2) on S(0)")
        assert_matches_single_device(y, plain_y, msg=f"y = x.detach() after x.{name}; x.mul_(2)")


@pytest.mark.world_size(2)
@pytest.mark.parametrize("cached", [False, True], ids=["first_call", "cached_plan"])
def test_inplace_squeeze_of_a_sharded_dim_is_refused_and_changes_nothing(
        world, impl, cached):
    # Global shape (1,) on S(0): rank 0 holds the element, rank 1 an empty block.
    # squeeze_ needs the dim gathered (new storage on every rank), which would
    # cut x off from y; single device, y would see x's later writes.
    from dtensor.errors import ShardingError
    from dtensor.testing import MeshLayout

    if impl.name != "dtensor":
        pytest.skip("the refusal is this runtime's answer; others may differ")
    mesh = impl.mesh(MeshLayout((2,), (0, 1)))
    x = impl.from_blocks(torch.zeros(1), mesh, (Shard(0),))
    y = x.detach()
    if cached:  # the out-of-place twin's plan is in the call table
        assert x.squeeze().shape == ()
    spec, local = x._spec, x.to_local()
    with pytest.raises(ShardingError) as info:
        x.squeeze_()
    msg = str(info.value)
    for part in ("squeeze_", "S(0)", str(mesh), "R", "x = x.squeeze(", "redistribute"):
        assert part in msg, f"{part!r} not in the refusal: {msg}"
    assert x._spec is spec and x.shape == (1,) and x.to_local() is not None
    assert x.to_local().shape == local.shape
    x.add_(1)  # the family is intact: y sees the write, as on one device
    assert_matches_single_device(y, torch.ones(1), msg="y = x.detach() after a refused squeeze_")
