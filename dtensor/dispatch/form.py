"""The fast form of a plan: how a later call with the same key runs without
taking the call apart, propagating or redistributing.

A fast form is a ``Fast`` record (``kind, op, spec, shape, stride, dtype,
extra``); ``op`` is the quickest callable for the overload
(``OpInfo.binding``). Kinds: ONE wraps
one result with ``spec`` (None: the first operand's spec object, handed
over as is), SELF hands back the in-place operand, MANY wraps each tensor of
a tuple or list with ``spec`` (a tuple of specs; ``extra``: the container
type), LOCAL runs the rule's ``local`` function (``extra``: the function,
the mesh of the first DTensor argument, the output specs), NONE runs an
op that returns nothing (in-place foreach ops: an optimizer step), MOVE
first moves some top-level DTensor arguments' blocks (``extra``: the mesh
and ``(argument index, redistribution steps, global shape)`` per moved
argument), then runs and wraps like ONE.

Only plans without write-back or fallback, on a rank of the op's mesh, get
one; only MOVE redistributes (a functional op of one result whose moved
operands are top-level arguments: ``total_norm + 1e-6`` in
``clip_grad_norm_`` every step, where the general path made ~40 % of the
call's Python calls). Which plans qualify, and the form itself, follow from
the plan, the op's record and the call's key alone, so the form is as
rank-independent as the key (see ``dtensor.dispatch.cache``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from dtensor.dispatch import wrap as _served  # holds the DTensor class
from dtensor.dispatch.op import LIST, NONE, ONE, SELF, TUPLE, OpInfo
from dtensor.redistribute import plan as plan_steps
from dtensor.strided import has_strided

__all__ = ["FAST_LOCAL", "FAST_MANY", "FAST_MOVE", "FAST_NONE", "FAST_ONE", "FAST_SELF",
           "Fast", "fast_form"]

# ONE and MOVE first: the fast path tells them from the rest with one ``<=``.
FAST_ONE, FAST_MOVE, FAST_SELF, FAST_MANY, FAST_LOCAL, FAST_NONE = range(6)


class Fast(NamedTuple):
    """How a later call with the same key runs (the module docstring says
    what each kind reads). A tuple, so the fast path unpacks it in one step
    instead of reading seven attributes."""

    kind: int  # FAST_ONE, FAST_MOVE, FAST_SELF, FAST_MANY, FAST_LOCAL or FAST_NONE
    op: Any = None  # the op's binding (LOCAL: None)
    spec: Any = None  # the output spec (None: the first operand's); MANY: a tuple
    shape: tuple | None = None  # ONE and MOVE: the output's global metadata
    stride: tuple | None = None
    dtype: torch.dtype | None = None
    extra: Any = None  # LOCAL, MANY, MOVE: as the module docstring says; ONE: None



def fast_form(plan, info: OpInfo, args: tuple, kwargs: dict, mesh, out_specs=None):
    """The fast form for calls like this one, or None.

    ``mesh``: the call's mesh (``Call.first_mesh``). ``out_specs``: the output
    specs of a call answered off the propagation path (detach, alias), whose
    plan is implied.
    """
    if out_specs is None:
        if (plan.fallback or plan.write_back or plan.scalar_reduce is not None
                or plan.computed is not None):
            return None
        if any(t is not None for t in plan.targets):
            return _move_form(plan, info, args, kwargs, mesh)
        out_specs = plan.out_specs
        if not out_specs and (info.returns != NONE or plan.local is not None):
            return None
    first = next((i for i, a in enumerate(args) if type(a) is _served.DTensor), None)
    if mesh is None or mesh.get_coordinate() is None:
        return None
    for v in kwargs.values():  # the hot path passes kwargs on untouched
        if type(v) is _served.DTensor or (
            type(v) in (list, tuple) and any(type(x) is _served.DTensor for x in v)
        ):
            return None
    returns = info.returns
    # Same spec as the first operand: later hits hand over *their* operand's
    # spec object (equal in value, since it is part of the key).
    same = first == 0 and len(out_specs) == 1 and out_specs[0] == args[0]._spec
    # NOTE: a tuple result may hold None where an output mask in the
    # arguments (part of the key) leaves a result out: no spec, no fast form.
    many = not info.inplace and (
        returns == LIST
        or (returns == TUPLE and len(out_specs) == len(info.func._schema.returns))
    )
    if plan is not None and plan.local is not None:
        # NOTE: the first DTensor may sit in a list (``_foreach_norm``): the
        # form keeps the mesh, whose coordinate the local function reads.
        if not (returns == ONE or many):
            return None
        spec = None if same else out_specs[0] if returns == ONE else None
        return Fast(FAST_LOCAL, spec=spec, extra=(plan.local, mesh, out_specs))
    loc = [a._local_tensor if type(a) is _served.DTensor else a for a in args]
    loc = [_locals(a) if type(a) in (list, tuple) else a for a in loc]
    op = info.binding(loc, kwargs)
    if returns == NONE:
        return Fast(FAST_NONE, op)
    if returns == SELF:
        return Fast(FAST_SELF, op) if first == 0 else None
    if returns == ONE:
        meta = out_specs[0].tensor_meta
        spec = None if same else out_specs[0]
        return Fast(FAST_ONE, op, spec, meta.shape, meta.stride, meta.dtype)
    if many:
        return Fast(FAST_MANY, op, out_specs, extra=list if returns == LIST else tuple)
    return None


def _locals(seq):
    return type(seq)(x._local_tensor if type(x) is _served.DTensor else x for x in seq)


def _move_form(plan, info: OpInfo, args: tuple, kwargs: dict, mesh):
    """The MOVE form of a plan that redistributes top-level arguments, or None."""
    if (plan.local is not None or info.returns != ONE or info.inplace
            or len(plan.out_specs) != 1 or not info.functional):
        return None
    for v in kwargs.values():
        if isinstance(v, torch.Tensor) or type(v) in (list, tuple):
            return None
    targets = iter(plan.targets)
    moves = []
    for i, a in enumerate(args):
        if type(a) in (list, tuple) and any(isinstance(x, torch.Tensor) for x in a):
            return None
        if not isinstance(a, torch.Tensor):
            continue
        target = next(targets)
        if target is None:
            continue
        if type(a) is not _served.DTensor:  # a plain operand to move: the general path
            return None
        src = a._spec
        if has_strided(src.placements) or has_strided(target.placements):
            return None  # moved by gather-then-cut (dtensor.strided): the general path
        moves.append((i, plan_steps(src.placements, target.placements, mesh.shape, src.shape),
                      src.shape))
    if not moves or mesh is None or mesh.get_coordinate() is None:
        return None
    loc = [a._local_tensor if type(a) is _served.DTensor else a for a in args]
    out = plan.out_specs[0]
    meta = out.tensor_meta
    # As ONE: a result laid out like the first argument takes its spec object.
    spec = None if type(args[0]) is _served.DTensor and out == args[0]._spec else out
    return Fast(FAST_MOVE, info.binding(loc, kwargs), spec, meta.shape, meta.stride,
                meta.dtype, (mesh, tuple(moves)))
