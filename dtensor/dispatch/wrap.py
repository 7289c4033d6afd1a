"""Results of dispatch as DTensors: one local tensor and its spec make one.

Dispatch sits below the DTensor class, so the class is handed over once
(``dtensor.dispatch.serve``) instead of imported. ``wrap`` is the one way
dispatch makes a DTensor, except on the fast path's most common kinds (one
result), which inline it with the metadata their fast form keeps.
"""

from __future__ import annotations

from typing import Any

import torch

from dtensor.spec import DTensorSpec

__all__ = ["rewrap", "wrap"]

# The DTensor class, for all of dispatch; dtensor.tensor hands it over
# (dtensor.dispatch.serve).
DTensor: Any = None
_mk = torch.Tensor._make_wrapper_subclass


def wrap(local: torch.Tensor, spec: DTensorSpec):
    """``DTensor(local, spec)`` without the keyword parsing."""
    meta = spec.tensor_meta
    r = _mk(
        DTensor, meta.shape, meta.stride, None, None, meta.dtype,
        local.layout, local.device, False, False,
    )
    r._local_tensor = local
    r._spec = spec
    return r


def rewrap(out, one, *, keep: bool = True):
    """``out`` (a tensor, or nested lists/tuples of them) with each tensor ``t``
    replaced by ``one(t)``; anything else is kept (``keep=False``: None)."""
    if isinstance(out, torch.Tensor):
        return one(out)
    if isinstance(out, (list, tuple)):
        return type(out)(rewrap(x, one, keep=keep) for x in out)
    return out if keep else None
