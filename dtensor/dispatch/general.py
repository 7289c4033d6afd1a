"""The general path of dispatch: special ops, then flatten → plan → execute.

``general(func, args, kwargs)`` handles every call the fast path cannot:
random ops (``dtensor.dispatch.random_ops``), spec-aliasing metadata ops (detach,
alias), in-place views, and everything else through one ``Call``, its cached
``Plan`` and ``execute.run``. It returns the result and the plan, so that the
fast path can decide whether later calls of this schema may skip all this.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._mode_utils import no_dispatch

from dtensor.dispatch import random_ops
from dtensor.dispatch.call import Call
from dtensor.dispatch.execute import run, wrap
from dtensor.dispatch.propagate import Plan, plan_for
from dtensor.errors import UnsupportedOpError

__all__ = ["ALIAS", "general"]

aten = torch.ops.aten

# The DTensor class; dtensor.tensor hands it over (dtensor.dispatch.serve).
DTensor: Any = None

# The plan of detach/alias: the output is the input's spec object, no propagation.
ALIAS = Plan((), ())
_SPEC_ALIASING = {aten.detach.default, aten.alias.default}

# In-place view ops (composites such as matmul of a 1-D operand use them):
# run the out-of-place view, then give self its block, spec and shape.
_INPLACE_VIEWS = {
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.squeeze_.default: aten.squeeze.default,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.transpose_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
}

_special: dict = {}  # func._op -> its handler off the propagation path, or None


def general(func, args: tuple, kwargs: dict):
    """``(result, plan)``: plan None where the call has no cacheable plan."""
    op = func._op  # hashes in C; an OpOverload hashes in Python
    special = _special.get(op, False)
    if special is False:
        special = _special[op] = _special_handler(func)
    if special is not None:
        if special is _alias_of_self:
            return _alias_of_self(func, args, kwargs), ALIAS
        return special(func, args, kwargs), None
    call = Call(func, args, kwargs)
    plan = plan_for(call)
    result = run(call, plan)
    if (
        type(result) is DTensor
        and args
        and type(args[0]) is DTensor
        and result is not args[0]
        and result._spec == args[0]._spec
    ):
        result._spec = args[0]._spec  # same-layout views keep the spec object
    return result, plan


def _special_handler(func):
    handler = random_ops.HANDLERS.get(func)
    if handler is not None:
        return handler
    if func in _SPEC_ALIASING:
        return _alias_of_self
    if func in _INPLACE_VIEWS:
        return _inplace_view
    return None


def _alias_of_self(func, args, kwargs):
    """Metadata-only ops: the output is the input's spec, by identity."""
    x = args[0]
    return wrap(func(x._local_tensor), x._spec)


def _inplace_view(func, args, kwargs):
    self = args[0]
    if not isinstance(self, DTensor):
        raise UnsupportedOpError(f"{func}: self must be a DTensor")
    out, _ = general(_INPLACE_VIEWS[func], args, kwargs)
    self._local_tensor = out._local_tensor
    self._spec = out._spec
    with no_dispatch():
        aten.as_strided_.default(self, out._spec.shape, out._spec.stride)
    return self
