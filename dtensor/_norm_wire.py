"""p-norms on the wire: what ranks send to combine pieces of a p-norm.

Pieces of a p-norm combine with a plain reduction of a transform of them:
finite ``p > 0`` sums ``piece ** p`` and takes the ``1/p``-th root, ``p = 0``
(counts of non-zeros) sums, ``inf`` takes the max. Pure tensor math, no
communication: ``dtensor._comm`` runs the reduction between ``to_wire`` and
``from_wire`` for a ``Partial("norm<p>")`` (``dtensor.placement.norm_partial``)
and the norm rules use the same pieces for their shares.
"""

from __future__ import annotations

import math

import torch

from dtensor.errors import PlacementError

__all__ = ["combining_op", "from_bits", "from_wire", "nan_first_bits", "refuse_negative",
           "to_wire"]

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def combining_op(p: float) -> str:
    """The reduction that combines shares of the ``p``-norm (sum, max or min)."""
    if p == math.inf:
        return "max"
    if p == -math.inf:
        return "min"
    return "sum"


def nan_first_bits(shares: torch.Tensor, how: str) -> torch.Tensor:
    """Shares of a ±inf norm (each >= 0, or NaN) as integers whose max / min
    is the float max / min with a NaN held by any rank winning.

    NOTE: Gloo's float max/min keep whichever operand compares first, so a
    NaN held by one rank could vanish. The bits of non-negative IEEE floats
    order as integers do, and a NaN with its sign bit clear (``abs``) lies
    above +inf: an integer max keeps it. For min a NaN becomes -1, below every
    non-negative float. One element per norm on the wire.
    """
    bits = shares.abs().view(_INT_OF_SIZE[shares.element_size()])
    if how == "min":
        bits = torch.where(torch.isnan(shares), torch.full_like(bits, -1), bits)
    return bits


def from_bits(bits: torch.Tensor, how: str, dtype) -> torch.Tensor:
    """Floats back from ``nan_first_bits`` after the reduction."""
    if how == "min":
        nan = bits < 0
        return torch.where(nan, torch.full((), math.nan, dtype=dtype),
                           bits.clamp_min(0).view(dtype))
    return bits.view(dtype)


def to_wire(pieces: torch.Tensor, p: float) -> tuple[torch.Tensor, str]:
    """What a rank sends for its p-norm ``pieces``, and the reduction to run."""
    how = combining_op(p)
    if how != "sum":
        return nan_first_bits(pieces, how), how
    if p in (0.0, 1.0):
        return pieces, how
    return pieces.pow(p), how


def from_wire(reduced: torch.Tensor, p: float, dtype) -> torch.Tensor:
    """The p-norms from the reduced wire values of ``to_wire``."""
    how = combining_op(p)
    if how != "sum":
        return from_bits(reduced, how, dtype)
    if p in (0.0, 1.0):
        return reduced
    return reduced.pow(1.0 / p)


def refuse_negative(t: torch.Tensor, what: str, pieces) -> None:
    """Raise unless ``t`` (a replicated value about to become ``pieces``,
    a ``Partial("norm<p>")``) is >= 0 (or NaN) everywhere.

    Coordinate 0 keeping v and the others 0 combine to |v|: a negative value
    would come back positive. Every coordinate holds the same replicated
    values, so all raise together (nobody is left waiting in a collective).
    """
    if t.dim() == 0:
        # NOTE: one read of the value, not two ops and a bool: clip_grad_norm_
        # stacks each replicated gradient's norm (a scalar) every step, where
        # the ops cost ~20 us each right after backward. NaN < 0 is False.
        if t.item() < 0:
            _refuse(t, what, pieces)
    elif t.numel() and bool((t < 0).any()):
        _refuse(t, what, pieces)


def _refuse(t: torch.Tensor, what: str, pieces) -> None:
    raise PlacementError(
        f"{what} has negative entries (min {t.min().item()}), but the pieces of "
        f"a p-norm ({pieces}) are norms (>= 0); redistribute the {pieces} "
        f"operands to Replicate() first"
    )
