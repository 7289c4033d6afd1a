"""Sharding propagation: which layout each operand needs, what each output is.

``plan_for(call)`` answers from the propagation cache, keyed by the op and
the key form of its arguments, or asks the op's rule. The answer is a
``Plan``; ops without a rule (or whose rule declines) get the replicate
fallback: every operand becomes ``Replicate``, the op runs locally and its
outputs are ``Replicate``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from dtensor.dispatch.call import CACHE_LIMIT, SCALAR_TYPES, Call
from dtensor.dispatch.meta import infer_meta, inplace_metas, returns_list, shape_metas
from dtensor.errors import UnsupportedOpError
from dtensor.placement import replicated
from dtensor.rules import rule_for
from dtensor.sharding import OpCall, Sharding
from dtensor.spec import DTensorSpec, TensorMeta

__all__ = ["Plan", "forget", "plan_for"]

log = logging.getLogger("dtensor.dispatch")
aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do for one op schema (cached)."""

    targets: tuple[DTensorSpec | None, ...]  # per operand; None = as is
    out_specs: tuple[DTensorSpec, ...]
    fallback: bool = False
    scalar_reduce: str | None = None
    local: Any = None
    # Operands the op writes (in-place self, out=) that were redistributed:
    # their new values are moved back into the operand's own layout.
    write_back: tuple[int, ...] = ()


_cache: dict = {}
_rules: dict = {}  # func -> its rule or None: a lookup cache, not the registry
_logged_fallback: set = set()
_RESIZING = {aten.resize_.default, aten.set_.source_Tensor, aten.set_.default}


def forget(ops: frozenset) -> None:
    """Drop what was cached for these overloads (a rule was registered for them)."""
    handles = {op._op for op in ops}
    for op in ops:
        _rules.pop(op, None)
    for key in [k for k in _cache if k[0] in handles]:
        del _cache[key]


def plan_for(call: Call) -> Plan:
    """The cached plan for this call's schema, or a new one."""
    try:
        key = (call.func._op, _cache_sig(call.key_args), _cache_sig(call.key_kwargs))
        plan = _cache.get(key)
    except TypeError:  # an unhashable argument: no caching for this call
        return _propagate(call)
    if plan is None:
        plan = _propagate(call)
        if len(_cache) >= CACHE_LIMIT:
            _cache.clear()
        _cache[key] = plan
    return plan


def _cache_sig(x):
    """An argument (in key form) as the cache keys it: typed (2, 2.0 and True
    hash alike), floats by type alone (see ``SCALAR_TYPES``)."""
    t = type(x)
    if t is tuple:
        return tuple(map(_cache_sig, x))
    if t is int or t is DTensorSpec or x is None:
        return x
    if t in SCALAR_TYPES:
        return t
    return (t, x)


def _rule(func):
    try:
        return _rules[func]
    except KeyError:
        rule = _rules[func] = rule_for(func)
        return rule


def _propagate(call: Call) -> Plan:
    func = call.func
    call.check_plain()
    if torch.Tag.inplace_view in func.tags or func in _RESIZING:
        raise UnsupportedOpError(
            f"{func}: changes a DTensor's shape or strides in place, which a "
            "DTensor cannot do; use the out-of-place op (e.g. x = x.t())"
        )
    if torch.Tag.nondeterministic_seeded in func.tags:
        raise UnsupportedOpError(
            f"{func}: random ops on DTensors land with dtensor.random; this one has "
            "no sharding-invariant implementation yet. Run it on a plain tensor "
            "(x.full_tensor()) and distribute the result."
        )
    mesh = call.mesh()
    # Plain operands (0-d or allowed by implicit_replication) are replicated.
    specs = tuple(
        s if s is not None else DTensorSpec.replicated(
            mesh, TensorMeta(o.shape, o.stride(), o.dtype)
        )
        for s, o in zip(call.specs, call.operands, strict=True)
    )
    rule = _rule(func)
    sharding = rule(OpCall(func, specs, call.key_args, dict(call.key_kwargs))) if rule else None
    if sharding is None:
        return _fallback(call, specs)
    targets = tuple(
        None if want is None or tuple(want) == s.placements else s.with_placements(want)
        for s, want in zip(specs, sharding.inputs, strict=True)
    )
    out_specs = ()
    if sharding.outputs:
        out_specs = _output_specs(call, specs, sharding)
        if out_specs is None:
            return _fallback(call, specs)
    return Plan(
        targets, out_specs, False, sharding.scalar_reduce, sharding.local,
        _written(call, targets),
    )


def _fallback(call: Call, specs) -> Plan:
    if call.func not in _logged_fallback:
        _logged_fallback.add(call.func)
        log.debug("dtensor: no sharding rule for %s; replicating its inputs", call.func)
    targets = tuple(None if s.is_replicated() else s.with_placements(replicated(s.mesh))
                    for s in specs)
    return Plan(targets, (), True, None, None, _written(call, targets))


def _output_specs(call: Call, specs, sharding: Sharding):
    """One spec per tensor output, or None where no metadata can be had."""
    func = call.func
    metas = inplace_metas(call, specs)
    if metas is None and sharding.shapes is not None:
        metas = shape_metas(call, specs, sharding.shapes)
    if metas is None:
        try:
            metas = infer_meta(call, specs)
        except Exception:  # e.g. an op that needs CPU index data
            # No meta kernel: replicate, and let the local op raise real errors.
            return None
    outputs = sharding.outputs
    if len(metas) != len(outputs) and len(outputs) == 1 and returns_list(func):
        outputs = outputs * len(metas)
    if len(metas) != len(outputs):
        raise AssertionError(
            f"{func}: rule gave {len(outputs)} output placements for "
            f"{len(metas)} tensor outputs"
        )
    mesh = specs[0].mesh
    return tuple(
        DTensorSpec(mesh, tuple(p), m)
        for p, m in zip(outputs, metas, strict=True)
        if m is not None
    )


def _written(call: Call, targets) -> tuple[int, ...]:
    """Indices of DTensor operands the op writes whose layout the op changes."""
    if not any(t is not None for t in targets):
        return ()
    out = []
    args, kwargs = call.args, call.kwargs
    for i, a in enumerate(call.func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
        for x in v if isinstance(v, (list, tuple)) else (v,):
            for j, o in enumerate(call.operands):
                if o is x and call.specs[j] is not None and targets[j] is not None:
                    out.append(j)
    return tuple(out)
