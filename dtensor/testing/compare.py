"""Block comparison shared by the asserts and the per-rank oracle: default
tolerances per dtype and a comparison that names the first differing global
index.

Example:
    >>> compare_block(local, ref_block, (4, 0), " on rank 1", "", None, None, True)
"""

from __future__ import annotations

import torch

__all__ = ["compare_block", "tolerances"]

# (rtol, atol) per dtype; as torch.testing.assert_close's defaults, with a
# looser float32 rtol: a sum over shards adds in a different order.
_TOLERANCES = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1e-5, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """Default ``(rtol, atol)`` for ``dtype``: exact for ints and bool."""
    return _TOLERANCES.get(dtype, (0.0, 0.0))


def compare_block(local, block, offset, where, prefix, rtol, atol, equal_nan) -> None:
    """Raise naming the first differing global index (``offset``: the block's)."""
    if local.numel() == 0:
        return
    if local.dtype == block.dtype and torch.equal(local, block):
        # Bit-equal (most blocks: views, pointwise, shards moved by copies):
        # within any tolerance; a NaN is never equal, so NaNs take the full
        # check. ~3 us, against ~50 for the float64 copies and isclose.
        return
    if block.dtype.is_floating_point or block.dtype.is_complex:
        d_rtol, d_atol = tolerances(block.dtype)
        rtol = d_rtol if rtol is None else rtol
        atol = d_atol if atol is None else atol
        a = local.to(torch.float64)
        b = block.to(torch.float64)
        if local.dtype != block.dtype:
            a = local.to(block.dtype).to(torch.float64)
        bad = ~torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan)
        tol = f" (rtol={rtol}, atol={atol})"
    else:
        bad = local.to(block.dtype) != block
        tol = " (exact)"
    if not bool(bad.any()):
        return
    idx = tuple(int(i) for i in bad.nonzero()[0])
    gidx = tuple(i + o for i, o in zip(idx, offset, strict=True))
    raise AssertionError(
        f"{prefix}{where}: {int(bad.sum())} of {bad.numel()} elements differ{tol}; "
        f"first at global index {gidx} (local {idx}): got {local[idx].item()!r}, "
        f"expected {block[idx].item()!r}"
    )
