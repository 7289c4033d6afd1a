"""Covers: every rule registered in dtensor/rules/ (``dtensor.rules.RULES``),
through calls built from the ops' own schemas
(``dtensor.testing.schema_calls``), so a new rule is drawn with no test
written for it.

- every registered rule has a schema call (or a stated reason it has none);
- every registered rule's calls, once on a 1-D mesh with the first operand
  sharded, equal single device on every rank and leave an entry in the
  coverage record (``dtensor.testing.coverage``): a rule that no property
  reaches fails here;
- property: a drawn rule's call, on drawn meshes (1-D to 3-D) and placements
  (Shard of every dim, Replicate, Partial of every reduce op for floating
  operands), equals single device on every rank (values, local shape,
  offset, placements through the per-rank oracle);
- property: the same, drawn among the scatter family and batch norm only,
  whose passing Partial kinds depend on every operand's kind.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dtensor.placement import Replicate, Shard
from dtensor.testing import assert_matches_single_device, mesh_layouts, placements, tensors
from dtensor.testing.coverage import NO_SCHEMA_CALL
from dtensor.testing.impl import once_per_value
from dtensor.testing.schema_calls import example_tensors, overloads, sample_calls, uncallable

_TOL = {"rtol": 1e-4, "atol": 1e-4}


def _calls():
    return sorted(sample_calls().items(), key=lambda kv: str(kv[0]))


def _outputs(func, out, tensors):
    """The tensors to compare: the results, or (no result) the written operands."""
    if out is None or (isinstance(out, (list, tuple)) and not out):
        return list(tensors)
    if isinstance(out, (list, tuple)):
        return list(out)
    return [out]


def _partial_operand(dts) -> bool:
    return any(type(p).__name__ == "Partial" for d in dts
               for p in getattr(d, "placements", ()))


def _reference(func, call, plain):
    """``(result, the tensors to compare)`` on one device, None if it raises."""

    def run():
        ref = [t.clone() for t in plain]  # an op without a result writes them
        try:
            expected = call.run(ref)
        except Exception:  # noqa: BLE001 - undefined on one device for these values
            return None
        return expected, _outputs(func, expected, ref)

    if torch.Tag.nondeterministic_seeded in func.tags:
        return run()  # every rank draws, so its generator stays in step
    # By value, not id(call): a simulated rank draws its own copy of the call,
    # and a freed copy's id can come back as another call's.
    key = ("schema call", str(func), call.slots, repr(call.args), tuple(sorted(call.kwarg_names)))
    return once_per_value(key, plain, run)


def _compare(func, call, plain, dts, what):
    ref = _reference(func, call, plain)
    if ref is None:
        assume(False)
    expected, exp = ref
    out = call.run(dts)
    if not isinstance(expected, (torch.Tensor, list, tuple)) and expected is not None:
        assert out == expected, f"{what}: got {out!r}, single device {expected!r}"
        return
    if _partial_operand(dts) and any(e.is_floating_point() and not bool(e.isfinite().all())
                                     for e in exp if isinstance(e, torch.Tensor)):
        # A non-finite result from Partial(sum) pieces is the runtime limit
        # test_ops.py::test_partial_times_inf_is_inf pins (strict xfail):
        # pieces of a finite value times (or over) inf or 0 give nan where the
        # sum gives inf. This sweep checks rules, so it leaves those draws out.
        assume(False)
    got = _outputs(func, out, dts)
    assert len(got) == len(exp), f"{what}: {len(got)} outputs, single device {len(exp)}"
    for i, (g, e) in enumerate(zip(got, exp, strict=True)):
        if "empty" in str(func):  # uninitialised values: shape and dtype only
            assert tuple(g.shape) == tuple(e.shape) and g.dtype == e.dtype, (
                f"{what}: output {i} is {g.dtype}{list(g.shape)}, expected "
                f"{e.dtype}{list(e.shape)}")
            continue
        assert_matches_single_device(g, e, **_TOL, msg=f"{what}: output {i}")


def test_every_registered_rule_has_a_schema_call():
    missing = [str(f) for key in uncallable() for f in overloads(key)
               if str(f) not in NO_SCHEMA_CALL]
    assert not missing, (
        f"no call could be built from the schema of {missing}: teach "
        "dtensor/testing/schema_calls.py its argument (or shape pattern), or add the "
        "rule to NO_SCHEMA_CALL with the reason")


# The sweep in parts, each a set of rule keys with all their calls, so a
# parallel run (``-n``) spreads it over workers: at 1,024 simulated ranks one
# call costs about 1.5 s, and the whole sweep in one test held one worker for
# most of the suite.
_PARTS = 4


def _part_calls(part: int):
    """The calls of part ``part``'s rule keys, and those keys."""
    from dtensor.rules import RULES

    keys = sorted(RULES, key=str)[part::_PARTS]
    mine = {str(f) for key in keys for f in overloads(key)}
    return [(f, c) for f, c in _calls() if str(f) in mine], keys


@pytest.mark.parametrize("part", range(_PARTS))
def test_every_registered_rule_runs_and_records_an_entry(n_ranks, world, impl, part):
    from dtensor.testing import MeshLayout, coverage

    mesh = impl.mesh(MeshLayout((world.size,), tuple(range(world.size))))
    calls, keys = _part_calls(part)
    assert calls, f"part {part} of {_PARTS}: no schema call"
    errors = []
    for func, call in calls:
        plain = example_tensors(call)
        ps = [(Shard(0),) if i == 0 and t.ndim and t.dtype.is_floating_point
              else (Replicate(),) for i, t in enumerate(plain)]
        dts = [impl.from_blocks(t, mesh, p) for t, p in zip(plain, ps, strict=True)]
        try:
            _compare(func, call, plain, dts, f"{func} on {[str(p[0]) for p in ps]}")
        except AssertionError as e:
            errors.append(e)
    if errors:
        raise errors[0]
    if impl.name != "dtensor":
        return
    no_entry = [str(key) for key in keys
                if not any(str(f) in coverage.RECORD for f in overloads(key))
                and not all(str(f) in NO_SCHEMA_CALL for f in overloads(key))]
    assert not no_entry, (
        f"rank {world.rank}: registered rules with no coverage entry after their "
        f"schema calls ran: {no_entry} (dispatch never asked the rule)")


def test_the_sweep_parts_hold_every_schema_call():
    parts = [_part_calls(k) for k in range(_PARTS)]
    assert sum(len(c) for c, _ in parts) == len(_calls())
    assert len({str(key) for _, keys in parts for key in keys}) == sum(len(k) for _, k in parts)


@settings(max_examples=4 * settings.default.max_examples)
@given(data=st.data())
def test_schema_drawn_calls_match_single_device(n_ranks, world, impl, data):
    _drawn_call_matches(world, impl, data, _calls())


def _write_calls():
    """Calls of the ops that write into a copy of ``self`` (scatter family)
    and batch norm: which Partial kinds pass depends on the op and on every
    operand's kind, so they get draws of their own (among all rules, one of
    them is drawn a few times a run)."""
    from dtensor.rules import batch_norm, scatter

    ops = set(scatter.RULES) | set(batch_norm.RULES)
    return [(f, c) for f, c in _calls() if f in ops or f.overloadpacket in ops]


@settings(max_examples=4 * settings.default.max_examples)
@given(data=st.data())
def test_scatter_family_and_batch_norm_calls_match_single_device(n_ranks, world, impl, data):
    _drawn_call_matches(world, impl, data, _write_calls())


def _drawn_call_matches(world, impl, data, calls):
    func, call = data.draw(st.sampled_from(calls), label="op")
    layout = data.draw(mesh_layouts(world_size=world.size), label="layout")
    plain, ps = [], []
    for i, (shape, dt) in enumerate(zip(call.shapes, call.dtypes, strict=True)):
        if dt.is_floating_point:
            t = data.draw(tensors(shape=shape, dtype=dt, fills=("arange", "small", "normal")),
                          label=f"operand {i}")
        else:  # indices and masks keep the schema call's values
            t = example_tensors(call)[i]
        p = data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=t.ndim,
                                 allow_partial=dt.is_floating_point,
                                 mixed_reduce_ops=impl.mixed_partials),
                      label=f"operand {i} placements")
        plain.append(t)
        ps.append(p)
    mesh = impl.mesh(layout)
    dts = [impl.from_blocks(t, mesh, p) for t, p in zip(plain, ps, strict=True)]
    _compare(func, call, plain, dts,
             f"{func} on {[[str(q) for q in p] for p in ps]} over {layout}")


@pytest.fixture(autouse=True, scope="module")
def _dtensor_coverage():
    """The coverage record is installed by the conftest; without it (a run
    that bypassed the conftest) install it here so the entry check means
    something."""
    from dtensor.testing import coverage

    coverage.install()
    yield


@pytest.mark.world_size(2)
def test_mse_loss_backward_with_a_full_grad_output_under_mean(world, impl):
    """Found by the schema-drawn property (``reduction=1`` with a grad_output
    of self's shape; autograd passes a 0-d one): the gradient is element-wise
    in grad_output then, so each rank's block uses grad_output's block."""
    from dtensor.testing import MeshLayout

    mesh = impl.mesh(MeshLayout((2,), (0, 1)))
    g, x, t = (torch.arange(16.0).reshape(4, 4) / (i + 1) for i in range(3))
    op = torch.ops.aten.mse_loss_backward.default
    out = op(impl.from_blocks(g, mesh, (Replicate(),)), impl.from_blocks(x, mesh, (Replicate(),)),
             impl.from_blocks(t, mesh, (Shard(0),)), 1)
    assert_matches_single_device(out, op(g, x, t, 1), msg="mse_loss_backward(R, R, S(0), mean)")


@pytest.mark.world_size(2)
@pytest.mark.parametrize("op", ["avg_pool2d", "max_pool2d_with_indices"])
def test_pooling_an_unbatched_input_with_an_empty_channel_block(world, impl, op):
    """Found by the schema sweep on a 16-rank world: PyTorch refuses a 3-D
    (unbatched) pooling input with 0 channels, so a channel shard that leaves
    a rank's block empty must not reach the kernel."""
    import torch.distributed as dist

    from dtensor.testing import MeshLayout

    mesh = impl.mesh(MeshLayout((2,), (0, 1)))
    x = torch.arange(16.0).reshape(1, 4, 4)
    fn = getattr(torch.ops.aten, op).default
    expected = fn(x, [2, 2])
    error = None
    try:  # only rank 1 (the empty block) raises: agree before asserting
        out = fn(impl.from_blocks(x, mesh, (Shard(0),)), [2, 2])
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = e
    failed = torch.tensor([error is not None], dtype=torch.int64)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=world.group)
    if error is not None:
        raise error
    assert not failed.item(), f"{op} of (1, 4, 4) as S(0): another rank raised"
    if isinstance(out, (tuple, list)):
        out, expected = out[0], expected[0]
    assert_matches_single_device(out, expected, msg=f"{op} of (1, 4, 4) as S(0)")
