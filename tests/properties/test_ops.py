"""Covers: dtensor/dispatch/ and dtensor/rules/ (through the public ops).

Property: for pointwise ops, reductions, the matmul family and views, the op
on DTensors with generated placements (Partial included) equals the op on
the full tensors, on every rank, on 1-D to 3-D meshes over the world.
Ops without a rule still pass through the replicate fallback. One test per
op (``dtensor.testing.op_table.OPS``), so the summary is a per-op table.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dtensor.testing import assert_matches_single_device, mesh_layouts
from dtensor.testing.impl import exact_split
from dtensor.testing.op_table import OPS, draw_op, op_tolerances, reference


@pytest.mark.parametrize("case", OPS, ids=[f"{c.family}-{c.name}" for c in OPS])
@given(data=st.data())
def test_op_matches_single_device(n_ranks, world, impl, case, data):
    layout = data.draw(mesh_layouts(world_size=world.size))
    op = draw_op(data, case=case, mesh_ndim=layout.ndim,
                 mixed_reduce_ops=impl.mixed_partials)
    expected = reference(op.case, op.inputs)
    mesh = impl.mesh(layout)
    exact = all(exact_split(x) for x in op.inputs)
    dts = [impl.from_blocks(x, mesh, p, exact=exact)
           for x, p in zip(op.inputs, op.placements, strict=True)]
    out = op.case.fn(*dts)
    assert_matches_single_device(
        out, expected, **op_tolerances(op.case, op.dtype),
        msg=f"{op.case.name} on {[str(p) for p in op.placements]}")


@pytest.mark.world_size(2)
def test_partial_times_inf_is_inf(world, impl, request):
    if impl.name == "dtensor":
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "runtime bug: distribute_tensor(x, [Partial()]) stores zeros on coordinates "
            "!= 0 and mul keeps Partial(sum), so 0 * inf = nan there (torch splits x/n "
            "and gets inf)")))
    from dtensor.testing import MeshLayout

    mesh = impl.mesh(MeshLayout((2,), (0, 1)))
    x = impl.distribute_tensor(torch.tensor([4.0]), mesh, (impl.Partial("sum"),))
    y = impl.distribute_tensor(torch.tensor([float("inf")]), mesh, (impl.Replicate(),))
    assert_matches_single_device(x * y, torch.tensor([float("inf")]))
