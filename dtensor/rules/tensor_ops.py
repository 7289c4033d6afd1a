"""Copies, conversions, ``*_like``/``new_*`` constructors and ``equal``.

``copy_`` keeps the destination's layout and brings the source to it;
``_to_copy`` (``.to(dtype)``) keeps the layout, partial sums included when
the cast is linear and not widening (floating or integer to no wider
floating; a widening cast reduces first, on fewer bytes); ``fill_`` keeps
any layout but pieces of a sum. Constructors from a template
follow its shards but never its partial values (``ones_like`` of a partial
tensor is all ones, not a piece of them); ``new_empty`` of the template's own
size keeps its whole layout (no values to be wrong). ``equal`` compares blocks and
and-s the verdict over the mesh, so every member rank gets the same answer.
"""

from __future__ import annotations

import torch

from dtensor.placement import Replicate, Shard, partial_to_replicate, replicated
from dtensor.rules._util import bind, is_float, shard_through_broadcast
from dtensor.sharding import Sharding

__all__ = ["RULES"]

aten = torch.ops.aten


def copy_rule(call):
    dst, src = call.specs[0], call.specs[1]
    if dst.has_partial() and dst.dtype != src.dtype and not (
        is_float(dst.dtype) and is_float(src.dtype)
    ):
        return None
    # Replicate, or Partial: the source becomes partial too.
    want = [
        shard_through_broadcast(p, src.shape, dst.shape) if isinstance(p, Shard) else p
        for p in dst.placements
    ]
    return Sharding((None, tuple(want)), (dst.placements,))


def to_copy_rule(call):
    (spec,) = call.specs
    a = bind(call)
    dtype = a.get("dtype") or spec.dtype
    device = a.get("device")
    if device is not None and torch.device(device).type != spec.mesh.device_type:
        return None
    # A widening cast (float -> double, real -> complex) of partial values
    # reduces before it: fewer bytes, and the sum rounds as the full tensor's.
    # Integer pieces (counts) cast to a no wider float stay pieces, as a
    # narrowing float cast's do: the cast is monotone (max/min pieces) and
    # linear up to the float's rounding.
    keep = dtype == spec.dtype or (
        is_float(dtype) and dtype.itemsize <= spec.dtype.itemsize
        and (is_float(spec.dtype) or spec.dtype != torch.bool))
    placements = spec.placements if keep else partial_to_replicate(spec.placements)
    return Sharding((placements,), (placements,))


def like_rule(call):
    """``zeros_like`` and friends: the template's shards, no partial values."""
    spec = call.specs[0]
    a = bind(call)
    device = a.get("device")
    if device is not None and torch.device(device).type != spec.mesh.device_type:
        return None
    out = partial_to_replicate(spec.placements)
    # The local block of a partial template already has the full shape.
    return Sharding((None,) * len(call.specs), (out,), shapes=(spec.shape,))


def new_rule(call):
    """``new_zeros(size)`` and friends: a fresh replicated tensor; self untouched."""
    spec = call.specs[0]
    a = bind(call)
    device = a.get("device")
    if device is not None and torch.device(device).type != spec.mesh.device_type:
        return None
    return Sharding((None,) * len(call.specs), (replicated(spec.mesh),))


def new_empty_rule(call):
    """``new_empty(size)``/``new_empty_strided(size, stride)`` of the template's
    own size: the template's layout, partial axes included (the values are
    undefined, so every layout holds them; autograd makes a gradient's copy
    this way, and a partial gradient stays partial). Other sizes: replicated."""
    spec = call.specs[0]
    if tuple(bind(call)["size"]) != tuple(spec.shape) or new_rule(call) is None:
        return new_rule(call)
    local = None
    if any(isinstance(p, Shard) for p in spec.placements):
        local = _local_new_empty
    return Sharding((None,), (spec.placements,), shapes=(spec.shape,), local=local)


def _local_new_empty(func, coord, out_specs, args, kwargs):
    """The op with this rank's block size (the template's block) for ``size``."""
    block = args[0].shape
    if func is aten.new_empty_strided.default:
        return func(args[0], block, torch.empty(block, device="meta").stride(), *args[3:], **kwargs)
    return func(args[0], block, *args[2:], **kwargs)


def equal_rule(call):
    a, b = call.specs
    if a.shape != b.shape or a.dtype != b.dtype or a.has_partial() or b.has_partial():
        return None  # replicate both: every rank computes the same answer
    return Sharding((None, a.placements), (), scalar_reduce="all")


def fill_rule(call):
    """``fill_(x, v)`` keeps x's layout; pieces of a sum would each hold v
    (their sum n * v), so those are replicated first and moved back."""
    (spec,) = call.specs[:1]
    if any(p.is_partial() and p.reduce_op not in ("avg", "max", "min")
           for p in spec.placements):
        return None
    return Sharding((None,), (spec.placements,))


def _partial_keeps_zero(call):
    """``zero_`` keeps any layout (zero pieces sum to zero)."""
    (spec,) = call.specs
    if any(p.is_partial() and not p.is_linear for p in spec.placements):
        return None
    return Sharding((None,), (spec.placements,))


def isin_rule(call):
    """``isin(elements, test_elements)``: a per-element membership test, so
    the elements keep their shards (pieces reduced first: membership of a
    piece says nothing) and the test set is made whole."""
    elements = call.specs[0]
    want = partial_to_replicate(elements.placements)
    rest = (replicated(elements.mesh),) * (len(call.specs) - 1)
    return Sharding((want, *rest), (want,))


RULES: dict = {
    aten.isin.Tensor_Tensor: isin_rule,
    aten.isin.Tensor_Scalar: isin_rule,
    aten.copy_.default: copy_rule,
    aten._to_copy.default: to_copy_rule,
    aten.empty_like.default: like_rule,
    aten.zeros_like.default: like_rule,
    aten.ones_like.default: like_rule,
    aten.full_like.default: like_rule,
    aten.new_empty.default: new_empty_rule,
    aten.new_zeros.default: new_rule,
    aten.new_ones.default: new_rule,
    aten.new_full.default: new_rule,
    aten.new_empty_strided.default: new_empty_rule,
    aten.equal.default: equal_rule,
    aten.zero_.default: _partial_keeps_zero,
    # fill(x, v): only x's layout matters, not its values (partial ones unread)
    aten.fill.Scalar: like_rule,
    aten.fill_.Scalar: fill_rule,
}


def _physical(fn):
    """Lazy conj/neg views: the local result is materialised (the wrapper
    cannot carry the conj/neg bit), which gives the same values. Pieces of a
    max/min are reduced first (the negated pieces' max is not the negated max)."""

    def rule(call):
        (spec,) = call.specs
        want = tuple(Replicate() if p.is_partial() and not p.is_linear else p
                     for p in spec.placements)
        return Sharding((want,), (want,), local=lambda f, c, o, a, k: fn(a[0]))

    return rule


RULES[aten._conj.default] = _physical(torch.conj_physical)
RULES[aten._neg_view.default] = _physical(torch.neg)
