"""Covers: dtensor/dispatch/meta.py shape math (one process, no process group):
the output shapes a rule provides (pure shape math) equal what the op gives on
meta tensors of the global shapes; the shape math steps aside where it could
be wrong; in-place ops take self's metadata exactly where the meta kernel does.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtensor import DeviceMesh, Replicate, Shard, implicit_replication
from dtensor.dispatch.cache import record
from dtensor.dispatch.call import Call
from dtensor.dispatch.meta import infer_meta, inplace_metas, shape_metas
from dtensor.rules import rule_for_tags
from dtensor.sharding import OpCall
from dtensor.spec import DTensorSpec, TensorMeta

aten = torch.ops.aten

# Every rank of the world is a member (two ranks in a plain process); specs only
# name the mesh, so it needs no groups.
_N = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
MESH = DeviceMesh("cpu", list(range(max(2, _N))), _init_backend=False)


def _spec(t: torch.Tensor) -> DTensorSpec:
    return DTensorSpec(MESH, (Replicate(),), TensorMeta(t.shape, t.stride(), t.dtype))


def _call(func, args, kwargs) -> tuple[Call, tuple[DTensorSpec, ...]]:
    """The call of ``func`` on plain tensors, as dispatch takes it apart, and
    its operands' specs (replicated)."""
    with implicit_replication():
        call = Call(func, args, kwargs)
    return call, tuple(_spec(o) for o in call.operands)


def _both(func, *args, **kwargs):
    """(metas from the rule's shapes, metas from meta tensors) for one call."""
    call, specs = _call(func, args, kwargs)
    args_with_specs, _ = call.replace(specs)
    key_args = tuple(tuple(a) if isinstance(a, list) else a for a in args_with_specs)
    sharding = rule_for_tags(func)(OpCall(func, specs, key_args, kwargs))
    assert sharding is not None and sharding.shapes is not None, func
    metas = shape_metas(call, record(func), specs, sharding.shapes, sharding.any_strides)
    return metas, infer_meta(call, specs)


def _t(*shape, dtype=torch.float32):
    return torch.ones(shape, dtype=dtype)


SHAPE_CASES = [
    (aten.add.Tensor, (_t(4, 3), _t(3)), {}),
    (aten.add.Tensor, (_t(4, 1), _t(1, 5)), {"alpha": 2}),
    (aten.mul.Tensor, (_t(2, 3, dtype=torch.int64), _t(2, 3)), {}),
    (aten.mul.Tensor, (_t(2, 3, dtype=torch.float16), torch.tensor(2.0)), {}),
    (aten.div.Tensor, (_t(5, dtype=torch.int32), _t(5, dtype=torch.int32)), {}),
    (aten.eq.Tensor, (_t(3, 3), _t(3)), {}),
    (aten.where.self, (_t(3, 1, dtype=torch.bool), _t(3, 4), _t(4)), {}),
    (aten.sigmoid.default, (_t(2, 2, dtype=torch.int64),), {}),
    (aten.pow.Tensor_Scalar, (_t(3, dtype=torch.int64), 2), {}),
    (aten.pow.Tensor_Scalar, (_t(3, dtype=torch.int64), 2.0), {}),
    (aten.clamp.default, (_t(3, 2), 0.0), {}),
    (aten.frexp.Tensor, (_t(3, 2),), {}),
    (aten.sum.dim_IntList, (_t(4, 5), [1]), {}),
    (aten.sum.dim_IntList, (_t(4, 5, 6), [0, 2], True), {}),
    (aten.sum.dim_IntList, (_t(4, 5), []), {}),
    (aten.sum.dim_IntList, (_t(4, 5, dtype=torch.int32), [-1]), {}),
    (aten.sum.default, (_t(4, 5, dtype=torch.bool),), {}),
    (aten.sum.dim_IntList, (_t(4, 5), [1]), {"dtype": torch.float64}),
    (aten.sum.default, (torch.tensor(3.0),), {}),
    (aten.mean.dim, (_t(4, 5), [0], True), {}),
    (aten.amax.default, (_t(4, 5), [1]), {}),
    (aten.max.dim, (_t(4, 5), 0), {}),
    (aten.argmax.default, (_t(4, 5),), {}),
    (aten.argmax.default, (_t(4, 5), 1, True), {}),
    (aten.argmax.default, (_t(4, 5), None, True), {}),
    (aten.aminmax.default, (_t(4, 5),), {"keepdim": True}),
    (aten.count_nonzero.dim_IntList, (_t(4, 5), []), {}),
    (aten.any.dims, (_t(4, 5, dtype=torch.bool), None, True), {}),
    (aten.var.correction, (_t(4, 5), [1]), {"correction": 1}),
    (aten.std_mean.correction, (_t(4, 5), [0]), {"keepdim": True}),
    (aten.any.dims, (_t(4, 5, dtype=torch.bool), [1]), {}),
    (aten.count_nonzero.dim_IntList, (_t(4, 5), [1]), {}),
    (aten.logsumexp.default, (_t(4, 5), [1]), {}),
    (aten.linalg_vector_norm.default, (_t(4, 5), 2, [0]), {}),
    (aten.prod.dim_int, (_t(4, 5), 1, True), {}),
    (aten.nansum.default, (_t(4, 5), [0]), {}),
    (aten.mm.default, (_t(4, 5), _t(5, 3)), {}),
    (aten.bmm.default, (_t(2, 4, 5), _t(2, 5, 3)), {}),
    (aten.mv.default, (_t(4, 5), _t(5)), {}),
    (aten.dot.default, (_t(5), _t(5)), {}),
    (aten.addmm.default, (_t(3), _t(4, 5), _t(5, 3)), {}),
    (aten.addmm.default, (_t(4, 3), _t(4, 5), _t(5, 3)), {}),
    (aten.addmm.default, (_t(1, 3), _t(4, 5), _t(5, 3)), {"beta": 0.5}),
    # linear's transposed weight: products make fresh contiguous outputs
    (aten.addmm.default, (_t(3), _t(4, 5), _t(3, 5).t()), {}),
    (aten.mm.default, (_t(5, 4).t(), _t(3, 5).t()), {}),
    (aten.bmm.default, (_t(2, 5, 4).transpose(1, 2), _t(2, 5, 3)), {}),
    (aten.stack.default, ([_t(), _t(), _t()],), {}),
    (aten.stack.default, ([_t(4, 3), _t(4, 3)], 1), {}),
    (aten.stack.default, ([_t(4, 3), _t(4, 3)], -1), {}),
    (aten.zeros_like.default, (_t(4, 5),), {}),
    (aten.ones_like.default, (_t(4, 5, dtype=torch.int32),), {"dtype": torch.float16}),
    (aten.full_like.default, (_t(3, 2, dtype=torch.bool), 7), {}),
    (aten.empty_like.default, (_t(2, 3, 4),), {"dtype": torch.float64}),
]


@pytest.mark.parametrize(("func", "args", "kwargs"), SHAPE_CASES, ids=lambda v: str(v)[:40])
def test_rule_shapes_give_the_meta_tensor_metadata(func, args, kwargs) -> None:
    fast, slow = _both(func, *args, **kwargs)
    assert fast is not None, "the shape-math path did not apply"
    assert fast == slow


@pytest.mark.parametrize(
    ("func", "args"),
    [
        (aten.mm.default, (_t(4, 5), _t(6, 3))),  # contracted sizes differ
        (aten.addmm.default, (_t(2, 3), _t(4, 5), _t(5, 3))),  # bias does not broadcast
        (aten.add.Tensor, (_t(4, 3).t(), _t(3, 4))),  # non-contiguous operand
        (aten.add.Tensor, (_t(0, 3), _t(3))),  # empty
    ],
)
def test_shape_math_steps_aside_where_it_could_be_wrong(func, args) -> None:
    call, specs = _call(func, args, {})
    sharding = rule_for_tags(func)(OpCall(func, specs, specs, {}))
    if sharding is None or sharding.shapes is None:
        return
    assert shape_metas(call, record(func), specs, sharding.shapes, sharding.any_strides) is None


INPLACE_CASES = [
    (aten.add_.Tensor, (_t(4, 3), _t(3)), {"alpha": 2}),
    (aten.mul_.Scalar, (_t(4, 3, dtype=torch.float16), 0.5), {}),
    (aten.addcmul_.default, (_t(4, 3), _t(4, 3), _t(3)), {"value": 0.1}),
    (aten.addcdiv_.default, (_t(4, 3), _t(4, 3), _t(4, 3)), {"value": -1.0}),
    (aten.lerp_.Scalar, (_t(2, 5), _t(2, 5), 0.9), {}),
    (aten.copy_.default, (_t(4, 3), _t(3, dtype=torch.int64)), {}),
    (aten.zero_.default, (_t(4, 3).t(),), {}),
]


@pytest.mark.parametrize(("func", "args", "kwargs"), INPLACE_CASES, ids=lambda v: str(v)[:40])
def test_inplace_results_take_self_metadata_as_the_meta_kernel_does(func, args, kwargs) -> None:
    call, specs = _call(func, args, kwargs)
    fast = inplace_metas(record(func), specs)
    assert fast is not None, "the in-place path did not apply"
    assert fast == infer_meta(call, specs)


@pytest.mark.parametrize(
    ("func", "args", "kwargs"),
    [
        (aten.add.Tensor, (_t(4, 3), _t(3)), {}),  # out of place
        (aten.add.out, (_t(4, 3), _t(3)), {"out": _t(4, 3)}),  # writes out=, not self
        (aten.split.Tensor, (_t(4, 3), 2), {}),  # several results
    ],
)
def test_only_ops_that_write_and_return_self_take_its_metadata(func, args, kwargs) -> None:
    _, specs = _call(func, args, kwargs)
    assert inplace_metas(record(func), specs) is None


def test_meta_kernel_results_are_shared_across_layouts_and_keyed_by_values(monkeypatch) -> None:
    # What a meta kernel gives depends on global metadata and argument values
    # alone, so the ranks of a simulated world (specs on their own meshes, in
    # their own layouts) run each one once; a float that sizes the output
    # (an upsampling scale) is part of the key.
    from dtensor.dispatch import meta

    runs = []
    real = meta._run_on
    monkeypatch.setattr(meta, "_run_on", lambda call, ops, dev: runs.append(
        call.func) or real(call, ops, dev))
    monkeypatch.setattr(meta, "_INFERRED", {})
    x = _t(1, 1, 4, 4)
    metas = []
    for scale, placement in ((2.0, Shard(2)), (2.0, Replicate()), (3.0, Shard(3))):
        call, (spec,) = _call(aten.upsample_nearest2d.vec, (x, None, [scale, scale]), {})
        metas.append(infer_meta(call, (spec.with_placements((placement,)),)))
    assert [m[0].shape for m in metas] == [(1, 1, 8, 8), (1, 1, 8, 8), (1, 1, 12, 12)]
    assert len(runs) == 2, runs
