"""Execution of a plan: redistribute operands, run the op on local blocks,
write back what it wrote, and wrap the results once.

Ranks outside the op's mesh never communicate; they get empty outputs of the
right dtype (``None`` for Python scalars).
"""

from __future__ import annotations

import torch

from dtensor.dispatch import wrap as _served  # holds the DTensor class
from dtensor.dispatch.call import Call, tensor_leaves
from dtensor.dispatch.meta import meta_tensor
from dtensor.dispatch.op import OpInfo
from dtensor.dispatch.propagate import Plan
from dtensor.dispatch.wrap import rewrap, wrap
from dtensor.mesh import device_of, mesh_max
from dtensor.placement import replicated
from dtensor.redistribute import empty_local, redistribute_local
from dtensor.spec import DTensorSpec, TensorMeta

__all__ = ["run"]


def run(call: Call, plan: Plan, info: OpInfo):
    """The op's result on DTensors, following ``plan`` (``info``: the op's record)."""
    # NOTE: plain loops, no closures on the common paths: this runs on every
    # call that misses the fast path.
    mesh = call.first_mesh()
    coord = mesh.get_coordinate()
    if coord is None:
        return _outsider_result(call, plan, mesh)
    # Local operands in operand order, redistributed where the plan asks.
    # NOTE: by position, not identity: ``mm(x, x)`` may need x in two layouts.
    locals_ = []
    for o, s, target in zip(call.operands, call.specs, plan.targets, strict=True):
        local = o._local_tensor if s is not None else o
        if target is not None:  # a plain operand starts replicated
            src = s if s is not None else target.with_placements(replicated(mesh))
            local = redistribute_local(local, src, target)
        locals_.append(local)
    largs, lkwargs = call.replace(locals_)
    func = call.func
    if plan.local is not None:  # it computes the outputs as laid out before settling
        specs = plan.out_specs if plan.computed is None else plan.computed
        out = plan.local(func, coord, specs, largs, lkwargs)
    else:
        out = func(*largs, **lkwargs)
    if plan.computed is not None:
        out = _settle(out, plan.computed, plan.out_specs)

    written = {}  # id(local written) -> the DTensor operand it stands for
    for j in plan.write_back:
        o, local = call.operands[j], locals_[j]
        written[id(local)] = o
        if info.inplace and o is call.args[0] and _keeps_reduced(o, plan.targets[j], local):
            o._local_tensor, o._spec = local, plan.targets[j]
            continue
        block = redistribute_local(local, plan.targets[j], o._spec)
        if block is not o._local_tensor:
            o._local_tensor.copy_(block)

    # In-place ops return their (DTensor) self: hand it back, not a copy.
    args = call.args
    self = args[0] if args and type(args[0]) is _served.DTensor and info.inplace else None
    if plan.fallback:
        return rewrap(out, _Replicated(mesh, self, written))
    if not plan.out_specs:
        return _reduce_scalar(out, plan.scalar_reduce, mesh)
    if type(out) is torch.Tensor and not written:  # the common case
        return self if self is not None else wrap(out, plan.out_specs[0])
    specs = iter(plan.out_specs)

    def one(t):
        spec = next(specs)
        if id(t) in written:
            return written[id(t)]
        return self if self is not None else wrap(t, spec)

    return rewrap(out, one)


def _settle(out, computed, settled):
    """The op's local outputs moved from the layouts it computed them in to
    the ones its rule settles them in (``Sharding.settled``)."""
    if isinstance(out, torch.Tensor):
        return redistribute_local(out, computed[0], settled[0])
    specs = iter(zip(computed, settled, strict=True))

    def one(t):
        if not isinstance(t, torch.Tensor):
            return t
        src, dst = next(specs)
        return redistribute_local(t, src, dst)

    return type(out)(one(t) for t in out)


def _keeps_reduced(o, target: DTensorSpec, local: torch.Tensor) -> bool:
    """Whether in-place ``self`` ``o``, whose pieces the op reduced, takes the
    reduced layout ``target`` instead of being cut back into pieces.

    Pieces written back are reduced again by every later read that cannot
    keep them (``var.clone().clamp_(min=eps)`` then ``log(var)``, ``/ var``:
    three reductions of one value), where PyTorch's DTensor gives ``self``
    the reduced layout once. Only a block nothing else shares may change
    layout: a view or alias of it reads the same storage under its own
    (partial) spec, and a traced (fake or functional) block is left alone."""
    block = o._local_tensor
    if type(block) is not torch.Tensor or type(local) is not torch.Tensor:
        return False
    if not any(p.is_partial() and not q.is_partial()
               for p, q in zip(o._spec.placements, target.placements, strict=True)):
        return False
    if any(q.is_partial() for q in target.placements):
        return False
    # the block itself and its storage's Python object: no view, base or alias
    return torch._C._storage_Use_Count(block.untyped_storage()._cdata) <= 2


class _Replicated:
    """Wraps a fallback result: replicated, or the operand an op wrote."""

    __slots__ = ("mesh", "self", "written")

    def __init__(self, mesh, self_, written: dict) -> None:
        self.mesh, self.self, self.written = mesh, self_, written

    def __call__(self, t):
        if id(t) in self.written:
            return self.written[id(t)]
        if self.self is not None and not self.written:
            return _store(self.self, t)
        meta = TensorMeta(t.shape, t.stride(), t.dtype)
        return wrap(t, DTensorSpec(self.mesh, replicated(self.mesh), meta))


def _store(self, full: torch.Tensor):
    """An in-place op computed on the replicated value: store it in self's layout."""
    spec = self._spec
    if spec.is_replicated():
        block = full
    else:
        block = redistribute_local(full, spec.with_placements(replicated(spec.mesh)), spec)
    if block is not self._local_tensor:
        self._local_tensor.copy_(block)
    return self


def _reduce_scalar(out, how, mesh):
    if how == "all":
        flag = torch.tensor([0 if bool(out) else 1], dtype=torch.int64)
        return not bool(mesh_max(flag, mesh).item())
    return out


def _outsider_result(call: Call, plan: Plan, mesh):
    """Empty outputs of the right dtype on ranks outside the mesh; no collectives."""
    device = device_of(mesh)

    def empty(spec):
        return wrap(empty_local(spec, device), spec)

    if not (plan.fallback or not plan.out_specs):
        if len(plan.out_specs) == 1:
            return empty(plan.out_specs[0])
        return tuple(empty(s) for s in plan.out_specs)
    # Output metadata from the op on meta tensors of the global shapes.
    metas = [
        meta_tensor(s) if s is not None else o.to("meta")
        for s, o in zip(call.specs, call.operands, strict=True)
    ]
    margs, mkwargs = call.replace(metas)
    try:
        out = call.func(*margs, **mkwargs)
    except Exception:
        out = None
    if not tensor_leaves(out):
        return None
    rep = replicated(mesh)
    return rewrap(
        out,
        lambda t: empty(DTensorSpec(mesh, rep, TensorMeta(t.shape, t.stride(), t.dtype))),
        keep=False,
    )
