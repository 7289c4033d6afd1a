"""Python arithmetic on DTensors (``x + 1``, ``a * b``, ``2 / x``) without the
dispatcher's round trip.

``Tensor.__add__`` and friends are C functions: they parse the arguments,
wrap a Python scalar into a tensor, pass the autograd, autocast and mode
layers, find no rule registered for the subclass (a Python call), unwrap
the scalar again and call ``DTensor.__torch_dispatch__``. Where none of those
layers has anything to do (no gradient to record, no mode, no autocast, no
tracing, no forward-AD level or functorch transform), the DTensor's operators call the same dispatch function directly,
with the same overload and the same arguments the C path passes (checked by
``tests/test_arith.py``): ~4 µs of the ~10 µs a scalar op costs. Everything
else takes the C path.

Example:
    >>> y = x * 0.5 + 1          # DTensor x: two dispatch calls, no C round trip
"""

from __future__ import annotations

import torch

__all__ = ["install"]

aten = torch.ops.aten

# Python scalars the C path hands to __torch_dispatch__ as they are.
_SCALARS = frozenset({int, float, bool, complex})

_grad_on = torch.is_grad_enabled
_modes = torch._C._len_torch_dispatch_stack
_fn_modes = torch._C._is_torch_function_mode_enabled
_autocast = torch._C._is_any_autocast_enabled
_compiling = torch.compiler.is_compiling
_functorch_level = torch._C._functorch.maybe_current_level
_forward_ad = torch.autograd.forward_ad


def _layers_busy() -> bool:
    """A layer between the C operators and dispatch has work: a dispatch or
    function mode, autocast, tracing, a forward-AD dual level or a functorch
    transform (their tangents and wrappers live in those layers)."""
    return bool(_fn_modes() or _modes() or _autocast() or _compiling()
                or _forward_ad._current_level >= 0 or _functorch_level() is not None)


def install(cls: type, dispatch) -> None:
    """Give ``cls`` (the DTensor class) its operators, calling ``dispatch``."""

    def direct(x, other) -> bool:
        """Whether ``x (op) other`` may skip the C path."""
        # NOTE: modes first: a function mode sees even a property read
        # (requires_grad), and must see only the user's calls.
        if _layers_busy() or type(x) is not cls:
            return False
        t = type(other)
        if t is cls:
            return not (_grad_on() and (x.requires_grad or other.requires_grad))
        if t in _SCALARS:
            return not (_grad_on() and x.requires_grad)
        return False  # plain tensors, subclasses, NotImplemented cases: the C path

    def binary(op, c_method):
        def method(self, other):
            if direct(self, other):
                return dispatch(op, (self, other), {})
            return c_method(self, other)

        method.__name__ = c_method.__name__
        method.__doc__ = c_method.__doc__
        return method

    def scalar_only(op, c_method):
        """Reflected forms: the left operand was not a tensor."""
        def method(self, other):
            if type(other) in _SCALARS and direct(self, other):
                return dispatch(op, (self, other), {})
            return c_method(self, other)

        method.__name__ = c_method.__name__
        method.__doc__ = c_method.__doc__
        return method

    base = torch.Tensor
    cls.__add__ = binary(aten.add.Tensor, base.__add__)
    cls.__radd__ = scalar_only(aten.add.Tensor, base.__radd__)
    cls.__sub__ = binary(aten.sub.Tensor, base.__sub__)
    cls.__rsub__ = scalar_only(aten.rsub.Scalar, base.__rsub__)
    cls.__mul__ = binary(aten.mul.Tensor, base.__mul__)
    cls.__rmul__ = scalar_only(aten.mul.Tensor, base.__rmul__)
    cls.__truediv__ = binary(aten.div.Tensor, base.__truediv__)
    rtruediv = base.__rtruediv__

    def __rtruediv__(self, other):
        # As torch's own: the reciprocal times the scalar (the same rounding).
        if type(other) in _SCALARS and direct(self, other):
            return dispatch(aten.mul.Tensor, (dispatch(aten.reciprocal.default, (self,), {}),
                                              other), {})
        return rtruediv(self, other)

    __rtruediv__.__doc__ = rtruediv.__doc__
    cls.__rtruediv__ = __rtruediv__

    neg = base.__neg__

    def __neg__(self):
        if not _layers_busy() and type(self) is cls and not (_grad_on() and self.requires_grad):
            return dispatch(aten.neg.default, (self,), {})
        return neg(self)

    __neg__.__doc__ = neg.__doc__
    cls.__neg__ = __neg__

