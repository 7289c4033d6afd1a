"""``fully_shard`` and ``FSDPModule``: PyTorch's FSDP2 API on dtensor's DTensor.

``fully_shard(module, mesh=...)`` turns the parameters of ``module`` (those
not taken by an earlier call on a submodule) into DTensors sharded on dim 0
over the data-parallel axis, one parameter group per call, and hooks the
module's forward: all-gather before (one collective per group), reshard
after, gather again before backward when resharded, and one reduce-scatter
per group when its gradients are ready. Call it bottom-up, then on the root.

Example:
    >>> mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    >>> for block in model.layers:
    ...     fully_shard(block, mesh=mesh)
    >>> fully_shard(model, mesh=mesh)
    >>> model.layers[0].w1.weight.placements
    (Shard(dim=0),)
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd
from torch.utils._pytree import tree_flatten, tree_map

from dtensor.fsdp.errors import FSDPError
from dtensor.fsdp.group import FSDPParam, ParamGroup, spec_of, unshard_for_forward
from dtensor.fsdp.layout import fsdp_layout
from dtensor.fsdp.policy import MixedPrecisionPolicy, OffloadPolicy, check_options
from dtensor.fsdp.rng import DataParallelRandom
from dtensor.mesh import resolve_mesh
from dtensor.tensor import DTensor

__all__ = ["FSDPModule", "fully_shard"]

_classes: dict[type, type] = {}
_NO_MP = MixedPrecisionPolicy()
_NO_OFFLOAD = OffloadPolicy()


class _State:
    def __init__(self, group: ParamGroup | None, mesh, reshard_after_forward: bool,
                 mp: MixedPrecisionPolicy) -> None:
        self.group = group
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward
        self.mp = mp
        self.is_last_backward = True
        self.is_root = True  # until a fully_shard call above takes this module in
        self.random: DataParallelRandom | None = None  # the root's, during its forward
        self.routes_draws: bool | None = None  # None until the first training forward


class FSDPModule:
    """The class ``fully_shard`` mixes into a module's class (``isinstance``
    checks as in PyTorch). Its methods act on this module's group, or with
    ``recurse=True`` on every FSDP module below it too."""

    def unshard(self, async_op: bool = False):
        """All-gather this module's parameters now; its forward then uses them."""
        group = self._fsdp_state.group
        if group is not None:
            group.unshard()
            group.install(group.unsharded_params())
        return _Done() if async_op else None

    def reshard(self) -> None:
        """Free the unsharded parameters; the module shows its sharded ones."""
        group = self._fsdp_state.group
        if group is not None:
            group.reshard()
            group.uninstall()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """False: gradients accumulate unsharded, unreduced (no communication)
        until a backward with it True reduces the sum."""
        for g in self._groups(recurse):
            g.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """False: keep the parameters unsharded after backward (no re-gather
        before the next forward; call ``reshard()`` after the optimizer step)."""
        for g in self._groups(recurse):
            g.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, *,
                                  recurse: bool = True) -> None:
        for m in self._fsdp_modules(recurse):
            m._fsdp_state.reshard_after_forward = bool(reshard_after_forward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Recorded for compatibility: collectives here finish inside backward,
        so there is no pending work for the last backward to wait on."""
        self._fsdp_state.is_last_backward = is_last_backward

    def _fsdp_modules(self, recurse: bool):
        mods = self.modules() if recurse else [self]
        return [m for m in mods if isinstance(m, FSDPModule)]

    def _groups(self, recurse: bool):
        return [m._fsdp_state.group for m in self._fsdp_modules(recurse)
                if m._fsdp_state.group is not None]


class _Done:
    def wait(self) -> None:
        return None


def fully_shard(module: nn.Module, *, mesh=None, reshard_after_forward: bool | int | None = None,
                shard_placement_fn=None, mp_policy: MixedPrecisionPolicy = _NO_MP,
                offload_policy: OffloadPolicy | None = _NO_OFFLOAD, ignored_params=None,
                dp_mesh_dims=None):
    """Shard ``module``'s parameters over the data-parallel axis of ``mesh``.

    ``mesh``: 1-D (FSDP; with parameters already DTensors on another axis of
    the same 2-D mesh, FSDP + tensor parallel) or 2-D ``(replicate, shard)``
    (HSDP). ``reshard_after_forward``: free the unsharded parameters after
    forward and gather them again in backward (default True; the root keeps
    them, as backward needs them first). Returns ``module``, now also an
    ``FSDPModule``. Unsupported PyTorch options raise ``FSDPError`` naming them.

    Example:
        >>> fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        >>> model(x).sum().backward()       # grads: DTensors, Shard(0)
    """
    check_options(module, shard_placement_fn=shard_placement_fn, offload_policy=offload_policy,
                  ignored_params=ignored_params, dp_mesh_dims=dp_mesh_dims, mp_policy=mp_policy)
    mesh = resolve_mesh(mesh, "fully_shard")
    if isinstance(module, FSDPModule):
        raise FSDPError(
            f"fully_shard: {type(module).__name__} is already sharded on "
            f"{module._fsdp_state.mesh!r}; got a second call with {mesh!r}. Call "
            "fully_shard once per module (bottom-up, then the root)"
        )
    reshard = _reshard_flag(reshard_after_forward, mesh)
    below = [m for m in module.modules() if isinstance(m, FSDPModule) and m is not module]
    for m in below:
        if m._fsdp_state.mesh != mesh:
            raise FSDPError(
                f"fully_shard: submodule {type(m).__name__} is sharded on "
                f"{m._fsdp_state.mesh!r}, but this call got {mesh!r}: the parameters of "
                "one model would live on two meshes (one optimizer, clip_grad_norm_ "
                "and checkpoints need one). Pass the same mesh to every fully_shard call"
            )
    taken = {id(p) for m in below for p in m.parameters()}
    entries: dict[int, tuple[nn.Parameter, list]] = {}
    for owner_name, owner in module.named_modules():
        for name, param in owner._parameters.items():
            if param is None or id(param) in taken:
                continue
            path = f"{owner_name}.{name}" if owner_name else name
            entries.setdefault(id(param), (param, path, []))[2].append((owner, name))
    group = None
    if entries:
        group = _build_group(list(entries.values()), mesh, mp_policy)
    state = _State(group, mesh, reshard, mp_policy)
    for m in below:
        m._fsdp_state.is_root = False
    cls = type(module)
    if cls not in _classes:
        _classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _classes[cls]
    module._fsdp_state = state
    module.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(_post_forward)
    module.register_forward_hook(_end_random, always_call=True)  # also when forward raises
    return module


def _reshard_flag(value, mesh) -> bool:
    if value is None or isinstance(value, bool):
        return value is not False
    if isinstance(value, int) and value == mesh.size(mesh.ndim - 1):
        return True  # resharding to the whole data-parallel axis is True
    raise FSDPError(
        f"fully_shard: reshard_after_forward={value!r} (resharding to a smaller world "
        "after forward) is not supported; pass True, False, or the data-parallel "
        f"size {mesh.size(mesh.ndim - 1)}"
    )


def _build_group(entries, mesh, mp: MixedPrecisionPolicy) -> ParamGroup:
    layouts = [fsdp_layout(param, path, mesh) for param, path, _ in entries]
    fsdp_mesh, shard_axis, replicate_axis = layouts[0][0]
    params = []
    for (param, _, owners), (_, _, inner) in zip(entries, layouts, strict=True):
        block = param if inner is None else param._local_tensor
        params.append(FSDPParam(owners, inner, tuple(block.shape), param.dtype))
    group = ParamGroup(params, fsdp_mesh, shard_axis, replicate_axis, mp.param_dtype,
                       mp.reduce_dtype)
    for p, (param, _, _), (_, placements, inner) in zip(params, entries, layouts, strict=True):
        block = param.detach() if inner is None else param._local_tensor.detach()
        local = group.local_rows(block).clone()
        spec = spec_of(fsdp_mesh, placements, param.shape, param.dtype)
        new = nn.Parameter(DTensor(local, spec), requires_grad=param.requires_grad)
        for owner, name in p.owners:
            owner._parameters[name] = new
    return group


# Hooks --------------------------------------------------------------------------------
def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _pre_forward(module, args, kwargs):
    state: _State = module._fsdp_state
    if state.is_root and state.random is None and module.training and _routes_draws(module):
        first = next((t for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        state.random = DataParallelRandom(state.mesh, None if first is None else first.shape[0])
        state.random.__enter__()
    if state.group is not None:
        state.group.install(unshard_for_forward(state.group))
    mp = state.mp
    if mp.param_dtype is not None and mp.cast_forward_inputs:
        args, kwargs = _cast((args, kwargs), mp.param_dtype)
    return args, kwargs


def _post_forward(module, args, output):
    state: _State = module._fsdp_state
    group = state.group
    if group is not None and not _in_backward():
        training = torch.is_grad_enabled() and group.outputs is not None
        group.uninstall()
        if not training or (state.reshard_after_forward and not state.is_root):
            group.reshard()
        if training:
            _hook_outputs(output, group)
    if state.mp.output_dtype is not None:
        output = _cast(output, state.mp.output_dtype)
    return output


def _routes_draws(module) -> bool:
    """Whether this training forward routes draws through ``DataParallelRandom``.

    The mode sees every torch call of the forward (a Python call each, ~10 %
    of a step), so it stays on only for models that draw: those holding a
    dropout module, and those whose first training forward called a routed
    op (``F.dropout``, ``rand_like``, ``randn_like``) on a plain tensor; that
    first forward runs routed, to find out, unless the model holds compiled
    blocks."""
    state: _State = module._fsdp_state
    if state.routes_draws is None:
        mods = list(module.modules())
        if any(isinstance(m, _DropoutNd) and m.p > 0 for m in mods):
            state.routes_draws = True
        elif any(_compiled(m) for m in mods):
            # A routed first forward would compile each block a second time
            # (the mode is part of the graph's guards): no probe there.
            state.routes_draws = False
    return state.routes_draws is not False


def _compiled(m) -> bool:
    """``torch.compile(m)`` (an OptimizedModule) or ``m.compile()``."""
    if getattr(m, "_compiled_call_impl", None) is not None:
        return True
    frames = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing compiled
    return frames is not None and isinstance(m, frames.OptimizedModule)


def _end_random(module, args, output):
    state: _State = module._fsdp_state
    if state.random is not None:
        state.random.__exit__(None, None, None)
        if state.routes_draws is None:  # the first training forward decides
            state.routes_draws = state.random.drew
        state.random = None


def _hook_outputs(output, group: ParamGroup) -> None:
    """Before backward reaches this module: gather again and show the
    unsharded parameters (activation checkpointing recomputes with them)."""
    outs = group.outputs

    def pre_backward(grad):
        if group.outputs is outs and outs is not None:
            group.unshard()
            group.install(outs)
        task = torch._C._current_graph_task_id()
        if group.final_task != task:
            group.final_task = task
            _queue_final(group)
        return grad

    for t in tree_flatten(output)[0]:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(pre_backward)


def _queue_final(group: ParamGroup) -> None:
    # A group whose parameters got no gradient never runs its backward: the end of
    # backward reshards it, or the next forward would see stale parameters.
    def final():
        group.final_task = None
        if group.is_unsharded and group.reshard_after_backward:
            group.reshard()
            group.uninstall()
            group.outputs = None

    torch.autograd.Variable._execution_engine.queue_callback(final)


def _cast(tree, dtype):
    def cast(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t

    return tree_map(cast, tree)
