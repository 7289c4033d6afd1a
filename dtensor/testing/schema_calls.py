"""Calls of every registered rule's ops, built from the ops' own schemas.

``sample_calls()`` gives, for each op overload with a rule in
``dtensor.rules.RULES`` (packets expanded to their overloads), one way to
call it: argument values read off its schema (a dim is 0, a size list fits
the tensors, a ``Scalar`` is 2, optional arguments keep their defaults) and
the tensor operands' shapes found by trying a few shape patterns on one
device. A rule added to ``RULES`` is drawn by the property suite
(``tests/properties/test_every_rule.py``) with no test written for it; an op
none of the patterns can call is listed by ``uncallable()`` so a test names it.

Example:
    >>> call = sample_calls()[torch.ops.aten.mm.default]
    >>> call.shapes
    ((4, 4), (4, 4))
    >>> out = call.run([torch.ones(s) for s in call.shapes])
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SampleCall", "overloads", "registered", "sample_calls", "uncallable"]

_N = 4  # every side: 4 rows over 3 ranks or 8 is uneven, over 2 or 4 even
# Tensor arguments whose values are indices (int64 in [0, _N)) or masks.
_INDEX_NAMES = {"index", "indices", "target"}
_MASK_NAMES = {"mask"}
# Boundaries that bucketize/searchsorted need sorted along their last dim
# (undefined otherwise): int64 like indices, so they keep the arange values
# (0.._N-1 along each row) where drawn operands take random floats.
_SORTED_NAMES = {"boundaries", "sorted_sequence"}
# Patterns of tensor-operand ranks tried in order (per operand, cycled).
_NDIM_PATTERNS = ((2,), (1,), (3,), (0,), (2, 1), (1, 2), (3, 2), (2, 0), (3, 3, 2), (1, 0),
                  (2, 3, 3), (0, 2, 2), (0, 2, 1, 0), (4, 3), (0, 4, 3, 0), (4,), (4, 4, 4),
                  (5,))
_INT_ARGS = {"dim": 0, "dim0": 0, "dim1": 1, "k": 1, "reduction": 1, "num_weights": _N,
             "padding_idx": -1, "ignore_index": -100, "index": 0, "split_size": 2,
             "start": 0, "end": 2, "step": 1}
_INT_LIST_ARGS = {"dim": [0], "dims": [0], "normalized_shape": [_N], "split_sizes": [1, 3],
                  "shifts": [1], "output_mask": [True, True, True], "kernel_size": [2, 2],
                  "output_size": [2, 2], "repeats": [3, 2, 1]}


@dataclass(frozen=True)
class SampleCall:
    """One way to call ``func``: tensor operands of ``shapes`` and ``dtypes``
    at the schema positions ``slots`` (``(name, i)``: argument ``name``, list
    member ``i`` or None), other arguments fixed."""

    func: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    slots: tuple[tuple[str, int | None], ...]
    args: dict  # argument name -> value, tensors left out
    kwarg_names: frozenset

    def run(self, tensors) -> Any:
        """``func`` on ``tensors`` (one per slot, in order)."""
        values = dict(self.args)
        for (name, i), t in zip(self.slots, tensors, strict=True):
            if i is None:
                values[name] = t
            else:
                values.setdefault(name, [])
                values[name] = [*values[name], t]
        pos, kw = [], {}
        gap = False  # after a left-out argument, the rest go by name
        for a in self.func._schema.arguments:
            if a.name not in values:
                gap = True
            elif gap or a.name in self.kwarg_names:
                kw[a.name] = values[a.name]
            else:
                pos.append(values[a.name])
        return self.func(*pos, **kw)

    def __repr__(self) -> str:  # rank-independent
        return f"SampleCall({self.func}, {list(self.shapes)})"


def overloads(key) -> list:
    """The op overloads a ``RULES`` key stands for (a packet: all of them)."""
    if isinstance(key, torch._ops.OpOverload):
        return [key]
    return [getattr(key, name) for name in key.overloads()]


def registered() -> list:
    """Every op overload with a rule in ``dtensor.rules.RULES``, in table order."""
    from dtensor.rules import RULES

    return [f for key in RULES for f in overloads(key)]


def _base(t):
    return t.getElementType() if isinstance(t, torch.OptionalType) else t


def _is_tensor(t) -> bool:
    return isinstance(_base(t), torch.TensorType)


def _is_tensor_list(t) -> bool:
    # ``Tensor?[]`` (index_put's indices) is called with tensors in every slot.
    t = _base(t)
    return isinstance(t, torch.ListType) and _is_tensor(t.getElementType())


def _value(a, func_name: str):
    """A value for non-tensor argument ``a`` (``_SKIP``: leave it out)."""
    t = _base(a.type)
    if a.has_default_value() and a.name not in ("dim", "dims"):
        return _SKIP
    if isinstance(a.type, torch.OptionalType) and not a.has_default_value():
        return None  # Tensor? weight without a default: pass None
    if str(_base(a.real_type)) == "ScalarType":  # an int in the type, a dtype in Python
        return torch.float32
    if isinstance(t, (torch.IntType, torch.SymIntType)):
        if a.name == "reduction" and func_name.endswith("_backward") and (
                "nll" not in func_name):
            return 0  # "none": grad_output has self's shape, as autograd passes it
        return _INT_ARGS.get(a.name, 1)
    if isinstance(t, torch.ListType):
        el = t.getElementType()
        if isinstance(el, (torch.IntType, torch.SymIntType)):
            if a.name == "output_size" and "upsample" in func_name:
                return [2] * (1 if "1d" in func_name else 3 if "3d" in func_name else 2)
            if a.name == "size":
                return [2, 2] if func_name.startswith("new_") else [-1]
            return [2, 1] if a.name == "stride" else _INT_LIST_ARGS.get(a.name, [0])
        if isinstance(el, torch.BoolType):
            return _INT_LIST_ARGS.get(a.name, [True])
        if isinstance(el, torch.NumberType):
            return [2, 3]
        return _SKIP
    if isinstance(t, torch.NumberType):
        return 2
    if isinstance(t, torch.FloatType):
        return 0.1 if a.name != "eps" else 1e-5
    if isinstance(t, torch.BoolType):
        # batch norm: eval mode without running statistics crashes the CPU kernel
        return a.name == "training"
    return _SKIP


_SKIP = object()


def _probe(func) -> SampleCall | None:
    args = func._schema.arguments
    name = func._schema.name.split("::")[-1]
    tensor_args = [a for a in args if _is_tensor(a.type)
                   and not isinstance(a.type, torch.OptionalType)]
    # amsgrad=False: the max_exp_avg_sqs list stays empty
    list_args = [a for a in args if _is_tensor_list(a.type) and a.name != "max_exp_avg_sqs"]
    index_names = _INDEX_NAMES if "nll" in name or "embedding" in name else _INDEX_NAMES - {
        "target"}
    for pattern in _NDIM_PATTERNS:
        ndims = itertools.cycle(pattern)
        slots, shapes, dtypes = [], [], []
        for a in args:
            if a in tensor_args or a in list_args:
                members = [None] if a in tensor_args else [0, 1]
                nd = next(ndims)
                for i in members:
                    if a.name == "state_steps" or (a.name == "lr" and a in tensor_args):
                        shape, dt = (), torch.float32
                    else:
                        shape = (_N,) * nd
                        dt = (torch.int64 if a.name in index_names | _SORTED_NAMES else
                              torch.bool if a.name in _MASK_NAMES else torch.float32)
                    slots.append((a.name, i))
                    shapes.append(shape)
                    dtypes.append(dt)
        fixed = {"max_exp_avg_sqs": []} if name.startswith("_fused_adam") else {}
        for a in args:
            if a in tensor_args or a in list_args or a.name in fixed:
                continue
            v = _value(a, name)
            if v is not _SKIP:
                fixed[a.name] = v
        kw = frozenset(a.name for a in args if a.kwarg_only)
        call = SampleCall(func, tuple(shapes), tuple(dtypes), tuple(slots), fixed, kw)
        try:
            call.run(example_tensors(call))
        except Exception:  # noqa: BLE001 - any failure: try the next pattern
            continue
        return call
    return None


def example_tensors(call: SampleCall) -> list[torch.Tensor]:
    """Plain operands for ``call``: distinct values (arange), indices in range
    (fresh tensors: the caller may write into them)."""
    # Clones of kept ones: every rank of a simulated world asks for the same
    # operands, and a clone costs a fraction of building them again.
    return [t.clone() for t in _examples(call.shapes, call.dtypes)]


@functools.lru_cache(maxsize=1024)
def _examples(shapes, dtypes) -> tuple[torch.Tensor, ...]:
    out = []
    for shape, dt in zip(shapes, dtypes, strict=True):
        n = 1
        for s in shape:
            n *= s
        if dt == torch.int64:
            out.append(torch.arange(n).remainder(_N).reshape(shape))
        elif dt == torch.bool:
            out.append((torch.arange(n) % 3 == 0).reshape(shape))
        else:
            out.append((torch.arange(n, dtype=torch.float32) + 1).reshape(shape) / 4)
    return tuple(out)


@functools.cache
def sample_calls() -> dict:
    """``{overload: SampleCall}`` for every registered overload that can be called."""
    out = {}
    for f in registered():
        call = _probe(f)
        if call is not None:
            out[f] = call
    return out


def uncallable() -> list:
    """``RULES`` keys none of whose overloads ``sample_calls`` can call."""
    from dtensor.rules import RULES

    calls = sample_calls()
    return [key for key in RULES if not any(f in calls for f in overloads(key))]
