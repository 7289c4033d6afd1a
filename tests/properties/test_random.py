"""Covers: dtensor/_random_ops.py and dtensor/random.py through DTensors.

Property: a random op on a DTensor gives, for every mesh and placements, the
full tensor the single-device op gives under the same seed (dtensor: the
plain-tensor functions of ``dtensor.random``; torch: ``torch.manual_seed``
then the plain torch op).
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from dtensor.testing import (
    assert_matches_single_device,
    dtypes,
    mesh_layouts,
    placements,
    tensor_shapes,
)

KINDS = ("rand", "randn", "uniform_", "normal_", "dropout")


def _dtensor_random(kind, shape, dtype, mesh, ps, impl, seed):
    import dtensor
    from dtensor import random as rng

    rng.manual_seed(seed)
    if kind in ("rand", "randn"):
        return getattr(dtensor, kind)(*shape, dtype=dtype, device_mesh=mesh,
                                      placements=impl.placements(ps))
    base = torch.ones(shape, dtype=dtype)
    dt = impl.from_blocks(base, mesh, ps)
    if kind == "dropout":
        return torch.nn.functional.dropout(dt, p=0.5, training=True)
    return getattr(dt, kind)()


def _dtensor_reference(kind, shape, dtype, seed):
    from dtensor import random as rng

    rng.manual_seed(seed)
    if kind in ("rand", "randn"):
        return getattr(rng, kind)(*shape, dtype=dtype)
    base = torch.ones(shape, dtype=dtype)
    if kind == "dropout":
        return rng.dropout(base, p=0.5, training=True)
    return getattr(rng, kind)(base)


def _torch_random(kind, shape, dtype, mesh, ps, impl, seed):
    from torch.distributed import tensor as tdt

    torch.manual_seed(seed)
    if kind in ("rand", "randn"):
        return getattr(tdt, kind)(shape, dtype=dtype, device_mesh=mesh,
                                  placements=impl.placements(ps))
    dt = impl.from_blocks(torch.ones(shape, dtype=dtype), mesh, ps)
    if kind == "dropout":
        return torch.nn.functional.dropout(dt, p=0.5, training=True)
    return getattr(dt, kind)()


def _torch_reference(kind, shape, dtype, seed):
    torch.manual_seed(seed)
    if kind in ("rand", "randn"):
        return getattr(torch, kind)(shape, dtype=dtype)
    base = torch.ones(shape, dtype=dtype)
    if kind == "dropout":
        return torch.nn.functional.dropout(base, p=0.5, training=True)
    return getattr(base, kind)()


@given(data=st.data())
def test_random_ops_equal_the_single_device_stream(n_ranks, world, impl, data):
    layout = data.draw(mesh_layouts(world_size=world.size))
    kind = data.draw(st.sampled_from(KINDS))
    shape = data.draw(tensor_shapes())
    dtype = data.draw(dtypes(include=(torch.float32, torch.float64, torch.bfloat16)))
    # Partial outputs of random factories are defined for sum (value on
    # coordinate 0); in-place ops write the drawn value, whatever the layout.
    ps = data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=len(shape),
                              reduce_ops=("sum",)))
    seed = data.draw(st.integers(0, 2**31 - 1))
    mesh = impl.mesh(layout)
    run, ref = ((_dtensor_random, _dtensor_reference) if impl.name == "dtensor"
                else (_torch_random, _torch_reference))
    out = run(kind, shape, dtype, mesh, ps, impl, seed)
    expected = ref(kind, shape, dtype, seed)
    assert_matches_single_device(out, expected, rtol=0, atol=0,
                                 msg=f"{kind}{shape} on {[str(p) for p in ps]}")
