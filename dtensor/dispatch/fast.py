"""The fast path of dispatch: one pass over the arguments, one dict lookup.

``dispatch(func, args, kwargs)`` is the body of ``DTensor.__torch_dispatch__``.
It builds the call key (``dtensor.dispatch.cache`` says what a key holds) in
one pass over the arguments, collecting the local tensors on the way, and
looks it up in the call table. A plan with a fast form runs the op on the
local tensors and wraps the result with the plan's output spec: no ``Call``,
no rule, no meta tensors. A plan without one (it redistributes, say) goes
to ``general.planned``; no plan yet, to ``general.general``, which makes one.
"""

from __future__ import annotations

from typing import Any

import torch

from dtensor.dispatch.cache import PLAIN, TABLE, VALUE_KEYED
from dtensor.dispatch.call import SCALAR_TYPES, implicit
from dtensor.dispatch.form import FAST_LOCAL, FAST_MOVE, FAST_NONE, FAST_SELF
from dtensor.dispatch.general import general, planned
from dtensor.dispatch.wrap import wrap
from dtensor.redistribute import execute

__all__ = ["dispatch"]

# The DTensor class; dtensor.tensor hands it over (dtensor.dispatch.serve).
DTensor: Any = None

_mk = torch.Tensor._make_wrapper_subclass
_NO_KEY = object()  # an argument that cannot be keyed
# Non-tensor argument types keyed as (type, value): 2, 2.0 and True are equal
# and hash alike, but give different result dtypes (x ** 2 vs x ** 2.0).
_VALUE_TYPES = frozenset(
    {bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format}
)


def _key_of(v, t):
    """The key of a non-DTensor, non-int argument (``_NO_KEY``: none)."""
    if t in SCALAR_TYPES:
        return t
    if t in _VALUE_TYPES:
        return (t, v)
    if t is torch.Tensor:
        if not v.dim() or v.numel() == 1 or implicit():  # a plain operand
            return (PLAIN, tuple(v.shape), v.dtype, v.device)
        return _NO_KEY  # not an operand here: the general path says why
    if isinstance(v, torch.Tensor):  # a subclass: not ours to key
        return _NO_KEY
    return (t, v)  # hashable or not: the table lookup tells


def _key_seq(seq):
    """``(key, seq with local tensors)`` of a list or tuple argument, or None."""
    items = []
    local = None
    for i, x in enumerate(seq):
        t = type(x)
        if t is int or x is None:
            items.append(x)
            continue
        if t is DTensor:
            items.append(x._spec)
            if local is None:
                local = list(seq)
            local[i] = x._local_tensor
            continue
        if t is list or t is tuple:  # nested: its tensors would stay unswapped
            return None
        k = _key_of(x, t)
        if k is _NO_KEY:
            return None
        items.append(k)
    return tuple(items), (seq if local is None else type(seq)(local))


def dispatch(func, args, kwargs):
    """Run ``func`` on DTensor operands: the body of ``DTensor.__torch_dispatch__``."""
    key = [func._op]
    loc = []  # args with every DTensor replaced by its local tensor
    for a in args:
        t = type(a)
        if t is DTensor:
            key.append(a._spec)
            loc.append(a._local_tensor)
        elif t is int or a is None:
            key.append(a)
            loc.append(a)
        elif t is list or t is tuple:
            for x in a:  # sizes and dims, mostly: ints only
                if type(x) is not int:
                    break
            else:
                key.append(tuple(a))
                loc.append(a)
                continue
            ks = _key_seq(a)
            if ks is None:
                return general(func, args, kwargs or {}, None)
            key.append(ks[0])
            loc.append(ks[1])
        else:
            k = _key_of(a, t)
            if k is _NO_KEY:
                return general(func, args, kwargs or {}, None)
            key.append(k)
            loc.append(a)
    if kwargs:
        for k, v in kwargs.items():
            key.append(k)
            t = type(v)
            if t is int or v is None:
                key.append(v)
            elif t is DTensor:
                key.append(v._spec)  # such a plan has no fast form
            elif t is list or t is tuple:
                ks = _key_seq(v)
                if ks is None:
                    return general(func, args, kwargs, None)
                key.append(ks[0])
            else:
                kv = _key_of(v, t)
                if kv is _NO_KEY:
                    return general(func, args, kwargs, None)
                key.append(kv)
    if func._op in VALUE_KEYED:  # a rule reads a float's value (a norm's order)
        key.append(tuple(a for a in args if type(a) is float))
        if kwargs:
            key.append(tuple((k, v) for k, v in kwargs.items() if type(v) is float))
    key = tuple(key)
    try:
        plan = TABLE.get(key)
    except TypeError:  # an unhashable argument: nothing is kept for this call
        return general(func, args, kwargs or {}, None)
    if plan is None:
        return general(func, args, kwargs or {}, key)
    hit = plan.fast
    if hit is None:
        return planned(func, args, kwargs or {}, plan)
    # A ``form.Fast``: unpacked in one step (cheaper than seven field reads).
    kind, op, spec, shape, stride, dtype, extra = hit
    if kind <= FAST_MOVE:  # ONE or MOVE: one result, wrapped here
        if extra is not None:  # MOVE: redistribute the arguments it names first
            mesh, moves = extra
            for i, steps, gshape in moves:
                loc[i] = execute(loc[i], steps, gshape, mesh)
        out = op(*loc, **kwargs) if kwargs else op(*loc)
        # wrap.wrap, inlined with the metadata the form keeps (one call and
        # three attribute reads fewer on the most common path).
        r = _mk(DTensor, shape, stride, None, None, dtype, out.layout, out.device, False, False)
        r._local_tensor = out
        # spec None: the output's spec is the first operand's (detach, alias,
        # same-shape views): hand over that object itself.
        r._spec = args[0]._spec if spec is None else spec
        return r
    if kwargs is None:
        kwargs = {}
    if kind == FAST_SELF:  # in-place, layout kept: hand back self
        op(*loc, **kwargs)
        return args[0]
    if kind == FAST_NONE:  # in-place foreach ops, say
        op(*loc, **kwargs)
        return None
    if kind == FAST_LOCAL:
        local, mesh, out_specs = extra
        out = local(func, mesh.get_coordinate(), out_specs, tuple(loc), kwargs)
        if isinstance(out, torch.Tensor):
            return wrap(out, args[0]._spec if spec is None else spec)
        return type(out)(map(wrap, out, out_specs))
    out = op(*loc, **kwargs)  # FAST_MANY: a tuple or list of tensors
    return extra(map(wrap, out, spec))
