"""The quickest Python callable that runs exactly one op overload.

``torch.ops`` overloads parse their arguments through a generic schema path;
the generated Python bindings (``torch.add``, ``Tensor.add_``) do it ~0.3 µs
faster. A binding stands in for an overload only where a probe records that
it calls that overload itself, once, with the same arguments. Overload
resolution depends only on the argument types, so the op's record keeps the
verdict per argument types (``OpInfo.bindings``).

The probe runs no kernel on data: it calls each candidate on meta tensors of
the local blocks' shapes and stops the call where it reaches the dispatcher
(``_first_call``). The blocks an op meets before redistribution need not fit
together (a ``(0, 4)`` gradient block beside a ``(4, 4)`` output), and some
CPU kernels check no shapes: ``_log_softmax_backward_data`` divides by zero
and kills the process (``tools/log_softmax_backward_sigfpe.py``).
"""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["probe_binding"]


class _Reached(Exception):
    """Raised by ``_Stop`` once the candidate's call reaches the dispatcher."""


class _Stop(TorchDispatchMode):
    """Records the first op that reaches the dispatcher and runs nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.call = None

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # NOTE: True (torch's default) wraps __torch_dispatch__ in
        # torch._dynamo.disable, whose first call imports torch._dynamo
        # (~0.8 s): the first op of every fresh process paid it. Nothing runs
        # compiled inside this mode.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.call = (func, args, kwargs or {})
        raise _Reached


class _Record(_Stop):
    """Records every op that reaches the dispatcher and runs it (on meta)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _same(a, b) -> bool:
    """Same tensors (by identity) and same values of the same types."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _holds_tensors(x) -> bool:
    return isinstance(x, (list, tuple)) and any(isinstance(y, torch.Tensor) for y in x)


def probe_binding(func, loc, kwargs):
    """The binding for ``func`` on local arguments like ``loc``, else ``func._op``.

    >>> t = torch.ones(2, 2)
    >>> probe_binding(torch.ops.aten.add.Tensor, [t, t], {}) is torch.add
    True
    """
    if not all(type(x) is torch.Tensor and x.layout is torch.strided
               for x in loc if isinstance(x, torch.Tensor)):
        return func._op  # subclasses and sparse blocks: no stand-ins of their kind
    # NOTE: lists of tensors (the foreach ops) take the generic call: the
    # argument-type signature that keys the verdict does not see their contents.
    if any(map(_holds_tensors, loc)) or any(map(_holds_tensors, kwargs.values())):
        return func._op
    pargs = _meta_args(loc)
    for cand in _candidates(func):
        if _calls_func(cand, func, pargs, kwargs):
            return cand
    return func._op


def _candidates(func):
    name = func._schema.name.split("::")[-1]
    found = (getattr(torch._C._VariableFunctions, name, None),
             getattr(torch._C.TensorBase, name, None))
    return [c for c in found if c is not None]


def _calls_func(cand, func, pargs, kwargs) -> bool:
    """Whether ``cand(*pargs, **kwargs)`` calls ``func`` once, with those arguments."""
    first = _first_call(cand, pargs, kwargs)
    if first is None:
        return False
    f, a, k = first
    if f is not func or not _same(list(a), pargs) or not _same(k, kwargs):
        return False
    if not _composite_sibling(func):
        # The candidate reached ``func`` straight from its argument parser: a
        # generated binding makes one dispatcher call and returns its result.
        return True
    # Another overload of the name decomposes into ops the dispatcher sees,
    # and may call ``func`` and then more: count on meta kernels (no data).
    rec = _Record()
    try:
        with rec:
            cand(*pargs, **kwargs)
    except Exception:  # no meta kernel, or arguments it refuses
        return False
    return len(rec.calls) == 1


def _first_call(cand, pargs, kwargs):
    """``(op, args, kwargs)`` of the first dispatcher call ``cand`` makes, or None."""
    stop = _Stop()
    try:
        with stop:
            cand(*pargs, **kwargs)
    except _Reached:
        return stop.call
    except Exception:  # arguments the candidate does not take
        return None
    return None  # returned without reaching the dispatcher


@functools.lru_cache(maxsize=None)
def _composite_sibling(func) -> bool:
    """Whether another overload of ``func``'s name is a composite (its kernel
    calls other ops through the dispatcher)."""
    packet = func.overloadpacket
    for name in packet.overloads():
        try:
            other = getattr(packet, name)
            if other is not func and other.has_kernel_for_dispatch_key(
                    torch._C.DispatchKey.CompositeImplicitAutograd):
                return True
        except (AttributeError, RuntimeError):  # TorchScript-only overloads (add.t)
            continue
    return False


def _meta_args(loc):
    return [
        torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        if isinstance(x, torch.Tensor)
        else x
        for x in loc
    ]
