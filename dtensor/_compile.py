"""torch.compile support: what Dynamo sees of meshes, placements and DTensors.

A DTensor is a traceable wrapper subclass (``__tensor_flatten__`` /
``__tensor_unflatten__`` in ``dtensor.tensor``), so ops on DTensors trace down
to ops on local tensors. Three more things make whole programs capturable:

- Placements and meshes are opaque *value* types: Dynamo treats each one as a
  constant, guards on it with ``==`` (so equal meshes share compiled code and
  a different mesh or placement recompiles) and writes it into generated code
  with its ``__fx_repr__``.
- ``from_local``, ``to_local``, ``redistribute``, ``full_tensor`` and
  ``distribute_tensor`` appear in Dynamo's graph as single calls with those
  constants as arguments; AOTAutograd then traces through them (their
  autograd Functions included) down to local ops and functional collectives
  (``dtensor._comm`` switches to ``torch.distributed._functional_collectives``
  while compiling).
- Random ops draw through ``dtensor::philox_block``, an ordered (effectful)
  custom op that reads and advances the process-global generator when the
  compiled program *runs*, so compiled and eager draws are the same numbers.

Dynamo does not trace into the rest of ``dtensor`` (the package is on its
skip list): other dtensor calls in compiled code graph-break and run eagerly.
Module hooks are the exception: ``traced_hook`` marks one for tracing, so the
parallel styles' input/output hooks (from_local, redistribute, to_local) land
in the compiled module's graph instead of splitting it at every hooked layer.

Example:
    >>> @torch.compile(fullgraph=True)
    ... def step(t):
    ...     x = DTensor.from_local(t, mesh, [Shard(0)])
    ...     return (x * 2).redistribute(mesh, [Replicate()]).to_local()
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from types import MethodType

import torch
from torch._library.opaque_object import MemberType, register_opaque_type

from dtensor.mesh import DeviceMesh
from dtensor.placement import Partial, Replicate, Shard

__all__ = ["draw", "trace_as_calls", "trace_hook_later", "trace_method_later", "traced_hook",
           "tracing"]

log = logging.getLogger(__name__)

#: True while torch.compile traces (Dynamo and AOTAutograd alike).
tracing = torch.compiler.is_compiling


# Opaque value types ---------------------------------------------------------
_REAL = MemberType.USE_REAL
_PLACEMENT_MEMBERS = {
    name: _REAL
    for name in ("is_shard", "is_replicate", "is_partial", "kind", "__eq__", "__ne__", "__hash__")
}
def _register_opaque_values() -> bool:
    """Placements and meshes as opaque values in compiled graphs; False on a
    torch whose registry takes only ``OpaqueBase`` subclasses (2.11): there
    ``import dtensor`` still works and compiled code meets them as constants
    or graph breaks."""
    try:
        for cls, fields in ((Shard, ("dim",)), (Replicate, ()), (Partial, ("reduce_op",))):
            register_opaque_type(
                cls, typ="value", members=_PLACEMENT_MEMBERS | {f: _REAL for f in fields}
            )
        register_opaque_type(
            DeviceMesh,
            typ="value",
            members={
                name: _REAL
                for name in (
                    "device_type", "mesh_dim_names", "ndim", "shape", "ranks", "size",
                    "get_rank", "get_coordinate", "get_local_rank", "is_member",
                    "__getitem__", "__eq__", "__ne__", "__hash__",
                )
            },
        )
    except TypeError as e:
        log.info("dtensor: placements are not opaque values on torch %s: %s",
                 torch.__version__, e)
        return False
    return True


#: Whether placements and meshes are opaque values in compiled graphs.
OPAQUE_VALUES = _register_opaque_values()


# In-graph calls ---------------------------------------------------------------
def trace_as_calls(*fns: Callable) -> None:
    """Have Dynamo record calls to ``fns`` as graph nodes instead of tracing them.

    Dynamo never traces into the rest of ``dtensor`` either: calls into it
    from compiled code graph-break (and run eagerly), and Dynamo never starts
    compiling a frame inside it. Registered once ``torch._dynamo`` is
    imported (importing it here would add about a second to ``import dtensor``).
    """
    _pending.extend(fns)
    if "torch._dynamo" in sys.modules:
        _register_with_dynamo()
    else:
        _watch_dynamo_import()


def _watch_dynamo_import() -> None:
    if not any(isinstance(f, _DynamoImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _DynamoImportHook())


_pending: list[Callable] = []
_skipped = False


def _register_with_dynamo() -> None:
    global _skipped
    import torch._dynamo

    if not _skipped:
        _skipped = True
        torch._dynamo.trace_rules.add("dtensor")
    while _pending:
        torch._dynamo.allow_in_graph(_pending.pop())
    _trace_late_hooks()


class _DynamoImportHook(importlib.abc.MetaPathFinder):
    """Runs ``_register_with_dynamo`` right after ``torch._dynamo`` is imported."""

    def find_spec(self, name, path, target=None):
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module) -> None:
            exec_module(module)
            try:
                _register_with_dynamo()
            except Exception:  # never break torch._dynamo's import
                log.exception("dtensor: registering DTensor calls with Dynamo failed")

        spec.loader.exec_module = exec_then_register
        return spec


# Module hooks traced into the caller's graph ---------------------------------------
def traced_hook(hook: Callable) -> Callable:
    """``hook`` wrapped so that torch.compile traces it (and what it calls in
    ``dtensor``) inline instead of graph-breaking at it.

    The parallel styles' forward (pre-)hooks only wrap, redistribute and unwrap
    DTensors, all of which Dynamo records as calls; skipped, each hooked
    ``nn.Linear`` became a graph of its own (a transformer block of 7 linears:
    13 graphs, each paying guards and subclass wrapping per call). Eager calls
    cost one no-op ``with`` (``torch._dynamo.dont_skip_tracing`` patches the
    Dynamo config on every eager call: ~40 us). This imports ``torch._dynamo``;
    ``trace_hook_later`` / ``trace_method_later`` wait for it instead.

    Example:
        >>> module.register_forward_pre_hook(traced_hook(lambda mod, args: args))
    """
    try:
        from torch._dynamo.decorators import DynamoConfigPatchProxy
    except ImportError:  # another torch: hooks graph-break, results are the same
        return hook
    global _TRACE_INTO
    if _TRACE_INTO is None:

        class _TraceInto(DynamoConfigPatchProxy):
            # Dynamo reads ``changes`` while tracing and applies them itself;
            # eager runs need no patched config.
            def __enter__(self) -> None:
                return None

            def __exit__(self, *exc) -> None:
                return None

        _TRACE_INTO = _TraceInto(torch._dynamo.config.patch(dont_skip_tracing=True))
    return _TRACE_INTO(hook)


_TRACE_INTO = None

# Hooks installed before torch._dynamo was imported, made traced when it is:
# (weak ref to the holder, key) with holder[key] (a hooks dict) or
# getattr(holder, key) (a bound method) to swap. Nothing can compile before
# Dynamo is imported, so eager code never pays its import (~0.7 s, once per
# process: every parallelize_module in a fresh process paid it).
_LATE: list = []
_LATE_LOCK = threading.Lock()


def trace_hook_later(handle) -> None:
    """Make the module hook behind ``handle`` (``register_forward_(pre_)hook``'s
    return) traced by torch.compile, as ``traced_hook`` does, once
    ``torch._dynamo`` is imported (now, if it is).

    Example:
        >>> trace_hook_later(module.register_forward_pre_hook(hook))
    """
    if not hasattr(handle, "hooks_dict_ref") or not hasattr(handle, "id"):
        raise TypeError(f"trace_hook_later: expected the handle register_forward_hook or "
                        f"register_forward_pre_hook returns, got {handle!r}")
    _later(handle.hooks_dict_ref, handle.id)


def trace_method_later(obj, name: str) -> None:
    """Make the bound method ``obj.<name>`` (a function set on ``obj``)
    traced by torch.compile once ``torch._dynamo`` is imported (now, if it is)."""
    if not isinstance(getattr(obj, "__dict__", {}).get(name), MethodType):
        raise TypeError(f"trace_method_later: {type(obj).__name__}.{name} is not a method "
                        f"set on the object ({getattr(obj, name, None)!r}); set it with "
                        f"obj.{name} = types.MethodType(fn, obj) first")
    _later(weakref.ref(obj), (name,))


def _later(ref, key) -> None:
    if "torch._dynamo" in sys.modules:
        _swap(ref, key)
        return
    with _LATE_LOCK:
        _LATE.append((ref, key))
    _watch_dynamo_import()


def _swap(ref, key) -> None:
    holder = ref()
    if holder is None:
        return
    if type(key) is tuple:  # a bound method on an object
        (name,) = key
        bound = getattr(holder, name, None)
        if isinstance(bound, MethodType) and bound.__self__ is holder:
            setattr(holder, name, MethodType(traced_hook(bound.__func__), holder))
    elif key in holder:  # a hooks dict; a removed hook is gone
        holder[key] = traced_hook(holder[key])


def _trace_late_hooks() -> None:
    with _LATE_LOCK:
        late = list(_LATE)
        _LATE.clear()
    for ref, key in late:
        _swap(ref, key)


# Random draws at run time ---------------------------------------------------------
_BLOCKS = (
    "uniform_block", "normal_block", "exponential_block", "random_block",
    "randint_block", "bernoulli_block",
)


@torch.library.custom_op("dtensor::philox_block", mutates_args=())
def _philox_block(
    block: str,
    params: str,
    global_shape: Sequence[int],
    local_offset: Sequence[int],
    local_shape: Sequence[int],
    p: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """This rank's block of a fresh draw; advances the generator like eager."""
    from dtensor import _seeding
    from dtensor import random as rng

    kwargs = _decode(params)
    if p is not None:
        kwargs["p"] = p
    seed, offset = _seeding.take()
    return getattr(rng, block)(
        seed, offset, global_shape, local_offset, local_shape, device=device, **kwargs
    )


@_philox_block.register_fake
def _(block, params, global_shape, local_offset, local_shape, p, device):
    return torch.empty(local_shape, dtype=_decode(params)["dtype"], device=device)


# Ordered: never reordered against other draws, deduplicated or dropped.
torch.library._register_effectful_op(
    "dtensor::philox_block", torch._library.effects.EffectType.ORDERED
)


def _decode(params: str) -> dict:
    kwargs = json.loads(params)
    kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    return kwargs


def draw(
    block: str,
    params: dict,
    global_shape: Sequence[int],
    local_offset: Sequence[int],
    local_shape: Sequence[int],
    device,
) -> torch.Tensor:
    """A draw recorded in the traced program: ``dtensor.random.<block>`` with
    ``params`` (scalars, a ``dtype``, tensor ``p``), evaluated at run time."""
    if block not in _BLOCKS:
        raise AssertionError(f"draw: unknown block function {block!r}")
    params = dict(params)
    p = params.pop("p", None)
    if not isinstance(p, torch.Tensor):
        if p is not None:
            params["p"] = p
        p = None
    params["dtype"] = str(params["dtype"]).removeprefix("torch.")
    return torch.ops.dtensor.philox_block(
        block,
        json.dumps(params, sort_keys=True),
        list(global_shape),
        list(local_offset),
        list(local_shape),
        p,
        torch.device(device) if device is not None else torch.device("cpu"),
    )
