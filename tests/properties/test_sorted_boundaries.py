"""Covers: dtensor/rules/bucketize.py (``bucketize``, ``searchsorted``) on
DTensors, through the public ops.

Property, on 1-D to 3-D meshes over the world: sorted boundaries (1-D, or
batched 2-D rows for ``searchsorted``; repeated boundaries, empty rows and
lengths uneven over the mesh axes included) cut along their sorted dim on a
drawn mesh axis, any placements (``Partial`` included) on the others, and
values (int or float, a tensor or a Python scalar) below, between, above and
equal to boundaries, whole or sharded: ``torch.bucketize`` and
``torch.searchsorted`` with ``right`` (or ``side``) and ``out_int32`` each
way equal single device exactly on every rank (values, local shape, offset,
placements through the per-rank oracle).

Few values beside long boundaries make the rule keep the boundaries cut and
add up the blocks' counts (``Partial(sum)``), many make it gather the
boundaries; the draws lean to few values so both happen in every run.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtensor.placement import Replicate, Shard
from dtensor.testing import assert_matches_single_device, mesh_layouts, placements
from dtensor.testing.impl import exact_split

_DTYPES = (torch.int64, torch.float32, torch.float64)
_MAX_LENGTH = 12  # over 2, 3, 4 or 8 ranks: uneven and empty blocks
# right=..., side=... (searchsorted only), the default
_SIDES = ({"right": True}, {"right": False}, {"side": "right"}, {"side": "left"}, {})


def _boundaries(data, batch: int | None) -> torch.Tensor:
    """Rows of integers sorted along the last dim, steps of 0 (repeats) to 2
    (a gap a value can fall in)."""
    length = data.draw(st.integers(0, _MAX_LENGTH), label="length")
    rows = 1 if batch is None else batch
    steps = data.draw(st.lists(st.lists(st.integers(0, 2), min_size=length, max_size=length),
                               min_size=rows, max_size=rows), label="steps")
    start = data.draw(st.integers(-3, 3), label="start")
    dtype = data.draw(st.sampled_from(_DTYPES), label="boundaries dtype")
    seq = (start + torch.tensor(steps, dtype=torch.int64).reshape(rows, length).cumsum(-1))
    return (seq if batch is not None else seq[0]).to(dtype)


def _value_grid(seq: torch.Tensor, dtype: torch.dtype) -> st.SearchStrategy:
    """Values from two below the smallest boundary to two above the largest,
    in halves for floats: equal to a boundary, between two, or outside."""
    lo = int(seq.min()) if seq.numel() else 0
    hi = int(seq.max()) if seq.numel() else 0
    if not dtype.is_floating_point:
        return st.integers(lo - 2, hi + 2)
    return st.integers(2 * (lo - 2), 2 * (hi + 2)).map(lambda k: k / 2)


def _values(data, seq: torch.Tensor, batched: bool):
    """A Python scalar (1-D boundaries only) or a tensor: mostly few values,
    so the rule keeps the boundaries cut."""
    dtype = data.draw(st.sampled_from(_DTYPES), label="values dtype")
    grid = _value_grid(seq, dtype)
    if not batched and data.draw(st.booleans(), label="a Python scalar"):
        v = data.draw(grid, label="value")
        return float(v) if dtype.is_floating_point else int(v)
    if batched:
        shape = (seq.shape[0], data.draw(st.integers(0, 3), label="values per row"))
    else:
        shape = tuple(data.draw(st.lists(st.integers(0, 3), max_size=2), label="values shape"))
    n = math.prod(shape)
    flat = data.draw(st.lists(grid, min_size=n, max_size=n), label="values")
    return torch.tensor(flat, dtype=torch.float64).to(dtype).reshape(shape)


def _placements(data, layout, impl, ndim: int, label: str, *, partial: bool = True):
    return data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=ndim, allow_partial=partial,
                                mixed_reduce_ops=impl.mixed_partials), label=label)


@settings(max_examples=2 * settings.default.max_examples)
@given(data=st.data())
def test_counts_among_cut_sorted_boundaries_match_single_device(n_ranks, world, impl, data):
    layout = data.draw(mesh_layouts(world_size=world.size), label="layout")
    op = data.draw(st.sampled_from(("bucketize", "searchsorted")), label="op")
    batch = None
    if op == "searchsorted" and data.draw(st.booleans(), label="batched"):
        batch = data.draw(st.integers(0, 3), label="rows")
    seq = _boundaries(data, batch)
    # the sorted dim cut on one drawn axis, anything on the others
    ps = _placements(data, layout, impl, seq.ndim, "boundaries placements")
    cut = data.draw(st.integers(0, layout.ndim - 1), label="axis cutting the boundaries")
    ps = tuple(Shard(seq.ndim - 1) if i == cut else p for i, p in enumerate(ps))
    x = _values(data, seq, batch is not None)
    if isinstance(x, torch.Tensor):
        whole = data.draw(st.booleans(), label="values whole")
        px = (Replicate(),) * layout.ndim if whole else _placements(
            data, layout, impl, x.ndim, "values placements")
    side = data.draw(st.sampled_from(_SIDES[:2] if op == "bucketize" else _SIDES), label="side")
    out_int32 = data.draw(st.booleans(), label="out_int32")

    def call(s, v):
        if op == "bucketize":
            return torch.bucketize(v, s, out_int32=out_int32, **side)
        return torch.searchsorted(s, v, out_int32=out_int32, **side)

    expected = call(seq, x)
    mesh = impl.mesh(layout)
    tensors = [seq] + ([x] if isinstance(x, torch.Tensor) else [])
    exact = all(exact_split(t) for t in tensors)
    ds = impl.from_blocks(seq, mesh, ps, exact=exact)
    dx = impl.from_blocks(x, mesh, px, exact=exact) if isinstance(x, torch.Tensor) else x
    where = (f"{op}({'values' if isinstance(x, torch.Tensor) else repr(x)}, "
             f"out_int32={out_int32}, {side}) of {seq.dtype}{list(seq.shape)} as "
             f"{[str(p) for p in ps]}"
             + (f", {x.dtype}{list(x.shape)} values as {[str(p) for p in px]}"
                if isinstance(x, torch.Tensor) else "") + f" over {layout}")
    assert_matches_single_device(call(ds, dx), expected, msg=where)
