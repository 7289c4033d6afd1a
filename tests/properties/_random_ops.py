"""The random ops the properties of test_random.py run: each op's torch call,
its single-device reference under ``dtensor.random``, the arguments it draws,
and how unlikely two independent draws are to agree (to tell shards apart)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from dtensor import random as _dtensor_random

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


def random_span(dtype) -> int:
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
       lambda dt, kw: _span_bits(random_span(dt))),
    Op("random_(to)", INPLACE, (*INTS, torch.float32),
       lambda dt: st.sampled_from([1, 2, 100, 2**16 + 1, 2**20, 2**31]).map(
           lambda to: {"to": min(to, _int_max(dt) + 1)}),
       lambda x, kw: x.random_(kw["to"]),
       lambda x, kw: x.copy_(_rng().randint(0, kw["to"], tuple(x.shape), dtype=x.dtype)),
       lambda dt, kw: _span_bits(kw["to"])),
    Op("random_(from, to)", INPLACE, (*INTS, torch.float32), _random_from_params,
       lambda x, kw: x.random_(kw["from"], kw["to"]),
       lambda x, kw: x.copy_(_rng().randint(
           kw["from"], kw["to"] if kw["to"] is not None else random_span(x.dtype),
           tuple(x.shape), dtype=x.dtype)),
       lambda dt, kw: _span_bits(7 if kw["to"] is None else kw["to"] - kw["from"])),
    Op("bernoulli_(p)", INPLACE, (*FLOATS[:3], torch.int64),
       lambda dt: st.sampled_from([0.5, 0.3, 0.0, 1.0]).map(lambda p: {"p": p}),
       lambda x, kw: x.bernoulli_(kw["p"]),
       lambda x, kw: x.copy_(_rng().bernoulli(_full_p(x, kw["p"]))),
       lambda dt, kw: _bernoulli_bits(kw["p"])),
    Op("bernoulli_(probs)", INPLACE, FLOATS[:3], _none,  # probabilities: see draw_case
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
OPS_BY_NAME = {op.name: op for op in OPS}


def ops_for(impl) -> list[str]:
    return [op.name for op in OPS if impl.name == "dtensor" or op.torch_api]

