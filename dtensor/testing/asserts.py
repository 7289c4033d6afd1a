"""Asserts that compare a distributed tensor with its single-device value.

They work on dtensor's ``DTensor`` and on ``torch.distributed.tensor.DTensor``
alike (only ``to_local``, ``placements``, ``device_mesh`` and ``redistribute``
are used), and say which rank, which shard and which global index differ.

Example:
    >>> y = (dt * 2)
    >>> assert_matches_single_device(y, x * 2)   # on every rank of the world
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dtensor.testing.compare import compare_block, tolerances
from dtensor.testing.oracle import assert_layout

__all__ = [
    "agree_on", "assert_local_is_empty", "assert_matches_single_device", "compare_block",
    "tolerances",
]

def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _placements_str(placements: Sequence[Any]) -> str:
    return "(" + ", ".join(_pstr(p) for p in placements) + ")"


def _pstr(p: Any) -> str:
    name = type(p).__name__
    if name == "Shard":
        return f"S({p.dim})"
    if name == "Replicate":
        return "R"
    if name == "Partial":
        return f"P({getattr(p, 'reduce_op', '?')})"
    return str(p)


def assert_local_is_empty(local: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """An outsider's local result: no elements, the right dtype."""
    if local.numel() != 0 or local.dtype != dtype:
        raise AssertionError(
            f"rank {_rank()} is outside the mesh{what} and must hold an empty "
            f"{dtype} local tensor, got shape {tuple(local.shape)} {local.dtype}"
        )


def assert_matches_single_device(
    dt: Any,
    expected: torch.Tensor,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    equal_nan: bool = True,
    check_dtype: bool = True,
    msg: str = "",
) -> None:
    """``dt`` (a DTensor) holds ``expected`` (a plain global tensor).

    Checks the global shape and dtype, then this rank's local block, offset
    and coordinate against the independent per-rank oracle
    (``dtensor.testing.oracle.assert_layout``: ``torch.chunk`` at the
    coordinate in the mesh's rank tensor, not the runtime's layout math). A
    rank outside the mesh must hold an empty tensor of the right dtype.
    ``Partial`` axes: the pieces' shapes are checked, then the axes are
    reduced with ``redistribute`` (a collective over the mesh: call this on
    every member) and the values compared.

    Tolerances default to ``tolerances(expected.dtype)``. The message names
    the rank, its coordinate, the block it holds, the first differing global
    index and both values.
    """
    prefix = f"{msg}: " if msg else ""
    expected = expected.detach()
    if tuple(dt.shape) != tuple(expected.shape):
        raise AssertionError(
            f"{prefix}global shape differs on rank {_rank()}: got {tuple(dt.shape)}, "
            f"expected {tuple(expected.shape)}"
        )
    if check_dtype and dt.dtype != expected.dtype:
        raise AssertionError(
            f"{prefix}dtype differs on rank {_rank()}: got {dt.dtype}, expected "
            f"{expected.dtype}"
        )
    placements = tuple(dt.placements)
    if any(type(p).__name__ == "Partial" for p in placements):
        # The pieces' layout first; a failure is raised after the reduction
        # (a collective every member must join, or the others hang).
        err = None
        try:
            assert_layout(dt, None, msg=msg)
        except AssertionError as e:
            err = e
        if dt.device_mesh.get_coordinate() is not None:
            replicate = type(_first(placements, "Partial")).__module__
            dt = _reduce_partials(dt, replicate)
        if err is not None:
            raise err
    # This rank's block, offset and coordinate against the independent
    # reference (torch.chunk at the coordinate in the mesh's rank tensor).
    assert_layout(dt, expected, rtol=rtol, atol=atol, equal_nan=equal_nan, msg=msg)


def _first(placements, name):
    return next(p for p in placements if type(p).__name__ == name)


def _reduce_partials(dt: Any, module: str) -> Any:
    import importlib

    mod = importlib.import_module(module)
    replicate = mod.Replicate()
    target = [replicate if type(p).__name__ == "Partial" else p for p in dt.placements]
    return dt.redistribute(dt.device_mesh, target)


def agree_on(check: Any, group: Any, what: str = "its check") -> None:
    """Run ``check()`` (local asserts) here, then agree with ``group``'s ranks
    on the verdict: every rank fails together, with its own error or one that
    names another rank's failure. Call it before a collective that a rank
    failing alone would leave the others waiting in (a hang the watchdog ends
    after minutes, and Hypothesis cannot shrink). Costs one tiny all-reduce.

    >>> agree_on(lambda: assert_layout(out, None), world.group)  # doctest: +SKIP
    """
    import torch.distributed as dist

    err = None
    try:
        check()
    except AssertionError as e:
        err = e
    failed = torch.tensor([0 if err is None else 1])
    dist.all_reduce(failed, group=group)
    if err is not None:
        raise err
    if failed.item():
        raise AssertionError(f"rank {dist.get_rank()}: {int(failed.item())} other rank(s) "
                             f"failed {what} (their errors name it); what follows was skipped")
