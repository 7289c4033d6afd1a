"""Sharding propagation: which layout each operand needs, what each output is.

``propagate(call, info)`` asks the op's rule (from its record) and answers a
``Plan``; ops without a rule (or whose rule declines) get the replicate
fallback: every operand becomes ``Replicate``, the op runs locally and its
outputs are ``Replicate``. Plans are kept in the call table
(``dtensor.dispatch.cache``) by the general path, not here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from dtensor.dispatch.call import Call
from dtensor.dispatch.guard import RuleOutputError, check_outputs, rule_name
from dtensor.dispatch.meta import infer_meta, inplace_metas, shape_metas
from dtensor.dispatch.op import LIST, OpInfo
from dtensor.errors import UnsupportedOpError
from dtensor.placement import replicated
from dtensor.rules._util import takes_strided
from dtensor.sharding import OpCall, Sharding
from dtensor.spec import DTensorSpec, TensorMeta
from dtensor.strided import unstrided

__all__ = ["Plan", "propagate"]

log = logging.getLogger("dtensor.dispatch")


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do for one call key (kept in the call table)."""

    targets: tuple[DTensorSpec | None, ...]  # per operand; None = as is
    out_specs: tuple[DTensorSpec, ...]
    fallback: bool = False
    scalar_reduce: str | None = None
    local: Any = None
    # Operands the op writes (in-place self, out=) that were redistributed:
    # their new values are moved back into the operand's own layout.
    write_back: tuple[int, ...] = ()
    # How a later call with this key runs at once (``dtensor.dispatch.form.Fast``).
    fast: Any = None
    # The outputs' specs as the op computes them, where the rule settles them
    # into ``out_specs`` after the op (``Sharding.settled``); None: as computed.
    computed: tuple[DTensorSpec, ...] | None = None


def propagate(call: Call, info: OpInfo) -> Plan:
    """A new plan for this call (its rule asked once)."""
    call.check_plain()
    if info.refusal is not None:
        raise UnsupportedOpError(info.refusal)
    mesh = call.mesh()
    # Plain operands (0-d or allowed by implicit_replication) are replicated.
    specs = tuple(
        s if s is not None else DTensorSpec.replicated(
            mesh, TensorMeta(o.shape, o.stride(), o.dtype)
        )
        for s, o in zip(call.specs, call.operands, strict=True)
    )
    rule = info.rule
    sharding = None
    # Most rules know Shard/Replicate/Partial only: StridedShard operands are
    # offered with those axes replicated, and gathered to that layout. Rules
    # marked ``strided_aware`` (views, products) see the layout as it is.
    asked = specs if takes_strided(rule) else unstrided(specs)
    if rule is not None:
        sharding = rule(OpCall(call.func, asked, call.key_args, dict(call.key_kwargs)))
    if sharding is None:
        return _fallback(call, info, specs)
    wants = sharding.inputs if asked is specs else tuple(
        a.placements if w is None else w for a, w in zip(asked, sharding.inputs, strict=True))
    targets = tuple(
        None if want is None or tuple(want) == s.placements else s.with_placements(want)
        for s, want in zip(specs, wants, strict=True)
    )
    out_specs = computed = ()
    if sharding.outputs:
        out_specs = computed = _output_specs(call, info, asked, sharding)
        if out_specs is None:
            return _fallback(call, info, specs)
        if info.guard and sharding.local is None:
            in_specs = tuple(s if t is None else t
                             for s, t in zip(specs, targets, strict=True))
            check_outputs(call, rule, in_specs, out_specs)
        if sharding.settled is not None:
            out_specs = _settled_specs(call, rule, computed, sharding.settled)
    return Plan(
        targets, out_specs, False, sharding.scalar_reduce, sharding.local,
        _written(call, targets), computed=computed if out_specs is not computed else None,
    )


def _settled_specs(call: Call, rule, computed, settled):
    """The specs of ``Sharding.settled``: the computed outputs' metadata in
    the settled placements (None where nothing moves)."""
    if len(settled) == 1 and len(computed) > 1:  # one tuple for a list of outputs
        settled = settled * len(computed)
    if len(settled) != len(computed) or any(
            len(p) != s.mesh.ndim for p, s in zip(settled, computed, strict=False)):
        raise RuleOutputError(
            f"{call.func}: the sharding rule {rule_name(rule)} gave settled placements "
            f"{list(settled)} for {len(computed)} outputs on a {computed[0].mesh.ndim}-axis "
            f"mesh; give one tuple of one placement per mesh axis for each output"
        )
    if all(tuple(p) == s.placements for p, s in zip(settled, computed, strict=True)):
        return computed
    return tuple(s.with_placements(tuple(p)) for p, s in zip(settled, computed, strict=True))


def _fallback(call: Call, info: OpInfo, specs) -> Plan:
    if not info.logged:
        info.logged = True
        log.debug("dtensor: no sharding rule for %s; replicating its inputs", call.func)
    targets = tuple(None if s.is_replicated() else s.with_placements(replicated(s.mesh))
                    for s in specs)
    return Plan(targets, (), True, None, None, _written(call, targets))


def _output_specs(call: Call, info: OpInfo, specs, sharding: Sharding):
    """One spec per tensor output, or None where no metadata can be had."""
    func = call.func
    metas = inplace_metas(info, specs)
    if metas is None and sharding.shapes is not None:
        metas = shape_metas(call, info, specs, sharding.shapes, sharding.any_strides)
    if metas is None:
        try:
            metas = infer_meta(call, specs)
        except Exception:  # e.g. an op that needs CPU index data
            # No meta kernel: replicate, and let the local op raise real errors.
            return None
    outputs = sharding.outputs
    if len(metas) != len(outputs) and len(outputs) == 1 and info.returns == LIST:
        outputs = outputs * len(metas)
    if len(metas) != len(outputs):
        raise RuleOutputError(
            f"{func}: the sharding rule {rule_name(info.rule)} gave {len(outputs)} "
            f"output placement tuples, but the op returns {len(metas)} tensors; give "
            f"one tuple per tensor output (Sharding(outputs=(...,) * {len(metas)}))"
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
