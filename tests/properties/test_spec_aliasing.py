"""Covers: dtensor/spec.py, dtensor/placement.py (immutability) and the
metadata fast paths of dtensor/tensor.py and dtensor/dispatch/.

Properties: ``detach``, ``alias`` and ``view_as`` return the input's spec
object; specs and placements cannot be mutated; writing into an output's data
in place never changes any spec; two results of the same (cached) op share no
mutable state.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given
from hypothesis import strategies as st

from dtensor.testing import assert_matches_single_device, distributed_inputs


def _inputs(data, world, impl, **kw):
    kw.setdefault("mixed_reduce_ops", impl.mixed_partials)
    return data.draw(distributed_inputs(world_size=world.size, mesh_factory=impl.mesh, **kw))


@given(data=st.data())
def test_metadata_ops_return_the_input_spec_object(n_ranks, world, impl, data):
    inp = _inputs(data, world, impl)
    x = impl.from_blocks(inp.tensor, inp.mesh, inp.placements)
    outs = {
        "detach": x.detach(),
        "alias": torch.ops.aten.alias.default(x),
        "view_as": x.view_as(x),
    }
    shared = {name: y._spec is x._spec for name, y in outs.items()}
    assert all(shared.values()), f"output spec is not the input's spec object: {shared}"
    for y in outs.values():
        torch.testing.assert_close(y.to_local(), x.to_local(), rtol=0, atol=0,
                                   equal_nan=True)


def _snapshot(spec):
    return (tuple(spec.placements), tuple(spec.tensor_meta.shape),
            tuple(spec.tensor_meta.stride), spec.tensor_meta.dtype, hash(spec))


@given(data=st.data())
def test_specs_and_placements_cannot_be_mutated(n_ranks, world, impl, data):
    inp = _inputs(data, world, impl)
    x = impl.from_blocks(inp.tensor, inp.mesh, inp.placements)
    y, z = x.detach(), x.detach()
    before = _snapshot(z._spec)
    other = tuple(impl.Replicate() for _ in x.placements)
    mutated = []
    for attr, value in (("placements", other), ("tensor_meta", None), ("mesh", None)):
        old = getattr(y._spec, attr)
        try:
            setattr(y._spec, attr, value)
        except (AttributeError, TypeError, dataclasses.FrozenInstanceError):
            continue
        mutated.append(attr)
        setattr(y._spec, attr, old)  # undo, so later examples see sane state
    p = x.placements[0]
    for attr in ("dim", "reduce_op"):
        if hasattr(p, attr):
            try:
                setattr(p, attr, getattr(p, attr))
            except (AttributeError, TypeError, dataclasses.FrozenInstanceError):
                continue
            mutated.append(f"placement.{attr}")
    mesh = x.device_mesh
    for attr in ("shape", "ndim", "ranks", "device_type", "mesh_dim_names"):
        if impl.name == "dtensor" and hasattr(mesh, attr):
            try:
                setattr(mesh, attr, getattr(mesh, attr))
            except (AttributeError, TypeError, dataclasses.FrozenInstanceError):
                continue
            mutated.append(f"mesh.{attr}")
    try:
        x.placements[0] = impl.Replicate()
        mutated.append("placements[0]")
    except TypeError:
        pass
    assert not mutated, f"a DTensor's spec could be mutated: {mutated}"
    assert _snapshot(z._spec) == before


@given(data=st.data())
def test_inplace_writes_never_change_specs_or_other_results(n_ranks, world, impl, data):
    inp = _inputs(data, world, impl)
    x = impl.from_blocks(inp.tensor, inp.mesh, inp.placements)
    one = torch.ones((), dtype=inp.tensor.dtype)
    y = x * one  # the same op twice: the second is a propagation-cache hit
    z = x * one
    expected = inp.tensor * one
    specs = [x._spec, y._spec, z._spec]
    snaps = [_snapshot(s) for s in specs]
    a, b = y.to_local(), z.to_local()
    if a.numel() and b.numel():
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr(), (
            "two results of the same op share their local storage")
    if inp.tensor.dtype == torch.bool:
        y.logical_not_()
    else:
        y.add_(1)
    assert [_snapshot(s) for s in specs] == snaps, "an in-place write changed a spec"
    assert_matches_single_device(z, expected, msg="the other result of the same op")
    assert_matches_single_device(x, inp.tensor, msg="the input")
