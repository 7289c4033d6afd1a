"""The general path of dispatch: special ops, then flatten → plan → execute.

``general(func, args, kwargs, key)`` answers every call whose key has no
plan yet (or that cannot be keyed: ``key`` None): random ops
(``dtensor.dispatch.random_ops``), spec-aliasing metadata ops (detach,
alias), in-place views, and everything else through one ``Call``, a new
``Plan`` and ``execute.run``. The plan, with its fast form where it has one,
goes into the call table, so the next call with this key skips all this;
in a simulated world a rank takes the plan another rank made for the same
call (``dtensor.dispatch.shared``) instead of propagating it again.
``planned`` runs a call whose plan is known but has no fast form.
"""

from __future__ import annotations

import torch
from torch.utils._mode_utils import no_dispatch

from dtensor.dispatch import wrap as _served  # holds the DTensor class
from dtensor.dispatch.cache import TABLE, record, remember
from dtensor.dispatch.call import Call
from dtensor.dispatch.execute import run
from dtensor.dispatch.form import fast_form
from dtensor.dispatch.op import ALIAS, INPLACE_VIEW
from dtensor.dispatch.propagate import Plan, propagate
from dtensor.dispatch.shared import share, shared_key, shared_plan
from dtensor.dispatch.wrap import wrap
from dtensor.errors import MeshError, UnsupportedOpError
from dtensor.placement import format_placements
from dtensor.rules.foreach import per_mesh

__all__ = ["general", "planned"]

aten = torch.ops.aten


def general(func, args: tuple, kwargs: dict, key):
    """The result of ``func`` on DTensor operands; remembers its plan under ``key``."""
    info = record(func)
    special = info.special
    if special is not None:
        if special == ALIAS:
            return _alias_of_self(info, args, kwargs, key)
        if special == INPLACE_VIEW:
            return _inplace_view(info, args, kwargs, key)
        return special(func, args, kwargs)  # a random op: never cached
    call = Call(func, args, kwargs)
    try:
        plan = _new_plan(call, info, key)
    except MeshError:  # a foreach op's elements on several meshes: one call per mesh
        out = per_mesh(func, args, kwargs, _mesh_of)
        if out is None:
            raise
        return out if func._schema.returns else None
    return _same_spec(run(call, plan, info), args)


def _mesh_of(x):
    return x._spec.mesh if type(x) is _served.DTensor else None


def _new_plan(call: Call, info, key) -> Plan:
    """Propagate ``call`` (or take the plan another rank of this process made
    for it) and remember its plan (with its fast form) under ``key``."""
    if key is None:
        return propagate(call, info)
    mesh = call.first_mesh()
    skey = shared_key(key)
    plan = None if skey is None else shared_plan(skey, mesh)
    if plan is None:
        plan = propagate(call, info)
        if skey is not None:
            share(skey, plan, mesh)
    form = fast_form(plan, info, call.args, call.kwargs, mesh)
    if form is not None:
        # The plan is new and in no call table yet (the shared copy's fast
        # form is never read): give it its fast form in place
        # (dataclasses.replace costs ~1.3 µs per first-seen call).
        object.__setattr__(plan, "fast", form)
    remember(key, plan)
    return plan


def planned(func, args: tuple, kwargs: dict, plan: Plan):
    """The result of ``func`` following a known ``plan``."""
    return _same_spec(run(Call(func, args, kwargs), plan, record(func)), args)


def _same_spec(result, args):
    if (
        type(result) is _served.DTensor
        and args
        and type(args[0]) is _served.DTensor
        and result is not args[0]
        and result._spec == args[0]._spec
    ):
        result._spec = args[0]._spec  # same-layout views keep the spec object
    return result


def _alias_of_self(info, args, kwargs, key):
    """Metadata-only ops: the output is the input's spec, by identity."""
    x = args[0]
    out = wrap(info.func(x._local_tensor), x._spec)
    form = None if key is None else fast_form(
        None, info, args, kwargs, x._spec.mesh, out_specs=(x._spec,))
    if form is not None:  # outsiders too hand over their own (empty) block: no plan
        remember(key, Plan((None,), (x._spec,), fast=form))
    return out


def _inplace_view(info, args, kwargs, key):
    """Run the out-of-place twin on self's block, then give self its view, spec, shape.

    Self keeps its storage, so its alias family (detach, alias, view_as, ...)
    keeps seeing its writes, as on one device. A twin whose plan would move
    self into another layout first (a gather: new storage) is refused on
    every rank before anything changes: the plan depends on the spec alone.
    """
    self = args[0]
    if not isinstance(self, _served.DTensor):
        raise UnsupportedOpError(f"{info.func}: self must be a DTensor")
    twin = info.twin
    # The twin takes the same arguments: its key is this call's, op swapped.
    tkey = None if key is None else (twin._op, *key[1:])
    plan = None if tkey is None else TABLE.get(tkey)
    call = Call(twin, args, kwargs)
    if plan is None:
        plan = _new_plan(call, record(twin), tkey)
    if plan.targets and plan.targets[0] is not None:
        raise UnsupportedOpError(_moves_self(info.func, self, plan.targets[0]))
    out = _same_spec(run(call, plan, record(twin)), args)
    self._local_tensor = out._local_tensor
    self._spec = out._spec
    with no_dispatch():
        aten.as_strided_.default(self, out._spec.shape, out._spec.stride)
    return self


def _moves_self(func, self, target) -> str:
    spec = self._spec
    name = func._schema.name.split("::")[-1].removesuffix("_")
    return (
        f"{func}: on a DTensor of shape {tuple(spec.shape)} with placements "
        f"{format_placements(spec.placements)} on mesh {spec.mesh}, the view needs "
        f"placements {format_placements(target.placements)} first; that "
        "redistribution moves the tensor into new storage, so the tensors it aliases "
        "(detach, alias, view_as, view) would stop seeing its writes. Use the "
        f"out-of-place op (x = x.{name}(...)), or redistribute first "
        f"(x = x.redistribute(mesh, {format_placements(target.placements)})) "
        "and apply the in-place view to that."
    )
