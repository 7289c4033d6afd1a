"""Covers: dtensor/dispatch/random_ops.py and dtensor/random.py through DTensors.

Properties, on generated meshes (1-D to 3-D, sub-meshes) and placements
(uneven and empty shards, partial inputs), for every random op in ``OPS``:

- the full tensor equals the single-device result under the same seed, bit for
  bit (dtensor: the plain-tensor functions of ``dtensor.random``; torch:
  ``torch.manual_seed`` then the plain torch op), and every rank — members and
  outsiders — leaves the generator where the single-device run leaves it;
- every shape class of a rank's block (empty, one full row, a contiguous
  run of an uneven dim, strided) holds its piece of the stream;
- replicas hold identical locals, and different shards are not copies;
- consecutive ops on different meshes follow the single-device sequence;
- ranks outside a sub-mesh issue no collectives, hold empty locals and stay in
  step, so a later op on the whole world still matches;
- in-place ops on ``Partial`` inputs store what docs/random.md says.

With ``--dtensor-impl=torch`` the same properties run on
``torch.distributed.tensor``; on CPU they are expected to fail (see
/work/shared/FACTS.md), and the property summary reports it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import event, given
from hypothesis import strategies as st

from dtensor import random as _dtensor_random
from dtensor.testing import (
    agree_on,
    assert_layout,
    assert_local_is_empty,
    assert_matches_single_device,
    mesh_layouts,
    placements,
    sub_meshes,
    tensor_shapes,
    tensors,
)
from dtensor.testing.blocks import BLOCK_CLASSES, mid_row_runs, sharded_blocks

pytestmark = pytest.mark.dist_timeout(180)

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INTS = (torch.int64, torch.int32, torch.int16, torch.uint8)
_MANTISSA = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
# Partial inputs whose reduction is exact: Partial(avg) divides a sum of n
# copies by n, which rounds on axes of size 3 (test_inplace_ops_on_partial_inputs).
EXACT_REDUCE = ("sum", "max", "min")

# Op kinds: what the op's input is.
FACTORY = "factory"  # no input: dtensor.rand(..., device_mesh, placements)
INPLACE = "inplace"  # overwrites its input (values irrelevant)
LIKE = "like"  # a fresh tensor laid out like its input (values irrelevant)
PROBS = "probs"  # its input holds probabilities
VALUES = "values"  # its input's values matter (dropout)


class Op(NamedTuple):
    """One random op. ``run`` applies the torch API (to a DTensor of either
    implementation, or to a plain tensor for torch's single-device result);
    ``ref`` is the single-device result under ``dtensor.random``. Factories
    get ``(namespace, shape, dtype, params, **layout)`` instead of a tensor.
    ``bits`` bounds -log2 of the chance that one element of two independent
    draws agrees (used to tell shards apart)."""

    name: str
    kind: str
    dtypes: tuple[torch.dtype, ...]
    params: Callable[[torch.dtype], st.SearchStrategy[dict]]
    run: Callable[..., Any]
    ref: Callable[..., Any]
    bits: Callable[[torch.dtype, dict], float]
    torch_api: bool = True  # torch.distributed.tensor has it


def _rng():
    return _dtensor_random


def _none(dtype):
    return st.just({})


def _float_bits(dtype, kw):
    return _MANTISSA[dtype] - 3  # generous: normal values cluster near 0


def _span_bits(span: int) -> float:
    return math.log2(span) - 1 if span > 1 else 0.0


def _bernoulli_bits(p: float) -> float:
    return -math.log2(p * p + (1 - p) * (1 - p))


def _int_max(dtype) -> int:
    if dtype.is_floating_point:
        return 2 ** _MANTISSA[dtype]  # integers above are not exact
    return int(torch.iinfo(dtype).max)


def _int_min(dtype) -> int:
    return 0 if dtype in (torch.uint8, torch.bool) or dtype.is_floating_point else -5


def _bounds(dtype):
    """(low, high) with low < high inside dtype's exact integer range."""
    spans = [1, 2, 10, 2**16, 2**16 + 1, 2**20, 2**31, 2**40]
    hi_max = _int_max(dtype) + 1
    return st.tuples(st.integers(_int_min(dtype), 3), st.sampled_from(spans)).map(
        lambda t: {"low": t[0], "high": min(t[0] + t[1], hi_max)})


def _random_from_params(dtype):
    def build(t):
        frm, span, open_top = t
        to = None if open_top else min(frm + span, _int_max(dtype) + 1)
        return {"from": frm, "to": to}

    return st.tuples(st.integers(_int_min(dtype), 3), st.sampled_from([1, 7, 2**17]),
                     st.booleans()).map(build)


def _random_span(dtype) -> int:
    """Number of values of ``random_()`` with no bounds (torch's ranges)."""
    if dtype == torch.bool:
        return 2
    return _int_max(dtype) + 1 if not dtype.is_floating_point else 2 ** _MANTISSA[dtype] + 1


def _dropout_params(dtype):
    return st.fixed_dictionaries({"p": st.sampled_from([0.5, 0.2, 0.0, 1.0, 0.75]),
                                  "train": st.sampled_from([True, False])})


def _dropout_bits(dtype, kw):
    return _bernoulli_bits(1.0 - kw["p"]) if kw["train"] else 0.0


def _full_p(x, p):
    return torch.full(tuple(x.shape), p, dtype=torch.float64)


def _drop_module(x, kw):
    m = torch.nn.Dropout(kw["p"])
    m.train(kw["train"])
    return m(x)


def _native_dropout_ref(x, kw):
    """dropout's values and its keep mask; no draw (hence an all-True mask,
    all-False for p == 1) when dropout does not draw."""
    rng = _rng()
    p, train = kw["p"], kw["train"]
    state = rng.get_rng_state()
    out = rng.dropout(x, p, train)
    if rng.get_rng_state() == state:
        return out.clone(), torch.full(tuple(x.shape), p < 1.0 or not train, dtype=torch.bool)
    shape = tuple(x.shape)
    mask = rng.dropout_mask_block(state.seed, state.offset, shape, (0,) * len(shape), shape,
                                  p=p)
    return out, mask


OPS: tuple[Op, ...] = (
    Op("rand", FACTORY, FLOATS, _none,
       lambda ns, shape, dtype, kw, **lay: ns.rand(shape, dtype=dtype, **lay),
       lambda shape, dtype, kw: _rng().rand(shape, dtype=dtype), _float_bits),
    Op("randn", FACTORY, FLOATS, _none,
       lambda ns, shape, dtype, kw, **lay: ns.randn(shape, dtype=dtype, **lay),
       lambda shape, dtype, kw: _rng().randn(shape, dtype=dtype), _float_bits),
    Op("randint", FACTORY, (torch.int64, torch.int32, torch.int16, torch.float32), _bounds,
       lambda ns, shape, dtype, kw, **lay: ns.randint(kw["low"], kw["high"], shape,
                                                      dtype=dtype, **lay),
       lambda shape, dtype, kw: _rng().randint(kw["low"], kw["high"], shape, dtype=dtype),
       lambda dtype, kw: _span_bits(kw["high"] - kw["low"]), torch_api=False),
    Op("uniform_", INPLACE, FLOATS,
       lambda dt: st.sampled_from([{"a": 0.0, "b": 1.0}, {"a": -2.0, "b": 3.0},
                                   {"a": 0.25, "b": 0.5}]),
       lambda x, kw: x.uniform_(kw["a"], kw["b"]),
       lambda x, kw: _rng().uniform_(x, kw["a"], kw["b"]), lambda dt, kw: _float_bits(dt, kw) - 2),
    Op("normal_", INPLACE, FLOATS,
       lambda dt: st.sampled_from([{"mean": 0.0, "std": 1.0}, {"mean": 1.0, "std": 2.0},
                                   {"mean": -3.0, "std": 0.5}]),
       lambda x, kw: x.normal_(kw["mean"], kw["std"]),
       lambda x, kw: _rng().normal_(x, kw["mean"], kw["std"]), _float_bits),
    Op("exponential_", INPLACE, FLOATS,
       lambda dt: st.sampled_from([{"lambd": 1.0}, {"lambd": 0.5}, {"lambd": 3.0}]),
       lambda x, kw: x.exponential_(kw["lambd"]),
       lambda x, kw: _rng().exponential_(x, kw["lambd"]), _float_bits),
    Op("random_", INPLACE, (*INTS, torch.bool, torch.float32, torch.float64, torch.bfloat16),
       _none, lambda x, kw: x.random_(), lambda x, kw: _rng().random_(x),
       lambda dt, kw: _span_bits(_random_span(dt))),
    Op("random_(to)", INPLACE, (*INTS, torch.float32),
       lambda dt: st.sampled_from([1, 2, 100, 2**16 + 1, 2**20, 2**31]).map(
           lambda to: {"to": min(to, _int_max(dt) + 1)}),
       lambda x, kw: x.random_(kw["to"]),
       lambda x, kw: x.copy_(_rng().randint(0, kw["to"], tuple(x.shape), dtype=x.dtype)),
       lambda dt, kw: _span_bits(kw["to"])),
    Op("random_(from, to)", INPLACE, (*INTS, torch.float32), _random_from_params,
       lambda x, kw: x.random_(kw["from"], kw["to"]),
       lambda x, kw: x.copy_(_rng().randint(
           kw["from"], kw["to"] if kw["to"] is not None else _random_span(x.dtype),
           tuple(x.shape), dtype=x.dtype)),
       lambda dt, kw: _span_bits(7 if kw["to"] is None else kw["to"] - kw["from"])),
    Op("bernoulli_(p)", INPLACE, (*FLOATS[:3], torch.int64),
       lambda dt: st.sampled_from([0.5, 0.3, 0.0, 1.0]).map(lambda p: {"p": p}),
       lambda x, kw: x.bernoulli_(kw["p"]),
       lambda x, kw: x.copy_(_rng().bernoulli(_full_p(x, kw["p"]))),
       lambda dt, kw: _bernoulli_bits(kw["p"])),
    Op("bernoulli_(probs)", INPLACE, FLOATS[:3], _none,  # probabilities: see _draw_case
       lambda x, kw: x.bernoulli_(kw["p"]),
       lambda x, kw: x.copy_(_rng().bernoulli(kw["p"].expand(x.shape).contiguous())),
       lambda dt, kw: 0.0),  # drawn probabilities may all be ~1
    Op("bernoulli(probs)", PROBS, FLOATS[:3], _none, lambda x, kw: torch.bernoulli(x),
       lambda x, kw: _rng().bernoulli(x), lambda dt, kw: 0.0),
    Op("bernoulli(x, p)", LIKE, FLOATS[:3],
       lambda dt: st.sampled_from([0.5, 0.1]).map(lambda p: {"p": p}),
       lambda x, kw: torch.bernoulli(x, kw["p"]),
       lambda x, kw: _rng().bernoulli(_full_p(x, kw["p"])).to(x.dtype),
       lambda dt, kw: _bernoulli_bits(kw["p"])),
    Op("rand_like", LIKE, FLOATS, _none, lambda x, kw: torch.rand_like(x),
       lambda x, kw: _rng().rand(tuple(x.shape), dtype=x.dtype), _float_bits),
    Op("randn_like", LIKE, FLOATS, _none, lambda x, kw: torch.randn_like(x),
       lambda x, kw: _rng().randn(tuple(x.shape), dtype=x.dtype), _float_bits),
    Op("randint_like", LIKE, (torch.int64, torch.int32, torch.float32), _bounds,
       lambda x, kw: torch.randint_like(x, kw["low"], kw["high"]),
       lambda x, kw: _rng().randint(kw["low"], kw["high"], tuple(x.shape), dtype=x.dtype),
       lambda dt, kw: _span_bits(kw["high"] - kw["low"])),
    Op("dropout", VALUES, FLOATS[:3], _dropout_params,
       lambda x, kw: F.dropout(x, kw["p"], kw["train"]),
       lambda x, kw: _rng().dropout(x, kw["p"], kw["train"]), _dropout_bits),
    Op("nn.Dropout", VALUES, FLOATS[:3], _dropout_params, _drop_module,
       lambda x, kw: _rng().dropout(x, kw["p"], kw["train"]), _dropout_bits),
    Op("native_dropout", VALUES, FLOATS[:3], _dropout_params,
       lambda x, kw: torch.native_dropout(x, kw["p"], kw["train"]), _native_dropout_ref,
       _dropout_bits),
)
_BY_NAME = {op.name: op for op in OPS}


def _ops_for(impl) -> list[str]:
    return [op.name for op in OPS if impl.name == "dtensor" or op.torch_api]


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


def _draw_case(data, impl, world_size: int, *, layout=None, shape=None, allow_partial=True,
               ops=None, ps=None) -> Case:
    op = _BY_NAME[data.draw(st.sampled_from(ops or _ops_for(impl)), label="op")]
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


def _note(case: Case, world_size: int) -> None:
    """Coverage, for --hypothesis-show-statistics: mesh rank, sub-meshes, and
    shards that are uneven or empty."""
    from dtensor.spec import local_block

    layout = case.layout
    event(f"{layout.ndim}-D mesh" + (" (sub-mesh)" if len(layout.ranks) < world_size else ""))
    sizes = {math.prod(local_block(case.shape, layout.shape, case.ps,
                                   layout.coordinate_of(r))[0]) for r in layout.ranks}
    if math.prod(case.shape) and 0 in sizes:
        event("an empty shard")
    elif len(sizes) > 1:
        event("uneven shards")
    if any(p.is_partial() for p in case.ps):
        event("partial placement")


def _run(case: Case, impl, mesh) -> tuple:
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
        out = op.run(impl.from_blocks(case.base, mesh, case.ps), _kw(case, impl, mesh))
    return out if isinstance(out, tuple) else (out,)


def _kw(case: Case, impl, mesh) -> dict:
    """The op's arguments; drawn probabilities become a DTensor on ``mesh``."""
    if "p_ps" not in case.kw:
        return case.kw
    return {**case.kw, "p": impl.from_blocks(case.kw["p"], mesh, case.kw["p_ps"])}


def _reference(case: Case, impl) -> tuple:
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


def _seed(impl, seed: int) -> None:
    if impl.name == "dtensor":
        _rng().manual_seed(seed)
    else:
        torch.manual_seed(seed)


def _state(impl):
    return _rng().get_rng_state() if impl.name == "dtensor" else None


def _as_ours(ps) -> tuple:
    """Placements of either implementation as dtensor placements."""
    from dtensor import Partial, Replicate, Shard

    out = []
    for p in ps:
        kind = type(p).__name__
        out.append(Shard(p.dim) if kind == "Shard" else Partial(p.reduce_op)
                   if kind == "Partial" else Replicate())
    return tuple(out)


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose equality is bit equality (floats viewed as ints)."""
    if t.is_floating_point():
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _assert_same_bits(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, (
        f"{what}: got {got.dtype}{list(got.shape)}, expected "
        f"{expected.dtype}{list(expected.shape)}")
    bad = _bits_of(got.contiguous()) != _bits_of(expected.contiguous())
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements differ "
                             f"bitwise; first at {idx}: got {got[idx].item()!r}, expected "
                             f"{expected[idx].item()!r}")


# NOTE: a rank that fails an assert stops issuing collectives and the others
# hang in their next one. So every test runs all its collectives first
# (``_gather``), then asserts on local data only.
def _gather(outs: tuple, world) -> list[tuple[Any, torch.Tensor | None]]:
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


def _check_outputs(gathered: list, expected: tuple, case: Case, layout) -> None:
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
        _assert_same_bits(full, ref, label + ": full_tensor()")


# Properties -----------------------------------------------------------------------
@pytest.mark.parametrize("op_name", [op.name for op in OPS])
@given(data=st.data())
def test_random_ops_equal_the_single_device_stream(n_ranks, world, impl, op_name, data):
    """full_tensor() of every random op is the single-device result, bit for
    bit, and every rank advances the generator as the single-device run does."""
    if op_name not in _ops_for(impl):
        pytest.skip(f"{impl.name} has no {op_name} for DTensors")
    if impl.name == "torch" and op_name == "native_dropout":
        pytest.skip("torch: one rank aborts (SIGABRT in full_tensor of native_dropout's "
                    "output, 2 ranks, CPU) while the other has moved on, which ends the "
                    "whole torch run; skipped so the other properties still report")
    case = _draw_case(data, impl, world.size, ops=[op_name])
    mesh = impl.mesh(case.layout)
    _seed(impl, case.seed)
    gathered = _gather(_run(case, impl, mesh), world)
    after = _state(impl)
    _seed(impl, case.seed)
    expected = _reference(case, impl)
    assert after == _state(impl), (
        f"rank {world.rank}: {case.op.name} left the generator at {after}, the "
        f"single-device run at {_state(impl)}")
    _check_outputs(gathered, expected, case, case.layout)


@pytest.mark.parametrize("kind", BLOCK_CLASSES)
@given(data=st.data())
def test_random_blocks_of_every_shape_class(n_ranks, world, impl, kind, data):
    """Layouts where some rank's block is empty, one full row, one contiguous
    run (leading size-1 dims, or rows of an uneven dim) or strided: every op
    gives each rank its piece of the single-device stream (per-rank oracle
    and full tensor, bit for bit)."""
    block = data.draw(sharded_blocks(world_size=world.size, kind=kind,
                                     allow_sub_meshes=impl.sub_meshes), label="block")
    case = _draw_case(data, impl, world.size, layout=block.layout, shape=block.shape,
                      ps=block.placements)
    for c in sorted(block.classes()):
        event(f"a {c} block")
    mesh = impl.mesh(case.layout)
    _seed(impl, case.seed)
    gathered = _gather(_run(case, impl, mesh), world)
    _seed(impl, case.seed)
    expected = _reference(case, impl)
    _check_outputs(gathered, expected, case, case.layout)


@given(data=st.data())
def test_random_runs_that_start_mid_row(n_ranks, world, impl, data):
    """Blocks that are one contiguous run of the global tensor starting
    mid-row, offset in two sharded dims where the mesh allows (one row per
    piece, uneven columns, size-1 dims around them): every op gives each rank
    its piece of the single-device stream."""
    block = data.draw(mid_row_runs(world_size=world.size,
                                   allow_sub_meshes=impl.sub_meshes), label="block")
    case = _draw_case(data, impl, world.size, layout=block.layout, shape=block.shape,
                      ps=block.placements)
    mesh = impl.mesh(case.layout)
    _seed(impl, case.seed)
    gathered = _gather(_run(case, impl, mesh), world)
    _seed(impl, case.seed)
    expected = _reference(case, impl)
    _check_outputs(gathered, expected, case, case.layout)


@given(data=st.data())
def test_replicas_agree_and_shards_differ(n_ranks, world, impl, data):
    """Ranks holding the same block hold the same bits; two different blocks of
    the same shape are not copies (checked when a collision has a chance
    below 2**-64). The local blocks are exchanged over the test's group."""
    import torch.distributed as dist

    from dtensor.spec import local_block

    shape = data.draw(tensor_shapes(min_dims=1, max_side=12), label="shape")
    case = _draw_case(data, impl, world.size, shape=shape, allow_partial=False)
    mesh = impl.mesh(case.layout)
    _seed(impl, case.seed)
    out = _run(case, impl, mesh)[0]
    # Every rank's block in the output's layout (dropout may pick another
    # one), None outside; then every rank's local bits, padded (all_gather_object
    # needs numpy, so plain all_gather of int64).
    ps = _as_ours(out.placements)
    blocks = []
    for r in range(world.size):
        coord = case.layout.coordinate_of(r)
        blocks.append(None if coord is None else local_block(
            case.shape, case.layout.shape, ps, coord))
    width = max(1, *(math.prod(b[0]) for b in blocks if b is not None))
    mine = _bits_of(out.to_local().detach()).flatten().to(torch.int64)
    sent = torch.zeros(width, dtype=torch.int64)
    sent[: min(width, mine.numel())] = mine[:width]
    recv = [torch.empty(width, dtype=torch.int64) for _ in range(world.size)]
    dist.all_gather(recv, sent, group=world.group)
    assert mine.numel() == (0 if blocks[world.rank] is None
                            else math.prod(blocks[world.rank][0])), (
        f"rank {world.rank} holds {mine.numel()} elements, its block is "
        f"{blocks[world.rank]}")
    bits = case.op.bits(case.dtype, case.kw)
    # One pass, not every pair (n^2 per rank: minutes at 256 simulated ranks):
    # each rank against its block's first holder, and each block's bits
    # against the bits of the other blocks of its shape seen so far.
    holder, seen = {}, {}
    for r, blk_r in enumerate(blocks):
        if blk_r is None:
            continue
        n = math.prod(blk_r[0])
        loc_r = recv[r][:n]
        s = holder.setdefault(blk_r, r)
        if s != r:
            assert torch.equal(loc_r, recv[s][:n]), (
                f"{_where(case, ps)}: ranks {s} and {r} hold block {blk_r} (shape, "
                "offset) with different bits")
        elif n * bits >= 64:
            s, blk_s = seen.setdefault((blk_r[0], loc_r.numpy().tobytes()), (r, blk_r))
            assert s == r, (
                f"{_where(case, ps)}: ranks {s} and {r} hold different blocks {blk_s} and "
                f"{blk_r} (shape, offset) with the same values: shards are copies of "
                "each other")


def _where(case, ps) -> str:
    return (f"{case.op.name}{case.kw or ''} {case.dtype} {list(case.shape)} on "
            f"{[str(p) for p in ps]} of {case.layout}")


@given(data=st.data())
def test_consecutive_ops_follow_the_single_device_sequence(n_ranks, world, impl, data):
    """Two or three random ops in a row (each on its own mesh and layout) give
    what the same ops give one after the other on one device."""
    steps = [_draw_case(data, impl, world.size) for _ in range(data.draw(
        st.integers(2, 3), label="steps"))]
    seed = steps[0].seed
    _seed(impl, seed)
    outs = [_run(case, impl, impl.mesh(case.layout)) for case in steps]
    gathered = [_gather(out, world) for out in outs]
    _seed(impl, seed)
    expected = [_reference(case, impl) for case in steps]
    for i, (case, got, ref) in enumerate(zip(steps, gathered, expected, strict=True)):
        _check_outputs(got, ref, case._replace(op=case.op._replace(
            name=f"step {i}: {case.op.name}")), case.layout)


def _need_sub_meshes(impl):
    if not impl.sub_meshes:
        pytest.skip(f"{impl.name}: DeviceMesh construction is collective over the whole "
                    "world, so meshes that leave ranks out cannot be built by members only")


@given(data=st.data())
def test_outsiders_advance_the_generator_without_collectives(n_ranks, world, impl, data):
    """On a sub-mesh, ranks outside hold empty locals, issue no collectives and
    advance the generator like the members, so a following op on the whole
    world matches the single-device sequence. Ops with a single, non-partial
    input (or none) communicate on no rank at all."""
    _need_sub_meshes(impl)
    layout = data.draw(sub_meshes(world_size=world.size), label="layout")
    first = _draw_case(data, impl, world.size, layout=layout)
    then = _draw_case(data, impl, world.size, layout=data.draw(
        mesh_layouts(world_size=world.size), label="then layout"))
    mesh = impl.mesh(layout)
    _seed(impl, first.seed)
    if first.op.kind == FACTORY:
        with impl.comm_counter() as comm:
            outs = _run(first, impl, mesh)
    else:
        x = impl.from_blocks(first.base, mesh, first.ps)
        kw = _kw(first, impl, mesh)
        with impl.comm_counter() as comm:
            outs = first.op.run(x, kw)
        outs = outs if isinstance(outs, tuple) else (outs,)
    gathered_first = _gather(outs, world)
    gathered_then = _gather(_run(then, impl, impl.mesh(then.layout)), world)
    _seed(impl, first.seed)
    expected_first = _reference(first, impl)
    expected_then = _reference(then, impl)
    if layout.coordinate_of(world.rank) is None:
        assert comm.total == 0, (
            f"rank {world.rank} is outside {layout} but {first.op.name} issued "
            f"{comm.total} collectives: {getattr(comm, 'counts', '')}")
    elif not any(p.is_partial() for p in first.ps) and "p_ps" not in first.kw:
        assert comm.total == 0, (
            f"{first.op.name} on {[str(p) for p in first.ps]} issued {comm.total} "
            f"collectives on rank {world.rank}: {getattr(comm, 'counts', '')}")
    _check_outputs(gathered_first, expected_first, first, layout)
    _check_outputs(gathered_then, expected_then, then, then.layout)


def _int_range(case: Case) -> tuple[int, int]:
    """[low, high) of an in-place integer draw (floats: unused)."""
    kw, name = case.kw, case.op.name
    if name == "random_(to)":
        return 0, kw["to"]
    if name == "random_(from, to)":
        return kw["from"], kw["to"] if kw["to"] is not None else _random_span(case.dtype)
    if name == "random_":
        return 0, _random_span(case.dtype)
    return 0, 2


@given(data=st.data())
def test_inplace_ops_on_partial_inputs(n_ranks, world, impl, data):
    """docs/random.md: an in-place random op keeps a Partial input partial and
    stores the draw on coordinate 0 of every Partial(sum) axis (zeros on the
    others), and everywhere for Partial(avg/max/min). The value is then the
    draw, exactly, except that Partial(avg) over an axis whose size is not a
    power of two is the mean of n copies: within one rounding. Integers whose
    n copies would overflow the dtype are refused on every rank."""
    from dtensor.spec import local_block

    if impl.name != "dtensor":
        pytest.skip("the Partial semantics of in-place random ops are dtensor's")
    layout = data.draw(mesh_layouts(world_size=world.size, allow_sub_meshes=True),
                       label="layout")
    ops = [op.name for op in OPS if op.kind == INPLACE]
    case = _draw_case(data, impl, world.size, layout=layout, ops=ops)
    ps = data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=len(case.shape),
                              reduce_ops=("sum", "avg", "max", "min")), label="placements")
    case = case._replace(ps=tuple(ps))
    mesh = impl.mesh(layout)
    _seed(impl, case.seed)
    x = impl.from_blocks(case.base, mesh, case.ps)
    n_avg = math.prod(layout.shape[a] for a, p in enumerate(case.ps) if p.is_partial("avg"))
    low, high = _int_range(case)
    if n_avg > 1 and not case.dtype.is_floating_point and case.dtype != torch.bool and (
            low * n_avg < torch.iinfo(case.dtype).min
            or (high - 1) * n_avg > torch.iinfo(case.dtype).max):
        # The sum of n copies would overflow: refused, identically everywhere.
        from dtensor import ShardingError

        with pytest.raises(ShardingError, match="overflows"):
            case.op.run(x, _kw(case, impl, mesh))
        assert _state(impl).offset == 0
        return
    y = case.op.run(x, _kw(case, impl, mesh))
    piece = y.to_local().clone()
    coord = layout.coordinate_of(world.rank)
    full = y.full_tensor() if coord is not None else None
    _seed(impl, case.seed)
    (expected,) = _reference(case, impl)
    where = f"{case.op.name} on {[str(p) for p in case.ps]} of {layout}"
    assert y is x and tuple(y.placements) == case.ps, where
    if coord is None:
        assert_local_is_empty(piece, y.dtype, f" {layout}")
        return
    shape, start = local_block(case.shape, layout.shape, case.ps, coord)
    block = expected[tuple(slice(o, o + n) for o, n in zip(start, shape, strict=True))]
    zero = any(p.is_partial("sum") and coord[a] != 0 for a, p in enumerate(case.ps))
    _assert_same_bits(piece, torch.zeros_like(block) if zero else block,
                      f"{where}: local piece at {coord}")
    avg = [layout.shape[a] for a, p in enumerate(case.ps) if p.is_partial("avg")]
    if all(n & (n - 1) == 0 for n in avg):  # sizes are powers of two: exact
        _assert_same_bits(full, expected, f"{where}: full_tensor()")
    elif case.dtype.is_floating_point:  # the mean of n copies: one rounding
        torch.testing.assert_close(full, expected, msg=f"{where}: full_tensor()")
