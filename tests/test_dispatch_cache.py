"""Covers: dtensor/dispatch/ fast path, bindings and rule registration (one process, no
process group: only ops that need no communication).

The fast path must give exactly what the general path gives: the same
output specs (the input's spec object for detach/alias/same-shape views),
result dtypes that follow the argument *types* (``x ** 2`` vs ``x ** 2.0``),
in-place ops that hand back self, and views with this rank's block sizes.
The shape math: test_dispatch_shape_math.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtensor import DeviceMesh, DTensor, Partial, Replicate, Shard
from dtensor.dispatch.cache import TABLE, forget, record

aten = torch.ops.aten


def _world() -> list[int]:
    """Every rank of the world: under `torchrun -m pytest` each rank runs these
    tests too, and must be a member (two ranks when there is no group)."""
    n = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return list(range(max(2, n)))


# NOTE: a 1-rank torchrun world cannot hold the 2-rank mesh: build it without
# groups then, as in a plain process (these tests never communicate there).
_ONE = dist.is_available() and dist.is_initialized() and dist.get_world_size() < 2
MESH = DeviceMesh("cpu", _world(), _init_backend=not _ONE)
COORD = MESH.get_coordinate()


def dt(local: torch.Tensor, *placements) -> DTensor:
    return DTensor.from_local(local, MESH, placements or (Replicate(),))


def test_metadata_ops_hand_over_the_input_spec_object_on_every_call() -> None:
    x = dt(torch.arange(8.0).reshape(2, 4), Shard(0))
    twin = dt(torch.arange(8.0).reshape(2, 4), Shard(0))  # equal spec, other object
    assert twin._spec == x._spec and twin._spec is not x._spec
    for _ in range(3):  # the first call fills the caches, the others hit them
        for y in (x, twin):
            outs = (y.detach(), aten.alias.default(y), y.view_as(y), y.view(y.shape))
            assert all(o._spec is y._spec for o in outs), [str(o._spec) for o in outs]
            assert all(o.to_local().data_ptr() == y.to_local().data_ptr() for o in outs)


def test_identity_views_keep_every_layout_without_communication() -> None:
    # Partial(max) survives view_as/view to the same shape (no group here:
    # a reduction would fail), and the output is the input's spec object.
    for p in (Partial("max"), Partial("min"), Partial(), Shard(1), Replicate()):
        x = dt(torch.arange(6.0).reshape(2, 3), p)
        for _ in range(2):
            for y in (x.view_as(x), x.view(x.shape), x.reshape(x.shape)):
                assert y._spec is x._spec, (p, str(y._spec))


def test_detach_shares_the_version_counter_so_autograd_sees_inplace_writes() -> None:
    for _ in range(2):
        x = dt(torch.randn(2, 4)).requires_grad_(True)
        y = x.sin()  # saves x for backward
        x.detach().mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.to_local().sum().backward()


def test_scalar_argument_types_are_part_of_the_cache_key() -> None:
    x = dt(torch.arange(4), Shard(0))
    for _ in range(2):
        for exponent, dtype in ((2, torch.int64), (2.0, torch.float32), (True, torch.int64)):
            y = x**exponent
            assert y.dtype == y.to_local().dtype == dtype, (exponent, y.dtype)


def test_float_scalars_share_one_fast_entry_and_use_the_current_value() -> None:
    x = dt(torch.ones(2, 3), Shard(0))
    x * 0.5
    before = len(TABLE)
    for scale in (0.25, 3.0, -1.5):
        y = x * scale
        assert float(y.to_local()[0, 0]) == scale and y.placements == (Shard(0),)
    assert len(TABLE) == before
    xi = dt(torch.ones(2, dtype=torch.int64), Shard(0))
    assert (xi * 2).dtype == torch.int64 and (xi * 2.5).dtype == torch.float32


def test_fast_path_results_match_the_general_path() -> None:
    a = dt(torch.randn(4, 3), Shard(1))  # global 4 x 3n
    b = dt(torch.randn(4, 3))
    ops = {
        "add": lambda: a + a,
        "mul scalar": lambda: a * 0.5,
        "mm": lambda: torch.mm(a.transpose(0, 1), b),
        "sum": lambda: a.sum(0),
        "view": lambda: a.view(2, 2, a.shape[1]),
        "split": lambda: a.split(2),
        "max.dim": lambda: a.max(0),
        "t": lambda: a.t(),
    }
    for name, fn in ops.items():
        forget()
        first = fn()  # the general path, which makes plans with fast forms
        assert _fast_ops(), f"{name}: no fast form"
        second = fn()
        for f, s in zip(_leaves(first), _leaves(second), strict=True):
            assert type(f) is type(s) is DTensor, name
            assert f._spec == s._spec, (name, str(f._spec), str(s._spec))
            assert f.shape == s.shape and f.stride() == s.stride() and f.dtype == s.dtype
            torch.testing.assert_close(f.to_local(), s.to_local(), rtol=0, atol=0)
            assert f.to_local().shape == f._spec.local_block(COORD)[0], name


def test_inplace_fast_path_returns_self_and_keeps_its_spec() -> None:
    x = dt(torch.zeros(2, 4), Shard(0))
    spec = x._spec
    for i in range(1, 4):
        assert x.add_(1) is x
        assert x._spec is spec and float(x.to_local()[0, 0]) == i


def test_linear_ops_on_partials_stay_partial_on_the_fast_path() -> None:
    forget()
    p = dt(torch.ones(2), Partial())
    q = p * 3.0  # linear: stays partial, no communication
    assert q.placements == (Partial(),)
    assert (p * 3.0).placements == (Partial(),)
    assert aten.mul.Tensor._op in _fast_ops()


def test_bindings_stand_in_only_where_they_call_the_same_overload() -> None:
    t = torch.ones(2, 3)
    assert _binding(aten.add.Tensor, (t, t), {}) is torch._C._VariableFunctions.add
    # torch.add(t, 2) resolves to add.Tensor (a wrapped number), not add.Scalar.
    assert _binding(aten.add.Scalar, (t, 2), {}) is aten.add.Scalar._op
    assert _binding(aten.add_.Tensor, (t, t), {}) is torch._C.TensorBase.add_
    # A tensor that is not a plain torch.Tensor is never probed.
    assert _binding(aten.neg.default, (torch.nn.Parameter(t),), {}) is aten.neg.default._op


def test_one_record_per_overload_built_once_and_agreeing_with_the_rules() -> None:
    from dtensor.dispatch.op import LIST, NONE, ONE, SELF, TUPLE
    from dtensor.sharding import writes_self

    x = dt(torch.ones(2, 4), Shard(0))
    forget()
    for _ in range(3):
        x.add_(1), x * 2, x.split(2, 1), x.max(1)
    info = record(aten.add_.Tensor)
    assert info is record(aten.add_.Tensor)  # one record, kept
    expect = {
        aten.add_.Tensor: (True, SELF),
        aten.mul.Tensor: (False, ONE),
        aten.split.Tensor: (False, LIST),
        aten.max.dim: (False, TUPLE),
        aten._foreach_add_.List: (True, NONE),
        aten.copy_.default: (True, SELF),
        aten.add.out: (False, ONE),
    }
    for op, (inplace, returns) in expect.items():
        r = record(op)
        # "In place" has one definition, which the pointwise rule reads too.
        assert r.inplace == inplace == writes_self(op), op
        assert r.returns == returns, (op, r.returns)
    assert not record(aten.bernoulli.p).host_probe and record(aten.add.Tensor).host_probe


def test_list_arguments_key_the_call_table_and_run_fast() -> None:
    forget()
    x = dt(torch.arange(6.0).reshape(2, 3))
    y = dt(torch.ones(2, 3))
    outs = [torch.cat([x, y], 1) for _ in range(3)]
    assert aten.cat.default._op in _fast_ops()
    for out in outs:
        assert out.placements == (Replicate(),) and out.shape == (2, 6)
        assert torch.equal(out.to_local(), torch.cat([x.to_local(), y.to_local()], 1))
    ps = [dt(torch.zeros(2, 3), Shard(0)) for _ in range(3)]
    gs = [dt(torch.ones(2, 3), Shard(0)) for _ in range(3)]
    for _ in range(3):  # an optimizer-like update: in place, returns nothing
        torch._foreach_add_(ps, gs, alpha=0.5)
    assert aten._foreach_add_.List._op in _fast_ops()
    assert all(torch.equal(p.to_local(), torch.full((2, 3), 1.5)) for p in ps)


def test_results_an_output_mask_leaves_out_stay_none_on_every_call() -> None:
    x, g = torch.randn(2, 4), torch.randn(2, 4)
    mean, rstd = x.mean(1, keepdim=True), x.var(1, keepdim=True).add(1e-5).rsqrt()
    op = aten.native_layer_norm_backward.default
    want = op(g, x, [4], mean, rstd, None, None, [True, False, False])
    for _ in range(3):  # the later calls take the fast path
        got = op(dt(g), dt(x), [4], dt(mean), dt(rstd), None, None, [True, False, False])
        assert len(got) == 3 and got[1] is None and got[2] is None, got
        torch.testing.assert_close(got[0].to_local(), want[0])


def test_forget_drops_the_records_and_plans_of_the_ops_named() -> None:
    x = dt(torch.ones(2, 4), Shard(0))
    x + x, x * x
    forget(frozenset({aten.add.Tensor}))
    assert aten.add.Tensor._op not in _fast_ops() and aten.mul.Tensor._op in _fast_ops()
    from dtensor.dispatch.cache import OPS

    assert aten.add.Tensor._op not in OPS and aten.mul.Tensor._op in OPS
    forget()
    assert not TABLE and not OPS


def _fast_ops() -> set:
    """The ops (handles) the call table holds plans with fast forms for."""
    return {k[0] for k, plan in list(TABLE.items()) if plan.fast is not None}


def _binding(func, loc, kwargs):
    return record(func).binding(list(loc), kwargs)


def _leaves(x):
    return list(x) if isinstance(x, (tuple, list)) else [x]


def test_host_probes_skip_random_ops_and_traces() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert record(aten.add.Tensor).host_probe_ok()
    # A probe must not draw from a generator, nor run under a tracing mode.
    assert not record(aten.bernoulli.p).host_probe_ok()
    assert not record(aten.native_dropout.default).host_probe_ok()
    with Passthrough():
        assert not record(aten.add.Tensor).host_probe_ok()


def test_bindings_for_large_tensors_agree_with_the_local_shape_probe() -> None:
    # The probe's stand-ins (meta tensors) keep the blocks' own shapes, large
    # or not: arguments that only fit those shapes (view sizes) are probed too.
    big = torch.ones(128, 64)
    forget()
    assert _binding(aten.mul.Tensor, (big, big), {}) is torch._C._VariableFunctions.mul
    assert _binding(aten.view.default, (big, [64, 128]), {}) is torch._C.TensorBase.view
    forget()


def test_a_large_product_beside_a_small_bias_runs_no_kernel_in_the_probe(monkeypatch) -> None:
    # linear's addmm: a 512 bias beside 64x128 and 128x512 blocks. The probe
    # stops the call where it reaches the dispatcher; a run of addmm's meta
    # kernel (a Python decomposition) would cost ~1 ms on a model's first step.
    from dtensor.dispatch import binding

    class NoRun(binding._Record):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            raise AssertionError(f"the probe ran {func}")

    monkeypatch.setattr(binding, "_Record", NoRun)
    w = torch.ones(512, 128)
    forget()
    found = _binding(aten.addmm.default, (torch.ones(512), torch.ones(64, 128), w.t()), {})
    assert found is torch._C._VariableFunctions.addmm
    forget()


# Rule registration ------------------------------------------------------------
def test_registering_a_rule_replaces_what_dispatch_cached_for_the_op() -> None:
    from dtensor import Sharding, register_rule

    lib = torch.library.Library("dtensor_cache_test", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
    op = torch.ops.dtensor_cache_test.twice.default
    x = dt(torch.arange(4.0))

    def outputs(placements):
        def rule(call):
            return Sharding(inputs=(None,), outputs=(placements,))

        return rule

    # No rule yet: the replicate fallback (cached as "no rule" for the op).
    assert [op(x).placements for _ in range(2)] == [(Replicate(),)] * 2
    # Every replica holds 2x, so their average is 2x: Partial(avg) is exact.
    register_rule(op)(outputs((Partial("avg"),)))
    assert [op(x).placements for _ in range(3)] == [(Partial("avg"),)] * 3
    assert op._op in _fast_ops()  # now served by the fast path
    register_rule(op)(outputs((Replicate(),)))
    assert [op(x).placements for _ in range(2)] == [(Replicate(),)] * 2
    # A packet's rule counts for its overloads, yet the overload's own comes first.
    register_rule(torch.ops.dtensor_cache_test.twice)(outputs((Partial("avg"),)))
    assert op(x).placements == (Replicate(),)
    torch.testing.assert_close(op(x).to_local(), torch.arange(4.0) * 2)


_WORLD_GONE = """
import tempfile, torch, torch.distributed as dist
def world():
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1),
                            rank=0, world_size=1)
world()
import dtensor
from dtensor import _comm
from dtensor.dispatch import cache
mesh = dtensor.DeviceMesh("cpu", [0])
x = dtensor.distribute_tensor(torch.ones(4), mesh, [dtensor.Replicate()])
_ = x + x
_comm.group_for((0,))
assert cache.TABLE, "no plan was cached"
assert len(_comm._groups) == 1, _comm._groups
dist.destroy_process_group()  # the world ends: its plans and groups go
assert not cache.TABLE, f"plans of the destroyed world kept: {len(cache.TABLE)}"
assert not _comm._groups, _comm._groups
world()
y = dtensor.distribute_tensor(torch.ones(4), dtensor.DeviceMesh("cpu", [0]), [dtensor.Replicate()])
assert torch.equal((y + y).to_local(), torch.full((4,), 2.0))
print("OK")
"""


def test_a_destroyed_worlds_plans_and_groups_are_forgotten() -> None:
    """World lifetime goes through the one invalidation path (cache.forget):
    plans hold meshes, meshes hold their world's groups."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, "-c", _WORLD_GONE], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
