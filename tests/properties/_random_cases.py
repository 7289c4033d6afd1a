"""Drawn cases of one random op and how the properties of test_random.py run
and check them: the op on DTensors, its single-device result, and the
bit-for-bit comparison of every rank's block and full tensor."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from hypothesis import event
from hypothesis import strategies as st

from _random_ops import (EXACT_REDUCE, FACTORY, FLOATS, INPLACE, LIKE, OPS_BY_NAME, PROBS,
                         VALUES, Op, ops_for)
from dtensor import random as dtensor_random
from dtensor.testing import (
    agree_on,
    assert_layout,
    assert_local_is_empty,
    assert_matches_single_device,
    mesh_layouts,
    placements,
    tensor_shapes,
    tensors,
)


class Case(NamedTuple):
    """A drawn example: one op with its arguments, layout and input."""

    op: Op
    shape: tuple[int, ...]
    dtype: torch.dtype
    kw: dict
    layout: Any
    ps: tuple
    base: torch.Tensor | None  # the global input (None for factories)
    seed: int


def draw_case(data, impl, world_size: int, *, layout=None, shape=None, allow_partial=True,
               ops=None, ps=None) -> Case:
    op = OPS_BY_NAME[data.draw(st.sampled_from(ops or ops_for(impl)), label="op")]
    if layout is None:
        layout = data.draw(mesh_layouts(world_size=world_size,
                                        allow_sub_meshes=impl.sub_meshes), label="layout")
    if shape is None:
        shape = data.draw(tensor_shapes(), label="shape")
    dtype = data.draw(st.sampled_from(op.dtypes), label="dtype")
    kw = data.draw(op.params(dtype), label="params")
    if ps is None:
        ps = data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=len(shape),
                                  allow_partial=allow_partial, reduce_ops=EXACT_REDUCE,
                                  mixed_reduce_ops=impl.mixed_partials), label="placements")
    base = None
    if op.kind in (INPLACE, LIKE):
        base = torch.zeros(shape, dtype=dtype)
    elif op.kind == PROBS:
        raw = data.draw(tensors(shape=shape, dtype=torch.float64, fills=("arange", "normal")))
        base = torch.sigmoid(raw).to(dtype)
    elif op.kind == VALUES:
        # Partial inputs are split into pieces; each piece * 1/(1-p) must be
        # exact for the sum to be (small integers, or one non-zero piece).
        partial = any(p.is_partial() for p in ps)
        fills = ("small", "normal") if partial else ("arange", "small", "normal")
        base = data.draw(tensors(shape=shape, dtype=dtype, fills=fills))
    if op.name == "bernoulli_(probs)":  # a DTensor of probabilities, or a 0-d tensor
        scalar = data.draw(st.booleans(), label="0-d probabilities")
        raw = data.draw(tensors(shape=() if scalar else shape, dtype=torch.float64,
                                fills=("arange", "normal")), label="probabilities")
        kw = {"p": torch.sigmoid(raw).to(data.draw(st.sampled_from(FLOATS[:3])))}
        if not scalar:
            kw["p_ps"] = data.draw(placements(
                mesh_ndim=layout.ndim, tensor_ndim=len(shape), allow_partial=allow_partial,
                reduce_ops=EXACT_REDUCE, mixed_reduce_ops=impl.mixed_partials),
                label="probability placements")
    seed = data.draw(st.integers(0, 2**63 - 1), label="seed")
    case = Case(op, tuple(shape), dtype, kw, layout, tuple(ps), base, seed)
    _note(case, world_size)
    return case


# (shape, layout, placements, world size) -> every rank's block: world_blocks
_BLOCKS: dict[tuple, tuple] = {}


def world_blocks(shape: tuple, layout, ps: tuple, world_size: int) -> tuple:
    """Every world rank's ``(local shape, offset)`` of ``shape`` laid out as
    ``ps`` on ``layout`` (None outside it), by global rank.

    It does not depend on the asking rank, and a simulated world's ranks
    share it: asked by every rank it is n*n block computations per example
    (26 s of a 34 s random-op test at 1,024 simulated ranks)."""
    from dtensor.spec import local_block

    key = (shape, layout, ps, world_size)
    blocks = _BLOCKS.get(key)
    if blocks is None:
        if len(_BLOCKS) > 256:
            _BLOCKS.clear()
        out: list = [None] * world_size
        for flat, r in enumerate(layout.ranks):
            out[r] = local_block(shape, layout.shape, ps, _unravel(flat, layout.shape))
        blocks = _BLOCKS[key] = tuple(out)
    return blocks


def _unravel(flat: int, shape: tuple) -> tuple:
    coord = []
    for n in reversed(shape):
        flat, c = divmod(flat, n)
        coord.append(c)
    return tuple(reversed(coord))


def _note(case: Case, world_size: int) -> None:
    """Coverage, for --hypothesis-show-statistics: mesh rank, sub-meshes, and
    shards that are uneven or empty."""
    layout = case.layout
    event(f"{layout.ndim}-D mesh" + (" (sub-mesh)" if len(layout.ranks) < world_size else ""))
    sizes = {math.prod(b[0]) for b in world_blocks(case.shape, layout, case.ps, world_size)
             if b is not None}
    if math.prod(case.shape) and 0 in sizes:
        event("an empty shard")
    elif len(sizes) > 1:
        event("uneven shards")
    if any(p.is_partial() for p in case.ps):
        event("partial placement")


def run_case(case: Case, impl, mesh) -> tuple:
    """The op on DTensors (the generator is seeded by the caller)."""
    op = case.op
    if op.kind == FACTORY:
        if impl.name == "dtensor":
            import dtensor as ns
        else:
            from torch.distributed import tensor as ns
        out = op.run(ns, case.shape, case.dtype, case.kw, device_mesh=mesh,
                     placements=impl.placements(case.ps))
    else:
        out = op.run(impl.from_blocks(case.base, mesh, case.ps), op_kwargs(case, impl, mesh))
    return out if isinstance(out, tuple) else (out,)


def op_kwargs(case: Case, impl, mesh) -> dict:
    """The op's arguments; drawn probabilities become a DTensor on ``mesh``."""
    if "p_ps" not in case.kw:
        return case.kw
    return {**case.kw, "p": impl.from_blocks(case.kw["p"], mesh, case.kw["p_ps"])}


def reference(case: Case, impl) -> tuple:
    """The single-device result, drawn from the generator's current state."""
    op = case.op
    if impl.name == "dtensor":
        if op.kind == FACTORY:
            out = op.ref(case.shape, case.dtype, case.kw)
        else:
            out = op.ref(case.base.clone(), case.kw)
    elif op.kind == FACTORY:
        out = op.run(torch, case.shape, case.dtype, case.kw)
    else:
        out = op.run(case.base.clone(), case.kw)
    return out if isinstance(out, tuple) else (out,)


def seed_generator(impl, seed: int) -> None:
    if impl.name == "dtensor":
        dtensor_random.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def generator_state(impl):
    return dtensor_random.get_rng_state() if impl.name == "dtensor" else None


def as_ours(ps) -> tuple:
    """Placements of either implementation as dtensor placements."""
    from dtensor import Partial, Replicate, Shard

    out = []
    for p in ps:
        kind = type(p).__name__
        out.append(Shard(p.dim) if kind == "Shard" else Partial(p.reduce_op)
                   if kind == "Partial" else Replicate())
    return tuple(out)


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose equality is bit equality (floats viewed as ints)."""
    if t.is_floating_point():
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def assert_same_bits(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, (
        f"{what}: got {got.dtype}{list(got.shape)}, expected "
        f"{expected.dtype}{list(expected.shape)}")
    bad = bits_of(got.contiguous()) != bits_of(expected.contiguous())
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements differ "
                             f"bitwise; first at {idx}: got {got[idx].item()!r}, expected "
                             f"{expected[idx].item()!r}")


# NOTE: a rank that fails an assert stops issuing collectives and the others
# hang in their next one. So every test runs all its collectives first
# (``gather_outputs``), then asserts on local data only.
def gather_outputs(outs: tuple, world) -> list[tuple[Any, torch.Tensor | None]]:
    """(output, full tensor on members / None outside) for each output.

    Each rank first checks its blocks' shapes locally (the per-rank oracle)
    and the test's world agrees on the verdict before any ``full_tensor``: a
    block of the wrong shape fails inside ``full_tensor`` on its rank alone
    while the others wait in the collective, a hang that the watchdog ends
    after minutes and that Hypothesis cannot shrink.
    """
    def check() -> None:
        for out in outs:
            assert_layout(out, None, msg="before full_tensor()")

    agree_on(check, world.group, "its block-shape check before full_tensor()")
    return [(out, out.full_tensor() if out.device_mesh.get_coordinate() is not None
             else None) for out in outs]


def check_outputs(gathered: list, expected: tuple, case: Case, layout) -> None:
    """Each output matches the single-device result: this rank's block (local
    data only) and the gathered full tensor, bit for bit."""
    what = f"{case.op.name}{case.kw or ''} {case.dtype} {list(case.shape)} on " \
           f"{[str(p) for p in case.ps]} of {layout}"
    assert len(gathered) == len(expected), what
    # Dropout masks each piece of a Partial(sum) input: a dropped element sums
    # to +0.0 where one device has -0.0 (docs/random.md); zeros compare by value.
    any_zero = case.op.kind == VALUES and any(p.is_partial("sum") for p in case.ps)
    for i, ((out, full), ref) in enumerate(zip(gathered, expected, strict=True)):
        label = what + (f" (output {i})" if len(gathered) > 1 else "")
        if full is None:
            assert_local_is_empty(out.to_local(), ref.dtype, f" {layout}: {label}")
            continue
        if not any(type(p).__name__ == "Partial" for p in out.placements):
            assert_matches_single_device(out, ref, rtol=0, atol=0, msg=label)
        else:  # a piece: its shape, offset and coordinate (no collective)
            assert_layout(out, None, msg=label)
        if any_zero and ref.is_floating_point():
            full, ref = full + 0.0, ref + 0.0  # -0.0 + 0.0 is +0.0; nothing else moves
        assert_same_bits(full, ref, label + ": full_tensor()")

