"""``distribute_module``: turn a module's parameters into DTensors and hook its I/O.

The three callables mirror ``torch.distributed.tensor.distribute_module``:
``partition_fn(name, submodule, mesh)`` lays out parameters, ``input_fn(module,
inputs, mesh)`` runs as a forward pre-hook and ``output_fn(module, outputs,
mesh)`` as a forward hook. Parameters and buffers the partition function left
alone are replicated over the mesh.

Example:
    >>> mesh = init_device_mesh("cpu", (2,))
    >>> def shard_rows(name, mod, mesh):
    ...     if isinstance(mod, nn.Linear):
    ...         mod.weight = nn.Parameter(distribute_tensor(mod.weight, mesh, [Shard(0)]))
    >>> m = distribute_module(nn.Linear(4, 4), mesh, shard_rows)
    >>> m.weight.placements, m.bias.placements
    ((Shard(dim=0),), (Replicate(),))
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from types import FunctionType
from typing import Any

import torch
from torch import nn

from dtensor._compile import trace_hook_later
from dtensor.distribute import distribute_tensor
from dtensor.errors import PlanError, ShardingError
from dtensor.mesh import DeviceMesh, resolve_mesh
from dtensor.placement import Replicate
from dtensor.spec import (
    DTensorSpec,
    TensorMeta,
    contiguous_stride,
    normalize_placements,
)
from dtensor.tensor import DTensor

__all__ = ["distribute_module"]


def distribute_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    partition_fn: Callable[[str, nn.Module, DeviceMesh], None] | None = None,
    input_fn: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None,
    output_fn: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None,
) -> nn.Module:
    """Distribute ``module``'s parameters over ``device_mesh`` and install I/O hooks.

    Args:
        module: the module, changed in place and returned.
        device_mesh: the mesh; default the current mesh (``with mesh:``).
        partition_fn: called as ``partition_fn(name, submodule, mesh)`` for
            every submodule (``named_modules`` order); it may replace
            parameters with DTensor parameters. Everything left a plain
            tensor is then replicated (broadcast from the mesh's first rank).
        input_fn: ``input_fn(module, inputs, mesh) -> inputs``, a forward pre-hook.
        output_fn: ``output_fn(module, outputs, mesh) -> outputs``, a forward hook.

    Example:
        >>> m = distribute_module(nn.Linear(4, 4), mesh)   # all replicated
        >>> m.weight.placements
        (Replicate(),)
    """
    if getattr(module, "_distribute_module_applied", False):
        raise ShardingError(
            f"distribute_module: already applied to this {type(module).__name__}; "
            "call it once per module (a second call would hook the inputs twice)"
        )
    mesh = resolve_mesh(device_mesh, "distribute_module")
    in_hook = _hook("input_fn", input_fn, mesh)
    out_hook = _hook("output_fn", output_fn, mesh)
    for name, sub in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, sub, mesh)
        replicate_leftovers(sub, mesh)
    # torch.compile traces the hooks into the module's graph.
    if in_hook is not None:
        trace_hook_later(module.register_forward_pre_hook(
            lambda mod, inputs: in_hook(mod, inputs)))
    if out_hook is not None:
        trace_hook_later(module.register_forward_hook(
            lambda mod, inputs, outputs: out_hook(mod, outputs)))
    module._distribute_module_applied = True
    return module


def replicate_leftovers(module: nn.Module, mesh: DeviceMesh, src_data_rank: int | None = 0) -> None:
    """Replicate ``module``'s own plain-tensor parameters and buffers over ``mesh``."""
    for key, param in list(module._parameters.items()):
        if param is not None and not isinstance(param, DTensor):
            dt = distribute_param(param.data, mesh, [Replicate()] * mesh.ndim, src_data_rank)
            module.register_parameter(
                key, nn.Parameter(dt, requires_grad=param.requires_grad)
            )
    for key, buf in list(module._buffers.items()):
        if buf is not None and not isinstance(buf, DTensor):
            module._buffers[key] = distribute_param(
                buf, mesh, [Replicate()] * mesh.ndim, src_data_rank
            )


def distribute_param(
    tensor: torch.Tensor, mesh: DeviceMesh, placements, src_data_rank: int | None = 0
) -> DTensor:
    """``distribute_tensor`` that also lays out meta tensors (without communicating).

    A module built on the meta device has no values to broadcast; its DTensor
    parameters get their values later from ``to_empty`` + ``reset_parameters``.
    """
    if tensor.is_meta:
        spec = DTensorSpec(
            mesh,
            normalize_placements(placements, mesh.ndim, tensor.ndim),
            TensorMeta(tensor.shape, contiguous_stride(tensor.shape), tensor.dtype),
        )
        shape, _ = spec.local_block(mesh.get_coordinate())
        return DTensor(torch.empty(shape, dtype=tensor.dtype, device="meta"), spec)
    return distribute_tensor(tensor, mesh, placements, src_data_rank=src_data_rank)


def _arg_count(fn) -> int:
    """How many arguments ``fn`` takes; 3 where it cannot be told."""
    # NOTE: a plain function's or bound method's count is read from its code
    # (the parallel styles pass bound methods, two per layer):
    # inspect.signature cost ~30 us a call, 12 per 6-layer plan.
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    if (type(func) is FunctionType and code is not None and not func.__defaults__
            and not func.__kwdefaults__
            and not code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)
            and not code.co_kwonlyargcount):
        return code.co_argcount - (1 if fn is not func else 0)
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins without a signature: assume 3
        return 3


def _hook(what: str, fn, mesh: DeviceMesh):
    """Adapt a user hook of 3 (module, io, mesh) or, deprecated, 2 (io, mesh) arguments."""
    if fn is None:
        return None
    nargs = _arg_count(fn)
    if nargs == 3:
        return lambda mod, io: fn(mod, io, mesh)
    if nargs == 2:
        warnings.warn(
            f"distribute_module: {what} taking (inputs, device_mesh) is deprecated; "
            "take (module, inputs, device_mesh)",
            FutureWarning,
            stacklevel=3,
        )
        return lambda mod, io: fn(io, mesh)
    raise PlanError(
        f"distribute_module: {what} must take 3 arguments (module, inputs, "
        f"device_mesh), got {nargs}: {fn!r}. Fix its signature."
    )
