"""One record per op overload: what every stage of dispatch needs to know
about an op, read once from its schema, its tags and the rule tables.

``record(func)`` gives the ``OpInfo`` of an overload, building it on first
use. The fast path, the general path, propagation, output metadata and
execution all read the same record: whether the op writes its first
argument, what it returns, whether it may be probed on tiny host tensors,
its special handler, its rule, its quickest binding per argument types.

Records and the call table (``dtensor.dispatch.cache``) hold no per-rank
state: they are shared by every rank a process runs (simulated worlds run
ranks as threads), and a concurrent first use at worst builds a record twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dtensor.dispatch.binding import probe_binding
from dtensor.dispatch.guard import guarded
from dtensor.dispatch.random_ops import HANDLERS
from dtensor.rules import rule_for
from dtensor.sharding import registered_rule, writes_self

__all__ = ["OpInfo", "describe", "may_probe"]

aten = torch.ops.aten

# What an op returns, as dispatch hands it back: SELF its written first
# argument, ONE a tensor, TUPLE several tensors, LIST one Tensor[], NONE
# nothing, OTHER anything else (scalars, optional tensors).
SELF, ONE, TUPLE, LIST, NONE, OTHER = "self", "one", "tuple", "list", "none", "other"
# Kinds of ``OpInfo.special`` besides a random op's handler.
ALIAS, INPLACE_VIEW = "alias", "inplace_view"

# In-place view ops (composites such as matmul of a 1-D operand use them):
# dispatch runs the out-of-place twin, then gives self its block, spec, shape.
_INPLACE_VIEWS = {
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.squeeze_.default: aten.squeeze.default,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.transpose_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
}
# Metadata-only ops whose output is the input's spec object.
_SPEC_ALIASING = {aten.detach.default, aten.alias.default}
_RESIZING = {aten.resize_.default, aten.set_.source_Tensor, aten.set_.default}


def may_probe() -> bool:
    """Whether dispatch may run ops on tensors of its own making now (the
    binding probe, the dtype probe): not under a dispatch mode (a fake or
    proxy mode while tracing), where every tensor made here would belong to
    the trace."""
    return not torch._C._len_torch_dispatch_stack()


@dataclass(eq=False, slots=True)
class OpInfo:
    """What dispatch knows about one op overload (see the module docstring)."""

    func: Any
    inplace: bool  # writes its first argument (``sharding.writes_self``)
    returns: str  # SELF, ONE, TUPLE, LIST, NONE or OTHER
    functional: bool  # no argument or result aliases or writes another
    host_probe: bool  # may run on tiny CPU tensors: ATen, draws no random numbers
    special: Any  # off the propagation path: ALIAS, INPLACE_VIEW or a random op's handler
    twin: Any  # the out-of-place op of an in-place view op
    refusal: str | None  # why propagation refuses the op, if it does
    rule: Any  # the op's sharding rule (the user's first), or None
    guard: bool = False  # new plans' output blocks are checked (``dispatch.guard``)
    bindings: dict = field(default_factory=dict)  # argument types -> quickest callable
    dtypes: dict = field(default_factory=dict)  # probe signature -> result dtypes
    logged: bool = False  # the replicate fallback was logged for this op

    def host_probe_ok(self) -> bool:
        """Whether the op may run on tiny CPU tensors now: an ATen op that
        draws no random numbers (a probe must not advance a generator), and
        ``may_probe()``."""
        return self.host_probe and may_probe()

    def binding(self, loc, kwargs):
        """The quickest callable running this op on local arguments ``loc``."""
        sig = (*map(type, loc), *((k, type(v)) for k, v in kwargs.items()))
        op = self.bindings.get(sig)
        if op is None:
            if not may_probe():  # tracing: no probes now
                return self.func._op
            op = self.bindings[sig] = probe_binding(self.func, loc, kwargs)
        return op


def describe(func) -> OpInfo:
    """Build the record of ``func`` (the cache keeps one per overload)."""
    schema = func._schema
    args, rets = schema.arguments, schema.returns
    inplace = writes_self(func)
    random = torch.Tag.nondeterministic_seeded in func.tags
    special: Any = HANDLERS.get(func)
    if special is None and func in _SPEC_ALIASING:
        special = ALIAS
    elif special is None and func in _INPLACE_VIEWS:
        special = INPLACE_VIEW
    refusal = None
    if torch.Tag.inplace_view in func.tags or func in _RESIZING:
        refusal = (
            f"{func}: changes a DTensor's shape or strides in place, which a "
            "DTensor cannot do; use the out-of-place op (e.g. x = x.t())"
        )
    elif random:
        refusal = (
            f"{func}: random ops on DTensors land with dtensor.random; this one has "
            "no sharding-invariant implementation yet. Run it on a plain tensor "
            "(x.full_tensor()) and distribute the result."
        )
    return OpInfo(
        func=func,
        inplace=inplace,
        returns=_returns(args, rets, inplace),
        functional=not any(a.alias_info is not None for a in (*args, *rets)),
        host_probe=func.namespace == "aten" and not random,
        special=special,
        twin=_INPLACE_VIEWS.get(func),
        refusal=refusal,
        rule=rule_for(func),
        guard=guarded(registered_rule(func) is not None),
    )


def _returns(args, rets, inplace: bool) -> str:
    if not rets:
        return NONE
    if len(rets) == 1:
        (r,) = rets
        if isinstance(r.type, torch.ListType) and isinstance(
            r.type.getElementType(), torch.TensorType
        ):
            return LIST
        if not isinstance(r.type, torch.TensorType):
            return OTHER
        if (
            inplace
            and isinstance(args[0].type, torch.TensorType)
            and r.alias_info is not None
            and r.alias_info.before_set == args[0].alias_info.before_set
        ):
            return SELF
        return ONE
    if all(isinstance(r.type, torch.TensorType) for r in rets):
        return TUPLE
    return OTHER
