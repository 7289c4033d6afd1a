"""Ops that treat the slices along some dims independently, so shards of
the other dims stay where they are and nothing is sent:

- selections along one ``dim`` (``kthvalue``, ``mode``, ``median``/
  ``nanmedian`` with ``dim``): shards of every other dim are kept (as
  PyTorch does); a shard of ``dim`` itself is gathered first;
- pooling (max/avg, adaptive, 2-D and 3-D windows, 2-D backward): the
  leading (batch, channel) dims keep their shards (a channel shard only
  where no rank's block is empty: the kernels refuse zero channels; a
  batch shorter than the mesh axis only where the outputs are smaller than
  the operands), spatial dims are whole;
- ``native_group_norm`` over batch shards: statistics are per sample;
- ``max_unpool2d``/``3d``: input and indices cut alike on the leading dims;
- ``histc`` with a fixed range: each rank counts its own elements, the
  counts are ``Partial(sum)``;
- identities: ``as_strided`` with the tensor's own size, stride and offset,
  and ``prims.view_of``, keep the layout (PyTorch: no communication).

Partial operands are reduced first (none of these is linear in them);
pooling reduces them onto a shard of a leading dim where that and gathering
the output later send less than an all-reduce.
Example: ``kthvalue(x, 2, dim=1)`` of a ``Shard(0)`` tensor returns
``Shard(0)`` values and indices, with no collective.
"""

from __future__ import annotations

import math

import torch

from dtensor.placement import Partial, Replicate, Shard, is_linear_partial
from dtensor.rules._util import bind, norm_dim, reduced_shard
from dtensor.sharding import Sharding
from dtensor.spec import DTensorSpec

__all__ = ["RULES"]

aten = torch.ops.aten


def select_along_dim_rule(call):
    """``kthvalue``/``mode``/``median.dim``: values and indices along ``dim``."""
    (spec,) = call.specs[:1]
    if spec.ndim == 0:
        return None
    a = bind(call)
    dim = norm_dim(a["dim"], spec.ndim)
    keepdim = bool(a.get("keepdim"))
    want = tuple(p if isinstance(p, Shard) and p.dim != dim else Replicate()
                 for p in spec.placements)
    out = tuple(reduced_shard(p, (dim,), keepdim) if isinstance(p, Shard) else p for p in want)
    shape = tuple(1 if d == dim else n for d, n in enumerate(spec.shape)
                  if keepdim or d != dim)
    return Sharding((want,), (out, out), shapes=(shape, shape))


def pooling_rule(spatial: int, linear: bool = False):
    """Pooling with ``spatial`` trailing window dims: every operand (input,
    gradient, indices) keeps the first operand's shards of the leading dims."""

    def rule(call):
        first = call.specs[0]
        lead = first.ndim - spatial
        if lead < 0 or any(s.ndim != first.ndim for s in call.specs):
            return None
        # Averaging windows are linear: one operand's pieces of a sum pass.
        keep_linear = linear and len(call.specs) == 1
        place = [p if (isinstance(p, Shard) and p.dim < lead
                       and _blocks_allowed(first, lead, axis, p.dim))
                 or (keep_linear and is_linear_partial(p)) else Replicate()
                 for axis, p in enumerate(first.placements)]
        sizes = None  # bytes of operands, outputs, first output; where needed
        for axis, p in enumerate(place):
            if isinstance(p, Shard) and first.shape[p.dim] < first.mesh.size(axis):
                # A batch shorter than the axis leaves ranks empty: the shard
                # saves nothing here, and gathering the outputs later (values
                # and int64 indices, or a padded window's larger output)
                # moves more than gathering the operands now, where those
                # are the larger (PyTorch gathers such a shard always).
                sizes = sizes or _sizes(call)
                if sizes is None or sizes[1] >= sizes[0]:
                    place[axis] = Replicate()
        # Other pieces are reduced onto a shard of a leading dim (reduce-scatter,
        # half an all-reduce) where that and gathering the pooled output later
        # send less than an all-reduce; else they are replicated.
        for axis, p in enumerate(place):
            if isinstance(p, Replicate) and any(
                    isinstance(s.placements[axis], Partial) for s in call.specs):
                sizes = sizes or _sizes(call)
                place[axis] = _reduce_onto(first, lead, axis, place, call.specs, sizes)
        place = tuple(place)
        n = len(call.func._schema.returns)
        return Sharding((place,) * len(call.specs), (place,) * n)

    return rule


def _nbytes(spec) -> int:
    return math.prod(spec.shape) * spec.dtype.itemsize


def _sizes(call) -> tuple[int, int, int] | None:
    """Bytes of a pooling call's operands, of its outputs and of its first
    output (the values beside indices), from the op on meta tensors; None
    where that fails."""
    def meta(x):
        if isinstance(x, DTensorSpec):
            return torch.empty_strided(x.shape, x.stride, dtype=x.dtype, device="meta")
        if isinstance(x, (list, tuple)):
            return type(x)(meta(y) for y in x)
        return x

    try:
        out = call.func(*meta(call.args), **{k: meta(v) for k, v in call.kwargs.items()})
    except Exception:  # the op raises its own error when it runs
        return None
    outs = out if isinstance(out, (list, tuple)) else (out,)
    out_bytes = [t.numel() * t.element_size() for t in outs]
    return sum(_nbytes(s) for s in call.specs), sum(out_bytes), out_bytes[0]


def _blocks_allowed(spec, lead: int, axis: int, dim: int) -> bool:
    """Whether the kernels take every block of ``dim`` cut by mesh ``axis``:
    an empty batch (dim 0 of a batched input) is fine, zero channels are
    refused, so a channel dim must leave no rank's block empty."""
    if dim == 0 and lead > 1:
        return True
    n, size = spec.mesh.size(axis), spec.shape[dim]
    return -(-size // n) * (n - 1) < size


def _reduce_onto(spec, lead: int, axis: int, place, specs, sizes) -> Shard | Replicate:
    """Where pieces on mesh ``axis`` go: a leading dim that no other axis
    shards and that leaves no channel block empty, the one padded least
    (then the lowest), where reduce-scattering the pieces and gathering the
    outputs later sends less than all-reducing the pieces; else
    ``Replicate``.

    Per rank, in units of ``(n - 1) / n`` of a buffer: an all-reduce sends
    twice the pieces' bytes; a reduce-scatter onto dim ``d`` and the gather
    of the values send pieces plus values, times the padding of ``d``'s
    blocks (``ceil(size / n) * n / size``). Indices are left out: often
    dropped (``F.max_pool2d``) or kept for the backward, never gathered;
    where they are, PyTorch, which always reduce-scatters, gathers them too."""
    if sizes is None:
        return Replicate()
    n = spec.mesh.size(axis)
    pieces = sum(_nbytes(s) for s in specs if isinstance(s.placements[axis], Partial))
    taken = {q.dim for q in (*place, *spec.placements) if isinstance(q, Shard)}
    best, best_pad = Replicate(), None
    for d in range(lead):
        size = spec.shape[d]
        if d in taken or size < n or not _blocks_allowed(spec, lead, axis, d):
            continue
        pad = -(-size // n) * n / size
        if pad * (pieces + sizes[2]) < 2 * pieces and (best_pad is None or pad < best_pad):
            best, best_pad = Shard(d), pad
    return best


def group_norm_rule(call):
    """``native_group_norm(x, w, b, N, C, HxW, group, eps)`` over batch shards
    of at least one sample per coordinate of the axis (as PyTorch keeps
    them): a smaller batch is gathered, which costs what gathering the
    output would, and the per-sample statistics need no gathering after."""
    x = call.specs[0]
    place = tuple(Shard(0) if p == Shard(0) and x.shape[0] >= x.mesh.size(axis)
                  else Replicate() for axis, p in enumerate(x.placements))
    if not any(isinstance(p, Shard) for p in place):
        return None  # nothing to keep: the plain replicated path is the same
    rest = (tuple(Replicate() for _ in place),) * (len(call.specs) - 1)
    return Sharding((place, *rest), (place,) * 3, local=_local_batch(3))


def max_unpool_rule(spatial: int):
    """``max_unpool2d``/``3d(x, indices, output_size, ...)``: each value goes
    to its index within its own (batch, channel) plane, so x and indices are
    cut alike on the leading dims (the shard of the wider dtype first).
    Pieces of x are reduced first: the output is never smaller than x."""

    def rule(call):
        x, index = call.specs
        lead = x.ndim - spatial
        if lead < 1 or index.shape != x.shape:
            return None
        place, out = [], []
        for axis, (p, q) in enumerate(zip(x.placements, index.placements, strict=True)):
            # Cut alike, the operand of fewer bytes (x, against int64 indices)
            # moving; a dim shorter than the axis is gathered (as PyTorch
            # does): the output it would leave to gather is larger than x.
            order = (q, p) if index.dtype.itemsize > x.dtype.itemsize else (p, q)
            pick = next((s for s in order if isinstance(s, Shard) and s.dim < lead
                         and x.shape[s.dim] >= x.mesh.size(axis)
                         and _blocks_allowed(x, lead, axis, s.dim)), None)
            if pick is not None:
                place.append((pick, pick)), out.append(pick)
            else:
                place.append((Replicate(), Replicate())), out.append(Replicate())
        return Sharding((tuple(w for w, _ in place), tuple(i for _, i in place)),
                        (tuple(out),))

    return rule


def _local_batch(n_at: int):
    """Run the op with its batch-size argument (position ``n_at``) set to the
    local block's batch size."""

    def local(func, coord, out_specs, args, kwargs):
        args = list(args)
        args[n_at] = args[0].shape[0]
        return func(*args, **kwargs)

    return local


def histc_rule(call):
    """``histc(x, bins, min, max)`` with ``min < max``: per-rank counts add up."""
    (spec,) = call.specs
    a = bind(call)
    if not float(a.get("min") or 0) < float(a.get("max") or 0):
        return None  # the range comes from the data: global min and max needed
    want = tuple(p if isinstance(p, Shard) else Replicate() for p in spec.placements)
    out = tuple(Partial() if isinstance(p, Shard) else Replicate() for p in want)
    return Sharding((want,), (out,), shapes=((int(a["bins"]),),))


def as_strided_rule(call):
    """``as_strided`` with the tensor's own geometry is the tensor (an alias)."""
    (spec,) = call.specs
    a = bind(call)
    offset = a.get("storage_offset")
    if (tuple(a["size"]) != tuple(spec.shape) or tuple(a["stride"]) != tuple(spec.stride)
            or offset not in (None, 0)):
        return None
    return Sharding((spec.placements,), (spec.placements,), shapes=(spec.shape,),
                    local=_alias)


def _alias(func, coord, out_specs, args, kwargs):
    x = args[0]
    return x.as_strided(x.size(), x.stride(), x.storage_offset())


def identity_rule(call):
    (spec,) = call.specs
    return Sharding((spec.placements,), (spec.placements,), shapes=(spec.shape,))


_POOLS = {
    2: ("max_pool2d_with_indices", "max_pool2d_with_indices_backward", "avg_pool2d",
        "avg_pool2d_backward", "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward",
        "adaptive_max_pool2d"),
    3: ("max_pool3d_with_indices", "avg_pool3d", "_adaptive_avg_pool3d"),
}

RULES: dict = {
    aten.kthvalue.default: select_along_dim_rule,
    aten.mode.default: select_along_dim_rule,
    aten.median.dim: select_along_dim_rule,
    aten.nanmedian.dim: select_along_dim_rule,
    aten.native_group_norm.default: group_norm_rule,
    aten.max_unpool2d.default: max_unpool_rule(2),
    aten.max_unpool3d.default: max_unpool_rule(3),
    aten.histc.default: histc_rule,
    aten.as_strided.default: as_strided_rule,
    torch.ops.prims.view_of.default: identity_rule,
}
for _spatial, _names in _POOLS.items():
    for _name in _names:
        RULES[getattr(aten, _name).default] = pooling_rule(_spatial, "avg" in _name)
