"""The autograd functions behind ``from_local``, ``to_local`` and ``redistribute``.

Each moves a DTensor's layout (or wraps/unwraps its block) in forward and
sends the gradient back to the layout its input had in backward. They sit
below ``dtensor.tensor`` (which calls them), so they never import it: they
build results with the class of the DTensor they were given (``from_local``
passes its class).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dtensor.errors import ShardingError
from dtensor.placement import Partial, partial_to_replicate
from dtensor.redistribute import empty_local as _empty_local
from dtensor.redistribute import grad_placements as _grad_placements
from dtensor.redistribute import redistribute_local
from dtensor.spec import DTensorSpec

if TYPE_CHECKING:
    from dtensor.tensor import DTensor

__all__ = ["_FromLocal", "_Redistribute", "_ToLocal"]


def _grad_spec_for(src: DTensorSpec) -> DTensorSpec:
    """Layout a gradient takes on its way back to a tensor laid out by ``src``.

    The gradient of a partial piece is the full gradient (for sum) on every
    coordinate, so ``Partial`` axes become ``Replicate``.
    """
    if not src.has_partial():
        return src
    return src.with_placements(partial_to_replicate(src.placements))


def _partial_scale(src: DTensorSpec) -> int:
    """Divisor of the gradient for ``Partial(avg)`` axes; rejects ops other than sum/avg."""
    scale = 1
    for axis, p in enumerate(src.placements):
        if isinstance(p, Partial):
            if p.reduce_op == "avg":
                scale *= src.mesh.shape[axis]
            elif p.reduce_op != "sum":
                raise ShardingError(
                    f"backward through Partial({p.reduce_op!r}) on mesh axis {axis} is "
                    "not supported; redistribute to Replicate() before differentiating"
                )
    return scale


def _redistribute_grad(grad, target: DTensorSpec, cls: type) -> DTensor:
    """The gradient (same global value) laid out like ``target``, partials replicated."""
    if not isinstance(grad, cls):
        raise ShardingError("redistribute backward: expected a DTensor gradient")
    gspec = grad._spec
    want = _grad_spec_for(target)
    local = grad._local_tensor
    if gspec.placements != want.placements:
        local = redistribute_local(local, gspec, gspec.with_placements(want.placements))
    return cls(local, want.with_meta(gspec.tensor_meta))


class _Redistribute(torch.autograd.Function):
    """Change layout in forward; move the gradient back to the source layout in backward."""

    @staticmethod
    def forward(ctx, x: DTensor, dst: DTensorSpec):
        ctx.src = x._spec
        ctx.cls = type(x)
        return ctx.cls(redistribute_local(x._local_tensor, x._spec, dst), dst)

    @staticmethod
    def backward(ctx, grad):
        cls = ctx.cls
        if isinstance(grad, cls) and ctx.src.has_partial():
            # Partial source axes keep the gradient's layout (no bytes moved;
            # see dtensor.redistribute.grad_placements).
            gspec = grad._spec
            want = gspec.with_placements(_grad_placements(ctx.src.placements, gspec.placements))
            return cls(redistribute_local(grad._local_tensor, gspec, want), want), None
        return _redistribute_grad(grad, ctx.src, cls), None


class _FromLocal(torch.autograd.Function):
    """Wrap a local block in forward; unwrap the gradient's block (in the source layout) in backward."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec, cls: type):
        ctx.spec = spec
        ctx.cls = cls
        # view_as: the DTensor must not share the autograd identity of `local`.
        return cls(local.view_as(local), spec)

    @staticmethod
    def backward(ctx, grad: DTensor):
        # The gradient of a partial piece: the global gradient, divided by the
        # number of pieces for an average.
        local = _redistribute_grad(grad, ctx.spec, ctx.cls)._local_tensor
        scale = _partial_scale(ctx.spec)
        return (local / scale if scale != 1 else local), None, None


class _ToLocal(torch.autograd.Function):
    """Unwrap in forward; wrap the local gradient with ``grad_placements`` in backward."""

    @staticmethod
    def forward(ctx, x: DTensor, grad_spec: DTensorSpec):
        ctx.grad_spec = grad_spec
        ctx.cls = type(x)
        return x._local_tensor.view_as(x._local_tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.grad_spec
        if spec.mesh.get_coordinate() is None:
            grad = _empty_local(spec, grad.device)
        return ctx.cls(grad, spec), None
