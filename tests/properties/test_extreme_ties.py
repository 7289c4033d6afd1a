"""Covers: dtensor/rules/extremes.py along one dim (``max.dim``,
``min.dim``, ``argmax``, ``argmin``), through the public ops.

Property: on a tensor holding two values only (so every extreme is held by
several elements, on several ranks, signed zeros included for floats),
sharded along the reduced dim on the widest mesh axis, the values and the
indices equal single device on every rank: a tie goes to the first index, as
torch returns it. Drawn values of the other properties rarely tie across
ranks; a rule that sends a tie to another rank's index passes them.
"""

from __future__ import annotations

import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from dtensor.placement import Shard
from dtensor.testing import assert_matches_single_device, mesh_layouts, placements, tensors
from dtensor.testing.strategies import tensor_shapes

_OPS = {
    "max.dim": lambda x, d, k: tuple(x.max(d, keepdim=k)),
    "min.dim": lambda x, d, k: tuple(x.min(d, keepdim=k)),
    "argmax": lambda x, d, k: (x.argmax(d, keepdim=k),),
    "argmin": lambda x, d, k: (x.argmin(d, keepdim=k),),
}


def _two_values(x: torch.Tensor) -> torch.Tensor:
    """0 and 1 only; for floats every other zero negative (-0 ties +0)."""
    v = x.remainder(2)
    if v.is_floating_point():
        odd = torch.arange(v.numel()).reshape(v.shape) % 2 == 1
        v = torch.where((v == 0) & odd, torch.tensor(-0.0, dtype=v.dtype), v)
    return v


@given(data=st.data())
def test_ties_along_a_sharded_dim_go_to_the_first_index(n_ranks, world, impl, data):
    layout = data.draw(mesh_layouts(world_size=world.size), label="layout")
    shape = data.draw(tensor_shapes(min_dims=1, max_dims=3), label="shape")
    dtype = data.draw(st.sampled_from((torch.float32, torch.float64, torch.int64)),
                      label="dtype")
    x = _two_values(data.draw(tensors(shape=shape, dtype=dtype, fills=("small",)), label="x"))
    dim = data.draw(st.integers(0, len(shape) - 1), label="dim")
    keepdim = data.draw(st.booleans(), label="keepdim")
    name = data.draw(st.sampled_from(sorted(_OPS)), label="op")
    ps = list(data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=len(shape),
                                   allow_partial=False), label="placements"))
    widest = max(range(layout.ndim), key=lambda a: layout.shape[a])
    ps[widest] = Shard(dim)
    fn = _OPS[name]
    try:
        expected = fn(x, dim, keepdim)
    except (RuntimeError, IndexError):  # an empty reduced dim: no extreme
        assume(False)
    out = fn(impl.from_blocks(x, impl.mesh(layout), tuple(ps)), dim, keepdim)
    what = f"{name}(dim={dim}, keepdim={keepdim}) of {list(shape)} {dtype} as {ps}"
    for i, (o, e) in enumerate(zip(out, expected, strict=True)):
        assert_matches_single_device(o, e, msg=f"{what}: output {i}")
