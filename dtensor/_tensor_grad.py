"""The autograd functions behind ``from_local``, ``to_local`` and ``redistribute``.

Each moves a DTensor's layout (or wraps/unwraps its block) in forward and
sends the gradient back to the layout its input had in backward. They sit
below ``dtensor.tensor`` (which calls them), so they never import it: they
build results with the class of the DTensor they were given (``from_local``
passes its class).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtensor.errors import ShardingError
from dtensor.placement import Partial, Placement, Replicate, partial_to_replicate
from dtensor.redistribute import empty_local as _empty_local
from dtensor.redistribute import redistribute_local
from dtensor.spec import DTensorSpec

__all__ = ["_FromLocal", "_Redistribute", "_ToLocal", "grad_placements", "redistribute_cast"]


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


def _redistribute_grad(grad, target: DTensorSpec, cls: type) -> torch.Tensor:
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
    def forward(ctx, x: torch.Tensor, dst: DTensorSpec, async_op: bool = False):
        ctx.src = x._spec
        ctx.cls = type(x)
        local = redistribute_local(x._local_tensor, x._spec, dst, async_op=async_op)
        return ctx.cls(local, dst)

    @staticmethod
    def backward(ctx, grad):
        cls = ctx.cls
        if isinstance(grad, cls) and ctx.src.has_partial():
            # Partial source axes keep the gradient's layout (no bytes moved;
            # see grad_placements below).
            gspec = grad._spec
            want = gspec.with_placements(grad_placements(ctx.src.placements, gspec.placements))
            return cls(redistribute_local(grad._local_tensor, gspec, want), want), None, None
        return _redistribute_grad(grad, ctx.src, cls), None, None


class _FromLocal(torch.autograd.Function):
    """Wrap a local block in forward; unwrap the gradient's block (in the source layout) in backward."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec, cls: type):
        ctx.spec = spec
        ctx.cls = cls
        # view_as: the DTensor must not share the autograd identity of `local`.
        return cls(local.view_as(local), spec)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # The gradient of a partial piece: the global gradient, divided by the
        # number of pieces for an average.
        local = _redistribute_grad(grad, ctx.spec, ctx.cls)._local_tensor
        scale = _partial_scale(ctx.spec)
        return (local / scale if scale != 1 else local), None, None


class _ToLocal(torch.autograd.Function):
    """Unwrap in forward; wrap the local gradient with ``grad_placements`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, grad_spec: DTensorSpec):
        ctx.grad_spec = grad_spec
        ctx.cls = type(x)
        return x._local_tensor.view_as(x._local_tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.grad_spec
        if spec.mesh.get_coordinate() is None:
            grad = _empty_local(spec, grad.device)
        return ctx.cls(grad, spec), None


# redistribute with dtypes (forward_dtype / backward_dtype) -------------------
def grad_placements(src: Sequence[Placement], grad: Sequence[Placement]) -> tuple[Placement, ...]:
    """Layout the gradient of ``redistribute`` takes on its way back to ``src``.

    Where the source was ``Partial`` and the gradient arrives ``Partial``, it
    stays so: reducing it there would only move bytes (an all-reduce of the
    whole gradient per axis) that a later step reduces anyway, as in
    PyTorch's ``Partial -> Partial`` backward. A gradient arriving in any
    other layout becomes ``Replicate`` there (the gradient of each piece is
    the full gradient): a sharded one is gathered once, here, rather than by
    every op of the backward that would need it whole (a row-parallel
    linear's ``Shard(0)`` output: one all-gather, not one per matmul). Every
    other axis takes the source's layout.

    Example:
        >>> grad_placements((Partial(), Partial(), Shard(0)), (Partial(), Shard(0), Replicate()))
        (Partial(reduce_op='sum'), Replicate(), Shard(dim=0))
    """
    return tuple(
        (g if isinstance(g, Partial) else Replicate()) if isinstance(s, Partial) else s
        for s, g in zip(src, grad, strict=True)
    )


def redistribute_cast(x, mesh, dst: tuple[Placement, ...], forward_dtype, backward_dtype):
    """``x.redistribute(mesh, dst, forward_dtype=..., backward_dtype=...)``.

    The block is cast to ``forward_dtype`` before it moves (the collectives
    run, and the result stays, in that dtype). In backward the gradient is
    cast to ``backward_dtype`` (default: ``x``'s dtype) before its
    collectives and arrives back in ``x``'s dtype, as in PyTorch.
    """
    for name, dt in (("forward_dtype", forward_dtype), ("backward_dtype", backward_dtype)):
        if dt is not None and not isinstance(dt, torch.dtype):
            raise ShardingError(
                f"redistribute: {name} must be a torch.dtype or None, got {dt!r} "
                f"({type(dt).__name__}), e.g. {name}=torch.bfloat16"
            )
    fwd = forward_dtype or x.dtype
    bwd = backward_dtype or x.dtype
    if fwd != x.dtype and x._spec.has_partial() and not (
        fwd.is_floating_point and x.dtype.is_floating_point
    ):
        # Rounding each piece to an integer is not rounding their sum.
        raise ShardingError(
            f"redistribute: cannot cast the Partial pieces of {x._spec} to {fwd} "
            "before reducing them; cast between floating dtypes, or redistribute "
            "to Replicate() first"
        )
    if x.requires_grad and torch.is_grad_enabled():
        return _CastRedistribute.apply(x, dst, fwd, bwd)
    return _cast_move(x, x._spec.with_placements(dst), fwd)


def _with_dtype(spec: DTensorSpec, dtype: torch.dtype) -> DTensorSpec:
    meta = spec.tensor_meta
    return spec.with_meta(type(meta)(meta.shape, meta.stride, dtype))


def _cast_move(x, dst: DTensorSpec, dtype: torch.dtype):
    """``x`` (a DTensor) cast to ``dtype``, then laid out like ``dst``."""
    src = _with_dtype(x._spec, dtype)
    local = redistribute_local(x._local_tensor.to(dtype), src, _with_dtype(dst, dtype))
    return type(x)(local, _with_dtype(dst, dtype))


class _CastRedistribute(torch.autograd.Function):
    """Cast, then redistribute, in forward; in backward cast the gradient to
    the backward dtype, move it back to the source layout (see
    ``grad_placements``) and cast it to the source's dtype.

    (A cast node of its own after the redistribute would not do: autograd
    casts every gradient back to the dtype of the tensor it flows to, so the
    collectives would run in the forward dtype.)
    """

    @staticmethod
    def forward(ctx, x, dst, fwd, bwd):
        ctx.src, ctx.bwd = x._spec, bwd
        return _cast_move(x, x._spec.with_placements(dst), fwd)

    @staticmethod
    def backward(ctx, grad):
        if not hasattr(grad, "_spec"):
            raise ShardingError("redistribute backward: expected a DTensor gradient")
        src = ctx.src
        want = grad._spec.with_placements(grad_placements(src.placements, grad._spec.placements))
        g = _cast_move(grad, want, ctx.bwd)
        return g if g.dtype == src.dtype else g.to(src.dtype), None, None, None
