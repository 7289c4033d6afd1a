"""Which drawn values a simulated rank may get as a copy, and the copy.

A value that holds no rank state (numbers, shapes, dtypes, placements, plain
tensors, containers and frozen dataclasses of them) is copied to every rank;
any other value (a mesh holds its rank's groups) is drawn again on each rank
(``launch.sim.draws``). ``private`` is the copy one rank gets: the fast path
for plain tensors and containers of them, ``copy.deepcopy`` otherwise.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import types
from typing import Any

import torch

__all__ = ["plain", "private"]

_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), range)


def private(value: Any) -> Any:
    """A copy of a drawn value for one rank (a real rank draws its own object)."""
    if isinstance(value, _IMMUTABLE):
        return value
    if type(value) is tuple and all(isinstance(v, _IMMUTABLE) for v in value):
        return value
    fast = _copy_plain(value, {}, 0)
    if fast is not _SLOW:
        return fast
    try:
        return copy.deepcopy(value)
    except Exception:  # uncopyable: shared, as the engine's own object
        return value


_SLOW = object()  # _copy_plain's "not mine: deepcopy it"


def _copy_plain(value: Any, storages: dict, depth: int) -> Any:
    """``copy.deepcopy(value)`` for immutable scalars, plain dense tensors and
    tuples/lists of them, or ``_SLOW``. ``Tensor.__deepcopy__`` goes through
    typed-storage wrappers and ``copy``'s memo in Python: three times the
    cost, and drawn tensors are most of the copies (a copy per rank but one
    of every drawn value). Same result: each storage copied once per value
    (views drawn together stay views of one copy), offset, strides and
    ``requires_grad`` kept."""
    if isinstance(value, _IMMUTABLE):
        return value
    t = type(value)
    if t is torch.Tensor:
        if (value.layout != torch.strided or value.is_quantized or value.is_meta
                or value.grad is not None or value.is_conj() or value.is_neg()
                or value.__dict__ or value.grad_fn is not None):
            return _SLOW
        src = value.untyped_storage()
        key = src.data_ptr() if src.nbytes() else None
        storage = storages.get(key) if key is not None else None
        if storage is None and key is not None and value.storage_offset() == 0 \
                and src.nbytes() == value.numel() * value.element_size() \
                and value.is_contiguous():
            # It fills its storage alone (most drawn tensors): a clone has the
            # same strides and a storage of the same size; 1.3 us, where the
            # storage's Python clone and set_ below take 7.
            out = value.detach().clone()
            storages[key] = out.untyped_storage()  # a view drawn with it follows
            return out.requires_grad_() if value.requires_grad else out
        if storage is None:
            storage = src.clone()
            if key is not None:
                storages[key] = storage
        out = torch.empty(0, dtype=value.dtype, device=value.device).set_(
            storage, value.storage_offset(), value.size(), value.stride())
        if value.requires_grad:
            out.requires_grad_()
        return out
    if (t is tuple or t is list) and depth < 8:
        items = [_copy_plain(v, storages, depth + 1) for v in value]
        if any(v is _SLOW for v in items):
            return _SLOW
        if t is tuple and all(a is b for a, b in zip(items, value, strict=True)):
            return value  # as deepcopy: a tuple of shared values is itself shared
        return t(items)
    fields = _frozen_fields(t)
    if fields is None:
        return value if t in _ATOMIC else _SLOW
    # A frozen dataclass of values that need no copy (placements, layouts,
    # op cases) is itself one: shared, where deepcopy rebuilt it field by field.
    if depth < 8 and all(_copy_plain(getattr(value, f), storages, depth + 1)
                         is getattr(value, f) for f in fields):
        return value
    return _SLOW


_TORCH_ATOMIC: set = set()  # dtypes, devices, ops...: immutable, filled on first use
_ATOMIC: set = set()  # those, functions (deepcopy shares them) and enums seen
_FROZEN: dict = {}  # type -> its field names if a frozen dataclass, else None


def _torch_atomic() -> set:
    if not _TORCH_ATOMIC:
        _TORCH_ATOMIC.update((torch.dtype, torch.device, torch.layout, torch.memory_format,
                              types.BuiltinFunctionType, torch._ops.OpOverload,
                              torch._ops.OpOverloadPacket))
    return _TORCH_ATOMIC


def _frozen_fields(t: type) -> tuple[str, ...] | None:
    if t not in _FROZEN:
        if not _ATOMIC:
            _ATOMIC.update(_torch_atomic(), (types.FunctionType,))
        if issubclass(t, enum.Enum):
            _ATOMIC.add(t)
        params = getattr(t, "__dataclass_params__", None)
        _FROZEN[t] = (tuple(f.name for f in dataclasses.fields(t))
                      if params is not None and params.frozen else None)
    return _FROZEN[t]


def plain(value: Any, depth: int = 0) -> bool:
    """Whether a drawn value holds no rank state, so that a copy of it is what
    each rank would have drawn: immutable scalars, dtypes and devices, exact
    ``torch.Tensor`` objects (a subclass such as a DTensor holds a mesh),
    containers and dataclasses of those, functions without closures."""
    if depth > 20:
        return False
    t = type(value)
    if isinstance(value, _IMMUTABLE) or t is slice or t in _torch_atomic():
        return True
    if isinstance(value, enum.Enum):
        return True
    if t in (tuple, list, set, frozenset):
        return all(plain(v, depth + 1) for v in value)
    if t is dict:
        return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in value.items())
    if t is torch.Tensor:
        return True
    if t is types.FunctionType:
        return value.__closure__ is None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return all(plain(getattr(value, f.name), depth + 1)
                   for f in dataclasses.fields(value))
    return False
