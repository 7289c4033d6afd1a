"""``local_map`` and ``register_sharding``, as in ``torch.distributed.tensor.experimental``.

- ``local_map(func, out_placements, in_placements, ...)``: run a function
  written for plain tensors on each rank's local blocks, and wrap its outputs
  as DTensors.
- ``register_sharding(op)``: give an op sharding strategies in PyTorch's
  format (a list of ``(output placements, input placements)`` for one mesh
  axis); they become a rule of ours (``dtensor.register_rule``), used on
  every mesh axis.

Example:
    >>> @register_sharding(torch.ops.aten._softmax.default)
    ... def softmax_strategies(x, dim, half_to_float):
    ...     dim = dim % x.ndim
    ...     out = [([Replicate()], [Replicate(), None, None])]
    ...     out += [([Shard(d)], [Shard(d), None, None]) for d in range(x.ndim) if d != dim]
    ...     return out
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

from dtensor.errors import PlacementError, UnsupportedOpError
from dtensor.placement import Placement, Replicate, Shard
from dtensor.sharding import OpCall, Sharding
from dtensor.spec import DTensorSpec

__all__ = ["local_map", "register_sharding"]


# local_map ---------------------------------------------------------------------------
def local_map(
    func: Callable | None = None,
    out_placements=None,
    in_placements=None,
    in_grad_placements=None,
    device_mesh=None,
    *,
    redistribute_inputs: bool = False,
):
    """Apply ``func`` to local blocks; wrap its outputs as DTensors.

    Args:
        func: works on plain tensors. Without it, ``local_map(...)`` is a decorator.
        out_placements: placements of each (pytree-flattened) output: one
            placement sequence for a single output, a tuple of them for several,
            ``None`` for non-tensor outputs. Global shapes are inferred
            assuming even blocks (every rank's block as large as this one's),
            as in PyTorch: for uneven outputs, build them with
            ``DTensor.from_local(..., shape=...)`` instead.
        in_placements: optional, one entry per flattened positional argument:
            the placements a DTensor argument must have (``None`` for
            non-tensors). A mismatch raises ``PlacementError`` (a ``ValueError``)
            unless ``redistribute_inputs=True``.
        in_grad_placements: optional, the layout of each input's gradient
            (``to_local(grad_placements=...)``).
        device_mesh: the outputs' mesh (default: the first DTensor argument's).

    With no DTensor argument, ``func`` runs on the arguments as given and
    its outputs are returned unwrapped (as in PyTorch).

    Example:
        >>> row_sum = local_map(lambda x: x.sum(1), out_placements=[Shard(0)],
        ...                     in_placements=([Shard(0)],))
        >>> row_sum(distribute_tensor(t, mesh, [Shard(0)]))      # no communication
    """
    if func is None:
        return functools.partial(
            local_map,
            out_placements=out_placements,
            in_placements=in_placements,
            in_grad_placements=in_grad_placements,
            device_mesh=device_mesh,
            redistribute_inputs=redistribute_inputs,
        )
    if not callable(func):
        raise PlacementError(f"local_map: func must be callable, got {type(func).__name__}")

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        return _run_local(
            func, out_placements, in_placements, in_grad_placements, device_mesh,
            redistribute_inputs, args, kwargs,
        )

    return wrapped


def _run_local(func, out_placements, in_placements, in_grad_placements, mesh,
               redistribute_inputs, args, kwargs):
    from dtensor.tensor import DTensor

    name = getattr(func, "__name__", "func")
    flat, tree = pytree.tree_flatten(args)
    for what, given in (("in_placements", in_placements),
                        ("in_grad_placements", in_grad_placements)):
        if given is not None and len(given) != len(flat):
            raise PlacementError(
                f"local_map({name}): {what} has {len(given)} entries but the call has "
                f"{len(flat)} flattened positional arguments; give one per argument "
                "(None for non-tensors)"
            )
    local_args = []
    seen = False
    for i, arg in enumerate(flat):
        want = in_placements[i] if in_placements is not None else None
        if not isinstance(arg, DTensor):
            if want is not None and not isinstance(arg, torch.Tensor):
                raise PlacementError(
                    f"local_map({name}): argument {i} is a {type(arg).__name__}, not a "
                    f"tensor, but in_placements[{i}] = {want}; pass None for it"
                )
            local_args.append(arg)
            continue
        seen = True
        mesh = mesh if mesh is not None else arg.device_mesh
        if in_placements is not None:
            if want is None:
                raise PlacementError(
                    f"local_map({name}): argument {i} is a DTensor but in_placements[{i}] "
                    "is None; give its placements"
                )
            want = tuple(want)
            if arg.placements != want:
                if not redistribute_inputs:
                    raise PlacementError(
                        f"local_map({name}): argument {i} has placements {arg.placements}, "
                        f"expected {want}. Redistribute it first or pass "
                        "redistribute_inputs=True"
                    )
                arg = arg.redistribute(arg.device_mesh, want)
        grad = in_grad_placements[i] if in_grad_placements is not None else None
        local_args.append(arg.to_local(grad_placements=grad) if grad is not None
                          else arg.to_local())
    out = func(*pytree.tree_unflatten(local_args, tree), **kwargs)
    if not seen:
        return out
    flat_out, out_tree = pytree.tree_flatten(out)
    specs = out_placements if isinstance(out_placements, tuple) else (out_placements,)
    if len(specs) != len(flat_out):
        raise PlacementError(
            f"local_map({name}): {len(flat_out)} outputs but {len(specs)} out_placements; "
            "give one placement sequence per output (a tuple of them for several)"
        )
    wrapped = []
    for j, (o, placements) in enumerate(zip(flat_out, specs, strict=True)):
        if isinstance(o, DTensor):
            raise PlacementError(
                f"local_map({name}): output {j} is already a DTensor; func must return "
                "plain tensors"
            )
        if isinstance(o, torch.Tensor):
            if placements is None:
                raise PlacementError(
                    f"local_map({name}): output {j} is a tensor but out_placements[{j}] "
                    "is None; give its placements"
                )
            wrapped.append(DTensor.from_local(o, mesh, tuple(placements)))
        else:
            if placements is not None:
                raise PlacementError(
                    f"local_map({name}): output {j} is a {type(o).__name__}, not a tensor; "
                    f"its out_placements entry must be None, got {placements}"
                )
            wrapped.append(o)
    return pytree.tree_unflatten(wrapped, out_tree)


# register_sharding -------------------------------------------------------------------
def register_sharding(op):
    """Register sharding strategies, written in PyTorch's format, for ``op``.

    The decorated function receives the op's arguments, with each tensor
    replaced by its ``DTensorSpec`` (``.ndim``, ``.shape``, ``.placements``),
    and returns a list of ``(output_placements, input_placements)`` pairs for
    ONE mesh axis: one placement per output, and one per argument of the op's
    schema (``None`` for non-tensors). On each mesh axis the first strategy
    whose tensor inputs already have those placements is used, else the one
    needing the fewest input changes (gathers count more than local slicing).
    Registering replaces the op's existing rule (``dtensor.register_rule``).

    Example:
        >>> @register_sharding(torch.ops.mylib.rowwise_scale.default)
        ... def strategies(x, scale):
        ...     return [([Shard(0)], [Shard(0), None]), ([Replicate()], [Replicate(), None])]
    """
    from dtensor.sharding import register_rule

    ops = list(op) if isinstance(op, (list, tuple)) else [op]
    for o in ops:
        if not isinstance(o, torch._ops.OpOverload):
            raise UnsupportedOpError(
                f"register_sharding: expected an op overload like "
                f"torch.ops.aten._softmax.default, got {o!r}"
            )

    def wrap(fn):
        register_rule(*ops)(functools.partial(_rule_from_strategies, fn))
        return fn

    return wrap


def _cost(have: Placement, want: Placement) -> int:
    if have == want:
        return 0
    if isinstance(want, Shard) and isinstance(have, Replicate):
        return 1  # a local slice
    return 4  # a collective


def _rule_from_strategies(fn, call: OpCall) -> Sharding:
    name = str(call.func)
    args = _with_defaults(call.func, call.args, call.kwargs)
    strategies = list(fn(*args, **call.kwargs))
    if not strategies:
        raise UnsupportedOpError(f"register_sharding({name}): the function returned no strategy")
    positions = []  # for each operand of call.specs, its schema argument index
    for i, a in enumerate(args):
        if isinstance(a, DTensorSpec):
            positions.append(i)
        elif isinstance(a, (list, tuple)) and any(isinstance(x, DTensorSpec) for x in a):
            raise UnsupportedOpError(
                f"register_sharding({name}): tensor-list arguments are not supported; "
                "use dtensor.register_rule"
            )
    if len(positions) != len(call.specs):
        raise UnsupportedOpError(
            f"register_sharding({name}): tensor keyword arguments are not supported; "
            "use dtensor.register_rule"
        )
    last = max(positions, default=-1)  # strategies may leave out trailing non-tensors
    mesh_ndim = call.specs[0].mesh.ndim if call.specs else 1
    n_out = len(strategies[0][0])
    per_axis = []
    for axis in range(mesh_ndim):
        best, best_cost = None, None
        for outs, ins in strategies:
            outs, ins = list(outs), list(ins)
            if len(outs) != n_out or len(ins) <= last:
                raise PlacementError(
                    f"register_sharding({name}): each strategy is (outputs, inputs) with "
                    f"{n_out} outputs and one input entry per argument of the schema "
                    f"({len(args)}: {_arg_names(call.func, len(args))}); "
                    f"got {len(outs)} and {len(ins)}"
                )
            cost = 0
            for k, pos in enumerate(positions):
                want = ins[pos]
                if want is None:
                    raise PlacementError(
                        f"register_sharding({name}): tensor argument {pos} has placement None "
                        "in a strategy; give Shard/Replicate/Partial"
                    )
                cost += _cost(call.specs[k].placements[axis], want)
            if best_cost is None or cost < best_cost:
                best, best_cost = (outs, [ins[p] for p in positions]), cost
        per_axis.append(best)
    inputs = tuple(tuple(per_axis[a][1][k] for a in range(mesh_ndim))
                   for k in range(len(positions)))
    outputs = tuple(tuple(per_axis[a][0][j] for a in range(mesh_ndim)) for j in range(n_out))
    return Sharding(inputs=inputs, outputs=outputs)


def _with_defaults(func, args: tuple, kwargs: dict) -> tuple:
    """``args`` with the schema's defaults filled in for the positional arguments
    left out: dispatch drops trailing arguments equal to their defaults (even
    ones passed explicitly: ``op(x, -1)`` arrives as ``(x,)``), while a strategy
    function is written against the schema (``def strategies(x, dim)``)."""
    out = list(args)
    for a in func._schema.arguments[len(args):]:
        if a.kwarg_only or a.name in kwargs or not a.has_default_value():
            break
        out.append(a.default_value)
    return tuple(out)


def _arg_names(func, n: int) -> str:
    return ", ".join(a.name for a in func._schema.arguments[:n])
