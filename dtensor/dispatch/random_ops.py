"""Random ops on DTensors: each rank computes exactly its block of the
single-device stream.

Values come from ``dtensor.random``'s counter-based generator evaluated at
global element indices, so a random op gives the same full tensor, bit for
bit, for every mesh and placements, and the same as the plain-tensor
functions of ``dtensor.random`` under the same seed. Every rank advances the
generator's offset once per random op — members of the op's mesh and
outsiders alike — so later ops stay in step everywhere.

Partial semantics (docs/random.md): a random op writing a ``Partial(sum)``
tensor stores the values on coordinate 0 of each partial axis and zeros
elsewhere (the sum is the random tensor); ``Partial(avg/max/min)`` store the
values everywhere, and integers that n copies would overflow are refused.
``native_dropout`` and dropout keep ``Partial(sum/avg)`` inputs partial: the
mask depends only on the global index, so masking commutes with the sum;
``Partial(max/min)`` inputs are reduced first.
"""

from __future__ import annotations

import math

import torch

from dtensor import _compile, _seeding
from dtensor import _random_blocks as blocks
from dtensor import random as rng
from dtensor.dispatch import wrap as _served  # holds the DTensor class
from dtensor.dispatch.wrap import wrap
from dtensor.errors import ShardingError
from dtensor.placement import (
    Partial,
    Replicate,
    norm_pieces_from,
    partial_fill,
    partial_to_replicate,
)
from dtensor.redistribute import empty_local, redistribute_local
from dtensor.spec import DTensorSpec, TensorMeta, contiguous_stride
from dtensor.strided import draw_runs, has_strided

__all__ = ["HANDLERS", "no_generator", "zero_partial_sums"]

aten = torch.ops.aten


def no_generator(kwargs: dict, op: str) -> None:
    if kwargs.get("generator") is not None:
        raise ShardingError(
            f"{op}: torch.Generator objects are not supported on DTensors; seed "
            "the sharding-invariant generator with dtensor.manual_seed(seed)"
        )


def _draw(spec: DTensorSpec, device, make) -> torch.Tensor | None:
    """This rank's block of a fresh draw laid out by ``spec`` (None for outsiders).

    Advances the generator on every rank, member or not.
    """
    norm_pieces_from(spec.placements, "a random op")  # before anyone advances
    coord = spec.mesh.get_coordinate()
    if _compile.tracing():
        # The compiled program draws, and advances the generator, when it runs.
        empty = (0,) * spec.ndim
        shape, start = spec.local_block(coord) if coord is not None else (empty, empty)
        values = _compile.draw(*make.block, spec.shape, start, shape, device)
        return _zero_partial(values, spec, coord) if coord is not None else None
    seed, offset = _seeding.take(spec.mesh)
    if coord is None:
        return None
    if has_strided(spec.placements):  # interleaved rows: one draw per run
        return _zero_partial(draw_runs(spec, coord, seed, offset, make, device), spec, coord)
    shape, start = spec.local_block(coord)
    values = make(seed, offset, spec.shape, start, shape, device=device)
    return _zero_partial(values, spec, coord)


def zero_partial_sums(spec: DTensorSpec, coord) -> bool:
    """This coordinate holds zeros of a ``Partial(sum)`` value (all but
    coordinate 0 of each sum axis; the sum is the value)."""
    return any(
        p.is_partial("sum") and coord[axis] != 0 for axis, p in enumerate(spec.placements)
    )


def _zero_partial(values: torch.Tensor, spec: DTensorSpec, coord) -> torch.Tensor:
    # Off coordinate 0 of a Partial(sum/product/bxor) axis: the op's identity.
    fill = partial_fill(spec.placements, coord)
    return values if fill is None else torch.full_like(values, fill)


def _inplace(make_for):
    """Handler for ``op_(self, ...)``: overwrite self's block with its draw."""

    def handler(func, args, kwargs):
        self = args[0]
        no_generator(kwargs, str(func))
        make = make_for(self, *args[1:], **{k: v for k, v in kwargs.items() if k != "generator"})
        local = self._local_tensor
        values = _draw(self._spec, local.device, make)
        if values is not None:
            local.copy_(values)
        return self

    return handler


def _like(make_for):
    """Handler for ``op_like(self, dtype=...)``: a fresh DTensor laid out like self."""

    def handler(func, args, kwargs):
        self = args[0]
        no_generator(kwargs, str(func))
        dtype = kwargs.get("dtype") or self.dtype
        spec = _non_partial(self._spec).with_meta(
            TensorMeta(self.shape, contiguous_stride(self.shape), dtype)
        )
        make = make_for(dtype, *args[1:])
        device = self._local_tensor.device
        values = _draw(spec, device, make)
        if values is None:
            values = empty_local(spec, device)
        return wrap(values, spec)

    return handler


def _non_partial(spec: DTensorSpec) -> DTensorSpec:
    return spec.with_placements(partial_to_replicate(spec.placements))


def _probabilities(t, like: DTensorSpec) -> torch.Tensor:
    """``t``'s block in the (non-partial) layout ``like``; plain ``t`` is replicated."""
    if isinstance(t, _served.DTensor):
        src = t._spec
        dst = src.with_placements(like.placements)
        if like.mesh.get_coordinate() is None:
            return t._local_tensor
        return redistribute_local(t._local_tensor, src, dst)
    if t.dim() == 0:
        return t.expand(like.local_shape(like.mesh.get_coordinate()))
    raise ShardingError(
        "bernoulli_: p is a plain tensor of shape "
        f"{tuple(t.shape)}; pass a DTensor or a 0-d tensor"
    )


def _bernoulli_tensor(func, args, kwargs):
    """``bernoulli(p)``: a DTensor of 0/1 laid out like the probabilities."""
    no_generator(kwargs, str(func))
    p = args[0]
    spec = _non_partial(p._spec)
    coord = spec.mesh.get_coordinate()
    probs = None
    if coord is not None:
        probs = redistribute_local(p._local_tensor, p._spec, spec) if spec is not p._spec else p._local_tensor
    values = _draw(
        spec, p._local_tensor.device,
        _maker(rng.bernoulli_block, p=probs, dtype=p.dtype),
    )
    return wrap(values if values is not None else empty_local(spec, p._local_tensor.device), spec)


def _bernoulli_inplace_tensor(func, args, kwargs):
    self, p = args[0], args[1]
    no_generator(kwargs, str(func))
    spec = self._spec
    probs = None
    if spec.mesh.get_coordinate() is not None:
        probs = _probabilities(p, _non_partial(spec)).to(self._local_tensor.device)
    values = _draw(
        spec, self._local_tensor.device,
        _maker(rng.bernoulli_block, p=probs, dtype=self.dtype),
    )
    if values is not None:
        self._local_tensor.copy_(values)
    return self


def _native_dropout(func, args, kwargs):
    """``native_dropout(x, p, train) -> (out, keep mask)`` with ``dropout``'s
    values. It draws exactly when ``dtensor.random.dropout`` does (training,
    ``0 < p < 1``, non-empty), so the fused and the decomposed forms advance
    the generator alike. Partial(sum/avg) inputs stay partial: the mask depends
    only on the global index, so it commutes with the reduction. Partial(max/min)
    axes are reduced first. The mask is never partial."""
    x, p = args[0], float(args[1])
    train = args[2] if len(args) > 2 else kwargs.get("train")
    blocks._threshold(p, "native_dropout")
    spec, local = x._spec, x._local_tensor
    if any(q.is_partial() and not q.is_linear for q in spec.placements):
        reduced = spec.with_placements([
            Replicate() if q.is_partial() and not q.is_linear else q for q in spec.placements
        ])
        if spec.mesh.get_coordinate() is not None:
            local = redistribute_local(local, spec, reduced)
        spec = reduced
    layout = _non_partial(spec)
    mask_spec = layout.with_meta(TensorMeta(spec.shape, spec.stride, torch.bool))
    if not train or p == 0.0 or p == 1.0 or 0 in spec.shape:  # no draw
        if train and p == 1.0:
            out = local * torch.zeros((), dtype=local.dtype, device=local.device)
        else:
            out = local.clone()
        mask = torch.full_like(local, not (train and p == 1.0), dtype=torch.bool)
        return wrap(out, spec), wrap(mask, mask_spec)
    # Same arithmetic as ATen's CPU dropout (bernoulli_(1 - p), div_, mul), so
    # the fused op and the decomposed one give the same bits.
    keep = 1.0 - p
    noise = _draw(layout, local.device, _maker(rng.bernoulli_block, p=keep, dtype=x.dtype))
    if noise is None:
        return wrap(empty_local(spec, local.device), spec), wrap(
            empty_local(mask_spec, local.device), mask_spec)
    mask = noise.bool()
    return wrap(local * noise.div_(keep), spec), wrap(mask, mask_spec)


def _int_maker(self, op: str, lo: int, hi: int, block_fn, /, **fixed):
    """``_maker`` for integers in ``[lo, hi)`` written into ``self``, once they
    fit: on a Partial(avg) axis every coordinate holds the draw and the value is
    their sum divided by n, so integer sums must not overflow."""
    spec, dtype = self._spec, self.dtype
    n = math.prod(spec.mesh.shape[a] for a, p in enumerate(spec.placements)
                  if isinstance(p, Partial) and p.reduce_op == "avg")
    if n > 1 and not dtype.is_floating_point and dtype != torch.bool:
        info = torch.iinfo(dtype)
        if lo * n < info.min or (hi - 1) * n > info.max:
            raise ShardingError(
                f"{op}: cannot store integers in [{lo}, {hi}) into {spec}: its "
                f"Partial(avg) value is the sum of {n} copies divided by {n}, and that "
                f"sum overflows {dtype}. Redistribute it first, e.g. "
                "x.redistribute(mesh, [Replicate()] * mesh.ndim)"
            )
    return _maker(block_fn, **fixed)


def _random_from(self, low: int, high: int | None):
    """``random_(from, to)``; ``to=None`` means up to the dtype's top (torch's range)."""
    high = blocks._random_span(self.dtype) if high is None else high
    return _int_maker(self, "random_", low, high, rng.randint_block, low=low, high=high,
                      dtype=self.dtype)


def _maker(block_fn, **fixed):
    def make(*args, device):
        return block_fn(*args, device=device, **fixed)

    make.block = (block_fn.__name__, fixed)  # what a compiled program draws
    return make


HANDLERS = {
    aten.uniform_.default: _inplace(
        lambda self, from_=0.0, to=1.0, **kw: _maker(
            rng.uniform_block, dtype=self.dtype, low=kw.get("from", from_), high=kw.get("to", to))
    ),
    aten.normal_.default: _inplace(
        lambda self, mean=0.0, std=1.0, **kw: _maker(
            rng.normal_block, dtype=self.dtype, mean=kw.get("mean", mean), std=kw.get("std", std))
    ),
    aten.exponential_.default: _inplace(
        lambda self, lambd=1.0, **kw: _maker(
            rng.exponential_block, dtype=self.dtype, lambd=kw.get("lambd", lambd))
    ),
    aten.random_.default: _inplace(
        lambda self, **kw: _int_maker(
            self, "random_", 0, blocks._random_span(self.dtype), rng.random_block, dtype=self.dtype)
    ),
    aten.random_.to: _inplace(
        lambda self, to, **kw: _int_maker(
            self, "random_", 0, to, rng.randint_block, low=0, high=to, dtype=self.dtype)
    ),
    getattr(aten.random_, "from"): _inplace(
        lambda self, from_, to=None, **kw: _random_from(self, from_, to)
    ),
    aten.bernoulli_.float: _inplace(
        lambda self, p=0.5, **kw: _maker(rng.bernoulli_block, p=kw.get("p", p), dtype=self.dtype)
    ),
    aten.bernoulli_.Tensor: _bernoulli_inplace_tensor,
    aten.bernoulli.default: _bernoulli_tensor,
    aten.rand_like.default: _like(lambda dtype: _maker(rng.uniform_block, dtype=dtype)),
    aten.randn_like.default: _like(lambda dtype: _maker(rng.normal_block, dtype=dtype)),
    aten.randint_like.default: _like(
        lambda dtype, high: _maker(rng.randint_block, low=0, high=high, dtype=dtype)
    ),
    aten.randint_like.low_dtype: _like(
        lambda dtype, low, high: _maker(rng.randint_block, low=low, high=high, dtype=dtype)
    ),
    aten.native_dropout.default: _native_dropout,
}

if hasattr(aten.bernoulli, "p"):
    HANDLERS[aten.bernoulli.p] = _like(
        lambda dtype, p=0.5: _maker(rng.bernoulli_block, p=p, dtype=dtype)
    )
