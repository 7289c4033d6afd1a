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
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dtensor.testing import assert_matches_single_device, mesh_layouts, tensors
from dtensor.testing.impl import exact_split
from dtensor.testing.op_table import OPS, TABLE, draw_op, op_tolerances, reference


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


_POINTWISE = [c for c in OPS if c.family == "pointwise"]


@given(data=st.data())
def test_pointwise_on_alike_operands_keeps_layout_and_sends_nothing(n_ranks, world, impl, data):
    """Operands placed alike (Shard/Replicate, nested shards of one dim
    included) give a result in that layout without any collective: a
    pointwise op never needs another rank's elements."""
    from dtensor.testing.strategies import placements

    case = data.draw(st.sampled_from(_POINTWISE), label="op")
    layout = data.draw(mesh_layouts(world_size=world.size), label="layout")
    shapes = data.draw(case.shapes, label="shapes")
    ps = data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=len(shapes[0]),
                              allow_partial=False), label="placements")
    xs = [data.draw(tensors(shape=s, dtype=torch.float32)) for s in shapes]
    mesh = impl.mesh(layout)
    dts = [impl.from_blocks(x, mesh, ps) for x in xs]
    with impl.comm_counter() as comm:
        out = case.fn(*dts)
    where = f"{case.name} on {[str(p) for p in ps]} over {layout}"
    assert comm.total == 0, f"{where}: {getattr(comm, 'counts', comm.total)}"
    assert tuple(out.placements) == tuple(ps), f"{where}: result {tuple(out.placements)}"
    assert_matches_single_device(out, case.fn(*xs), msg=where)


# Every pointwise row of the op table with several operands (fixed-shape
# rows at their example shapes).
_MULTI_POINTWISE = [c for c in TABLE if c.family == "pointwise" and c.partial
                    and c.example is not None and len(c.example) >= 2]


@settings(max_examples=4 * settings.default.max_examples)
@given(data=st.data())
def test_pointwise_on_alike_partial_operands_matches_single_device(n_ranks, world, impl, data):
    """Two operands with the same placements, a ``Partial`` of one reduce op
    among them: what a rule may keep partial depends on every operand's
    kind (``max`` pieces of ``a`` and ``b`` do not add up to pieces of
    ``a + b``), and independent draws rarely give both operands one kind."""
    from dtensor.placement import Partial
    from dtensor.testing.strategies import placements

    case = data.draw(st.sampled_from(_MULTI_POINTWISE), label="op")
    layout = data.draw(mesh_layouts(world_size=world.size), label="layout")
    shapes = (data.draw(case.shapes, label="shapes") if case.shapes is not None
              else case.example)
    ndim = min(len(s) for s in shapes)
    op = data.draw(st.sampled_from(("sum", "avg", "max", "min")), label="reduce op")
    ps = data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=ndim, reduce_ops=(op,),
                              mixed_reduce_ops=False), label="placements")
    axis = data.draw(st.integers(0, layout.ndim - 1), label="partial axis")
    ps = tuple(Partial(op) if i == axis else p for i, p in enumerate(ps))
    dtype = data.draw(st.sampled_from([d for d in case.dtypes if d != torch.bool]),
                      label="dtype")
    xs = [data.draw(tensors(shape=s, dtype=dtype, fills=("arange", "small")),
                    label=f"operand {i}") for i, s in enumerate(shapes)]
    expected = reference(case, xs)
    # A non-finite result of finite operands (a division by 0) is the limit
    # test_partial_times_inf_is_inf pins: pieces over 0 give nan where their
    # sum over 0 gives inf. This property checks which kinds stay partial.
    assume(not expected.is_floating_point() or bool(expected.isfinite().all()))
    mesh = impl.mesh(layout)
    exact = all(exact_split(x) for x in xs)
    dts = [impl.from_blocks(x, mesh, ps, exact=exact) for x in xs]
    assert_matches_single_device(case.fn(*dts), expected, **op_tolerances(case, dtype),
                                 msg=f"{case.name} on {[str(p) for p in ps]} over {layout}")


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
