"""Output metadata of an op call: global shape, stride and dtype of each result.

Three ways, cheapest first: an in-place op's result is its ``self``
(``inplace_metas``); a rule's ``shapes`` (pure shape math) with dtypes from
a probe of the op on tiny tensors, cached per dtype signature
(``shape_metas``); or the op run on meta tensors of the global shapes
(``infer_meta``), which works for any op with a meta kernel but costs far
more.

The probe runs on tiny host tensors where that is safe
(``OpInfo.host_probe_ok``): many meta kernels are Python reference
implementations (``addcmul``, ``pow``, ``lerp``: ~0.5-1 ms a call), while the
CPU kernel of a 2x2 op costs microseconds, and a first training step meets
dozens of new signatures.
"""

from __future__ import annotations

import torch

from dtensor.dispatch.call import SCALAR_TYPES, Call, PlainKey, tensor_leaves
from dtensor.dispatch.op import SELF, OpInfo
from dtensor.spec import DTensorSpec, TensorMeta, contiguous_stride

__all__ = ["infer_meta", "inplace_metas", "meta_tensor", "shape_metas"]


def inplace_metas(info: OpInfo, specs) -> tuple[TensorMeta] | None:
    """``(self's metadata,)`` for an op that writes ``self`` and returns it
    (``info``: the op's record).

    Ops that change ``self``'s shape or strides in place never get here
    (dispatch refuses them), so the result's global metadata is ``self``'s.
    """
    if info.returns != SELF or not specs:
        return None
    return (specs[0].tensor_meta,)


def shape_metas(call: Call, info: OpInfo, specs, shapes, any_strides: bool = False
                ) -> tuple[TensorMeta, ...] | None:
    """Output metadata from a rule's global ``shapes``, or None.

    Applies when the op is functional and every operand is contiguous and
    non-empty: then outputs are contiguous (checked once on the probe). Dtypes
    come from the op run once on small tensors (every dim 2), kept in the op's
    record ``info`` per signature (operand dtypes and ranks, other arguments
    with types). ``specs``: the operands' specs (plain operands as replicated).
    ``any_strides``: the rule vouches that outputs are contiguous whatever
    the operands' strides (``Sharding.any_strides``).
    """
    if not info.functional:
        return None
    for s in specs:
        if 0 in s.shape or not (any_strides or s.stride == contiguous_stride(s.shape)):
            return None
    for shape in shapes:
        if 0 in shape:
            return None
    try:
        pkey = (
            tuple(map(_probe_sig, call.key_args)),
            tuple((k, _probe_sig(v)) for k, v in call.key_kwargs),
        )
        dtypes = info.dtypes.get(pkey, False)
    except TypeError:  # unhashable values
        return None
    if dtypes is False:
        # Kept in the op's record: one entry per dtype signature, not per shape.
        dtypes = info.dtypes[pkey] = _probe(call, info, specs, shapes)
    if dtypes is None:
        return None
    return tuple(
        TensorMeta(shape, contiguous_stride(shape), dtype)
        for shape, dtype in zip(shapes, dtypes, strict=True)
    )


def _probe_sig(x):
    """What of an argument (in key form) can decide a result dtype."""
    t = type(x)
    if t is DTensorSpec:
        return (x.dtype, x.ndim)
    if t is int or x is None:
        return x
    if t is tuple:
        return tuple(map(_probe_sig, x))
    if t is PlainKey:
        return (x.dtype, len(x.shape))
    if t in SCALAR_TYPES:  # type promotion looks at a scalar's type, not its value
        return t
    return (t, x)


def _probe(call: Call, info: OpInfo, specs, shapes):
    """Result dtypes of the op on tensors whose dims are all 2, if its results
    are contiguous and as many (and of the same ranks) as ``shapes``: on CPU
    where ``info.host_probe_ok()``, else (or if the CPU kernel refuses) on meta."""
    leaves = None
    if info.host_probe_ok():
        # Zeros, not garbage: index-like operands must be valid indices.
        small = [torch.zeros((2,) * s.ndim, dtype=s.dtype, device="cpu") for s in specs]
        try:
            leaves = tensor_leaves(_run_on(call, small, "cpu"))
        except Exception:  # no CPU kernel for this dtype, say: ask the meta kernel
            leaves = None
    if leaves is None:
        small = [torch.empty((2,) * s.ndim, dtype=s.dtype, device="meta") for s in specs]
        try:
            leaves = tensor_leaves(_run_on(call, small, "meta"))
        except Exception:  # the full meta run will tell
            return None
    if len(leaves) != len(shapes) or any(
        t.ndim != len(shape) or not t.is_contiguous()
        for t, shape in zip(leaves, shapes, strict=True)
    ):
        return None
    return tuple(t.dtype for t in leaves)


# Global output metadata per (op, operands' global metadata, other arguments
# by value): it holds nothing of a mesh or rank, so the ranks of a simulated
# world (threads of one process) share it, and a 1024-rank world runs each
# meta kernel once instead of once per rank (~0.2 ms a call).
_INFERRED: dict = {}
_INFERRED_LIMIT = 1 << 14


def infer_meta(call: Call, specs) -> tuple[TensorMeta | None, ...]:
    """Global output metadata from the op run on meta tensors of global shape."""
    try:
        key = (call.func, tuple(s.tensor_meta for s in specs),
               tuple(map(_meta_sig, call.key_args)),
               tuple((k, _meta_sig(v)) for k, v in call.key_kwargs))
        metas = _INFERRED.get(key)
    except TypeError:  # an unhashable argument: no sharing
        key = metas = None
    if metas is not None:
        return metas
    out = _run_on(call, [meta_tensor(s) for s in specs], "meta")
    if isinstance(out, tuple) and any(x is None for x in out):
        # Optional results (masked backward outputs) keep their slot as None.
        metas = tuple(
            None if x is None else TensorMeta(x.shape, x.stride(), x.dtype) for x in out
        )
    else:
        metas = tuple(TensorMeta(t.shape, t.stride(), t.dtype) for t in tensor_leaves(out))
    if key is not None:
        if len(_INFERRED) >= _INFERRED_LIMIT:
            _INFERRED.clear()
        _INFERRED[key] = metas
    return metas


def _meta_sig(x):
    """An argument (in key form) as far as output metadata can depend on it:
    an operand by its global metadata, anything else by type and value (a
    scale factor decides an upsampled shape; 2 and 2.0 promote differently)."""
    t = type(x)
    if t is DTensorSpec:
        return x.tensor_meta
    if t is tuple or t is list:
        return (t, *map(_meta_sig, x))
    if t is PlainKey:
        return x
    return (t, x)


def meta_tensor(spec: DTensorSpec) -> torch.Tensor:
    """A meta tensor with ``spec``'s global shape, stride and dtype."""
    return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta")


def _run_on(call: Call, operands, device: str):
    """The op's result with ``operands`` in place of its own, on ``device``."""
    margs, mkwargs = call.replace(operands)
    if mkwargs.get("device") is not None:
        mkwargs["device"] = device
    return call.func(*margs, **mkwargs)
