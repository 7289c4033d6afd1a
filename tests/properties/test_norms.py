"""Covers: dtensor/rules/norms.py (``linalg.vector_norm``, ``norm``,
``_foreach_norm``) and ``clip_grad_norm_`` on DTensors, through the public ops.

Properties, on 1-D to 3-D meshes over the world, every placement (``Partial``
of every reduce op included), for every order ``0, 0.5, 1, 2, 3, inf, -inf``:

- ``torch.linalg.vector_norm`` and ``Tensor.norm`` over all dims, one dim or
  two dims (sharded ones included), with and without ``keepdim``;
- ``torch._foreach_norm`` of a list whose members have their own layouts;
- ``torch.nn.utils.clip_grad_norm_`` with that ``norm_type``: the total norm
  and every clipped gradient;

each equal to single device on every rank (values, local shape, offset,
placements through the per-rank oracle).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dtensor.placement import Replicate
from dtensor.testing import assert_matches_single_device, mesh_layouts, placements, tensors
from dtensor.testing.strategies import tensor_shapes

ORDERS = (2.0, 0.0, 1.0, 3.0, 0.5, math.inf, -math.inf)
_F = (torch.float64, torch.float32)
_TOL = {torch.float64: {"rtol": 1e-9, "atol": 1e-9}, torch.float32: {"rtol": 1e-4, "atol": 1e-4}}
# Contents: finite (a norm of nan/inf is checked by the ops' own tests), with
# zeros (order 0 counts them, -inf finds them) from the integer fills.
_FILLS = ("arange", "small", "normal")


def _draw_operand(data, layout, impl, label, shape=None, dtype=None):
    x = data.draw(tensors(shape=shape if shape is not None else tensor_shapes(max_dims=3),
                          dtype=dtype if dtype is not None else st.sampled_from(_F),
                          fills=_FILLS), label=label)
    ps = data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=x.ndim,
                              mixed_reduce_ops=impl.mixed_partials), label=label + " placements")
    return x, ps


@given(data=st.data())
def test_vector_norm_of_every_order_matches_single_device(n_ranks, world, impl, data):
    layout = data.draw(mesh_layouts(world_size=world.size), label="layout")
    x, ps = _draw_operand(data, layout, impl, "x")
    dims = None
    if x.ndim:
        dims = data.draw(st.one_of(st.none(), st.lists(
            st.integers(-x.ndim, x.ndim - 1), min_size=1, max_size=2,
            unique_by=lambda d: d % x.ndim)), label="dim")
    keepdim = data.draw(st.booleans(), label="keepdim")
    via = data.draw(st.sampled_from(("linalg.vector_norm", "Tensor.norm")), label="op")
    mesh = impl.mesh(layout)
    dx = impl.from_blocks(x, mesh, ps)
    errors = []
    # Every order in each example: one op each, cheaper than more examples.
    for p in ORDERS:
        def fn(t, p=p):
            if via == "Tensor.norm":
                return t.norm(p, dim=dims, keepdim=keepdim)
            return torch.linalg.vector_norm(t, p, dim=dims, keepdim=keepdim)

        try:
            expected = fn(x)
        except RuntimeError:  # -inf / inf over an empty extent: undefined on one device
            continue
        try:
            assert_matches_single_device(
                fn(dx), expected, **_TOL[x.dtype],
                msg=f"{via}(ord={p}, dim={dims}, keepdim={keepdim}) of {[str(q) for q in ps]}")
        except AssertionError as e:
            errors.append(e)
    if errors:
        raise errors[0]


@given(data=st.data())
def test_foreach_norm_and_clip_grad_norm_of_every_order(n_ranks, world, impl, data):
    layout = data.draw(mesh_layouts(world_size=world.size), label="layout")
    dtype = data.draw(st.sampled_from(_F), label="dtype")
    k = data.draw(st.integers(1, 3), label="list length")
    items = [_draw_operand(data, layout, impl, f"x{i}", dtype=dtype) for i in range(k)]
    p = data.draw(st.sampled_from(ORDERS), label="ord")
    use = data.draw(st.sampled_from(("_foreach_norm", "clip_grad_norm_")), label="op")
    if p < 0 or p == 0 and use == "clip_grad_norm_":
        # Negative orders and order 0 of an empty member are undefined on one device.
        from hypothesis import assume
        assume(all(x.numel() for x, _ in items))
    mesh = impl.mesh(layout)
    what = f"{use}(ord={p}) of {[(tuple(x.shape), [str(q) for q in ps]) for x, ps in items]}"
    tol = _TOL[dtype]
    if use == "_foreach_norm":
        xs = [x for x, _ in items]
        try:
            expected = torch._foreach_norm(xs, p)
        except RuntimeError:
            from hypothesis import assume
            assume(False)
        outs = torch._foreach_norm([impl.from_blocks(x, mesh, ps) for x, ps in items], p)
        for i, (o, e) in enumerate(zip(outs, expected, strict=True)):
            assert_matches_single_device(o, e, **tol, msg=f"{what}: member {i}")
        return
    max_norm = data.draw(st.sampled_from((0.5, 1e6)), label="max_norm")
    params = [torch.zeros_like(x, requires_grad=True) for x, _ in items]
    for q, (x, _) in enumerate(items):
        params[q].grad = x.clone()
    dparams = []
    for x, ps in items:
        # The parameter is replicated or sharded as its gradient (a Partial
        # gradient belongs to a replicated parameter, as after backward).
        pps = tuple(q if q.is_shard() else Replicate() for q in ps)
        dp = impl.from_blocks(torch.zeros_like(x), mesh, pps).requires_grad_(True)
        dp.grad = impl.from_blocks(x, mesh, ps)
        dparams.append(dp)
    try:
        expected = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=p,
                                                  foreach=True)
    except RuntimeError as e:
        # Undefined on one device (the infinity norm of an empty member): the
        # distributed call must refuse it too, on every rank.
        with pytest.raises(RuntimeError):
            torch.nn.utils.clip_grad_norm_(dparams, max_norm, norm_type=p, foreach=True)
        assert "empty" in str(e), e
        return
    total = torch.nn.utils.clip_grad_norm_(dparams, max_norm, norm_type=p, foreach=True)
    assert_matches_single_device(total, expected, **tol, msg=f"{what}: total norm")
    for i, (dp, sp) in enumerate(zip(dparams, params, strict=True)):
        assert_matches_single_device(dp.grad, sp.grad, **tol, msg=f"{what}: grad {i}")
