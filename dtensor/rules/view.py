"""Views and shape ops: view/reshape, transpose/permute/t, (un)squeeze,
expand, slice, select, split/unbind, flip, roll (cat, stack, index_select
and gather: ``dtensor.rules.join``).

Shards follow the dims they live on, ``StridedShard`` too (the rules here
but expand and repeat read it: ``strided_aware``). A view that merges or
splits dims keeps a shard where every local block is exactly the block of
the output layout: a shard of the leading (major) dim of the group when the
pieces are even; a shard of the last dim of a merged group, the others
whole, as ``StridedShard(merged, split_factor=product of the dims before
it)`` (each rank's rows are its piece of every run of the inner dim, uneven
or empty pieces included); and back, ``StridedShard(d, sf)`` split into
``(sf, rest)`` as a shard of ``rest``. Otherwise that dim is gathered
first. Ops whose size arguments name global sizes (view, expand) are run
with this rank's block sizes. Views only move, pick or repeat elements, so
partial values of every reduce op pass through them.
"""

from __future__ import annotations

import math

import torch

from dtensor.placement import Partial, Replicate, Shard, StridedShard
from dtensor.rules._util import bind, norm_dim, num_shards, strided_aware
from dtensor.sharding import Sharding
from dtensor.spec import local_shape

__all__ = ["RULES", "view_groups"]

aten = torch.ops.aten


def _carried(spec, carry):
    """(input placements wanted, output placements), where ``carry(p)`` says
    what a cut ``p`` (Shard or StridedShard) of an input dim becomes in the
    output, None where that dim is gathered first.

    Every Partial passes, max/min included: these ops only move, pick or
    repeat elements, and that commutes with any elementwise reduction. (It
    also lets in-place views on a Partial keep their storage, and with it
    their aliases: dtensor/dispatch/general.py refuses ones that would not.)
    """
    want, out = [], []
    for p in spec.placements:
        q = carry(p) if isinstance(p, (Shard, StridedShard)) else p
        if q is None:
            want.append(Replicate())
            out.append(Replicate())
        else:
            want.append(p)
            out.append(q)
    return tuple(want), tuple(out)


def _moved(p, od: int):
    """Cut ``p`` on output dim ``od``: the same rows of a dim that moved."""
    return StridedShard(od, p.split_factor) if isinstance(p, StridedShard) else Shard(od)


def _map_dims(spec, dim_map):
    """Placements through ``dim_map`` (input dim -> output dim or None = gather)."""

    def carry(p):
        od = dim_map(p.dim)
        return None if od is None else _moved(p, od)

    return _carried(spec, carry)


# (spec, coordinate) -> local block shape: views run on every cached call.
_block_shapes: dict = {}


def _block_shape(out_spec, coord):
    key = (out_spec, coord)
    shape = _block_shapes.get(key)
    if shape is None:
        shape = local_shape(out_spec.shape, out_spec.mesh.shape, out_spec.placements, coord)
        if len(_block_shapes) >= 4096:
            _block_shapes.clear()
        _block_shapes[key] = shape
    return shape


# view / _unsafe_view -------------------------------------------------------------
def view_groups(ishape, oshape):
    """Pair runs of input dims with runs of output dims of equal product.

    Returns ``[(in_dims, out_dims), ...]`` or None when sizes contain zeros or
    do not line up.
    """
    if 0 in ishape or 0 in oshape:
        return None
    groups = []
    i = j = 0
    n, m = len(ishape), len(oshape)
    while i < n or j < m:
        ins, outs = [], []
        pi = po = 1
        if i < n:
            ins.append(i)
            pi *= ishape[i]
            i += 1
        if j < m:
            outs.append(j)
            po *= oshape[j]
            j += 1
        while pi != po:
            if pi < po and i < n:
                ins.append(i)
                pi *= ishape[i]
                i += 1
            elif po < pi and j < m:
                outs.append(j)
                po *= oshape[j]
                j += 1
            else:
                return None
        groups.append((ins, outs))
    return groups


def _view_local(func, coord, out_specs, args, kwargs):
    shape = _block_shape(out_specs[0], coord)
    try:
        return func(args[0], shape)
    except RuntimeError:
        # A block whose strides cannot express the view though its global
        # tensor's can (an uneven piece kept as a slice of a larger buffer,
        # say a from_local block): this rank's view is a copy of the same
        # elements. Our own producers hand over contiguous uneven pieces.
        if func is aten.expand.default or args[0].is_contiguous():
            raise
        return func(args[0].contiguous(), shape)


def view_rule(call):
    (spec,) = call.specs
    a = bind(call)
    size = list(a["size"])
    if -1 in size:
        known = 1
        for s in size:
            if s != -1:
                known *= s
        total = 1
        for s in spec.shape:
            total *= s
        if known == 0:
            return None
        size[size.index(-1)] = total // known
    if tuple(size) == spec.shape:
        # The identity view (``x.view_as(x)``): every element stays put, so
        # every layout carries over, Partial(max/min) included.
        return Sharding((None,), (spec.placements,), local=_view_local)
    groups = view_groups(spec.shape, tuple(size))
    if groups is None:
        if all(isinstance(p, (Replicate, Partial)) for p in spec.placements):
            return Sharding((None,), (spec.placements,))
        return None
    carry = {}
    for ins, outs in groups:
        carry.update(_group_carry(spec, size, ins, outs))
    # Size-1 dims grouped away hold a shard of size 1 or 0: gather them.
    want, out = _carried(spec, lambda p: carry[p.dim](p) if p.dim in carry else None)
    return Sharding((want,), (out,), local=_view_local)


def _group_carry(spec, size, ins, outs) -> dict:
    """For the input dims ``ins`` viewed as the output dims ``outs`` (equal
    products): input dim -> what a cut of it becomes (``_carried``)."""
    big_in = [d for d in ins if spec.shape[d] != 1]
    big_out = [d for d in outs if size[d] != 1]
    if not big_in:
        return {}
    major_in, major_out = big_in[0], big_out[0]
    if len(big_in) == 1 and len(big_out) == 1:
        return {major_in: lambda p: _moved(p, major_out)}
    cuts = {d: [p for p in spec.placements if isinstance(p, (Shard, StridedShard)) and p.dim == d]
            for d in big_in}
    k = num_shards(spec, major_in)
    even = spec.shape[major_in] % k == 0 and size[major_out] % k == 0
    # The major dim's contiguous pieces stay contiguous when they are even;
    # a StridedShard of it is gathered (its runs need not fall on whole rows).
    carry = {major_in: lambda p: Shard(major_out) if isinstance(p, Shard) and even else None}
    last = big_in[-1]
    if len(big_out) == 1 and cuts[last] and all(isinstance(p, Shard) for p in cuts[last]) \
            and not any(cuts[d] for d in big_in[:-1]):
        # Merged, the inner dim cut: every run of it (one per index of the
        # dims before) holds this rank's piece, in order.
        sf = math.prod(spec.shape[d] for d in ins[:ins.index(last)])
        carry[last] = lambda p: StridedShard(major_out, sf)
    elif len(big_in) == 1 and cuts[major_in] and all(
            isinstance(p, StridedShard) and p.split_factor == _before(size, outs, big_out[-1])
            for p in cuts[major_in]):
        # Split back: one run per index of the leading output dims.
        carry[major_in] = lambda p: Shard(big_out[-1])
    return carry


def _before(size, outs, d: int) -> int:
    """Product of the sizes of the output dims of ``outs`` before ``d``."""
    return math.prod(size[o] for o in outs[:outs.index(d)])


# transpose / permute / t ----------------------------------------------------------
def transpose_rule(call):
    (spec,) = call.specs
    a = bind(call)
    if spec.ndim < 2:
        return Sharding((None,), (spec.placements,))
    d0, d1 = norm_dim(a["dim0"], spec.ndim), norm_dim(a["dim1"], spec.ndim)

    def m(d):
        return d1 if d == d0 else d0 if d == d1 else d

    want, out = _map_dims(spec, m)
    return Sharding((want,), (out,))


def t_rule(call):
    (spec,) = call.specs
    if spec.ndim < 2:
        return Sharding((None,), (spec.placements,))
    want, out = _map_dims(spec, lambda d: 1 - d)
    return Sharding((want,), (out,))


def permute_rule(call):
    (spec,) = call.specs
    dims = [norm_dim(d, spec.ndim) for d in bind(call)["dims"]]
    inv = {d: i for i, d in enumerate(dims)}
    want, out = _map_dims(spec, lambda d: inv[d])
    return Sharding((want,), (out,))


# unsqueeze / squeeze ---------------------------------------------------------------
def unsqueeze_rule(call):
    (spec,) = call.specs
    dim = norm_dim(bind(call)["dim"], spec.ndim + 1)
    want, out = _map_dims(spec, lambda d: d if d < dim else d + 1)
    return Sharding((want,), (out,))


def squeeze_rule(call):
    (spec,) = call.specs
    a = bind(call)
    if "dim" in a and a["dim"] is not None:
        dims = a["dim"] if isinstance(a["dim"], (list, tuple)) else [a["dim"]]
        dims = {norm_dim(d, spec.ndim) for d in dims}
    else:
        dims = set(range(spec.ndim))
    gone = sorted(d for d in dims if spec.shape[d] == 1) if spec.ndim else []

    def m(d):
        if d in gone:
            return None
        return d - sum(1 for g in gone if g < d)

    want, out = _map_dims(spec, m)

    def local(func, coord, out_specs, args, kwargs):
        # Squeeze the globally size-1 dims only: a shard may be size 1 locally.
        return aten.squeeze.dims(args[0], gone)

    return Sharding((want,), (out,), local=local)


# expand ----------------------------------------------------------------------------
def expand_rule(call):
    (spec,) = call.specs
    size = list(bind(call)["size"])
    lead = len(size) - spec.ndim

    def m(d):
        target = size[d + lead]
        if spec.shape[d] == 1 and target not in (-1, 1):
            return None
        return d + lead

    want, out = _map_dims(spec, m)
    return Sharding((want,), (out,), local=_view_local)


def repeat_rule(call):
    """``repeat``: a dim repeated once keeps its shard (moved right by the new
    leading dims); a dim tiled more than once is gathered first. Every rank
    tiles its own block by the same counts."""
    (spec,) = call.specs
    reps = list(bind(call)["repeats"])
    lead = len(reps) - spec.ndim
    want, out = _map_dims(spec, lambda d: d + lead if reps[d + lead] == 1 else None)
    return Sharding((want,), (out,))


# slice / select / split / unbind -----------------------------------------------------
def slice_rule(call):
    (spec,) = call.specs
    a = bind(call)
    if spec.ndim == 0:
        return None
    dim = norm_dim(a["dim"], spec.ndim)
    start, end, step = a["start"], a["end"], a["step"]
    size = spec.shape[dim]
    whole = (
        (start is None or start == 0 or start <= -size)
        and (end is None or end >= size)
        and step == 1
    )
    want, out = _map_dims(spec, lambda d: d if d != dim or whole else None)
    return Sharding((want,), (out,))


def narrow_copy_rule(call):
    """``narrow_copy``: as ``slice`` (a copy, not a view): other dims keep shards."""
    (spec,) = call.specs
    a = bind(call)
    if spec.ndim == 0:
        return None
    dim = norm_dim(a["dim"], spec.ndim)
    size = spec.shape[dim]
    whole = a["start"] in (0, -size) and a["length"] == size
    want, out = _map_dims(spec, lambda d: d if d != dim or whole else None)
    return Sharding((want,), (out,))


def drop_dim_rule(call):
    """select / unbind: ``dim`` goes away (gathered first where sharded)."""
    (spec,) = call.specs
    dim = norm_dim(bind(call)["dim"], spec.ndim)
    want, out = _map_dims(spec, lambda d: None if d == dim else d - (d > dim))
    return Sharding((want,), (out,))


def split_rule(call):
    (spec,) = call.specs
    if spec.ndim == 0:
        return None
    dim = norm_dim(bind(call)["dim"], spec.ndim)
    want, out = _map_dims(spec, lambda d: None if d == dim else d)
    return Sharding((want,), (out,))


# flip / roll -------------------------------------------------------------------------
def _whole_dims_rule(dims_arg: str):
    def rule(call):
        (spec,) = call.specs
        dims = bind(call)[dims_arg]
        if not dims:
            dims = range(spec.ndim)
        whole = {norm_dim(d, spec.ndim) for d in dims} if spec.ndim else set()
        want, out = _map_dims(spec, lambda d: None if d in whole else d)
        return Sharding((want,), (out,))

    return rule


# Every rule here maps placements by dims alone: a StridedShard of a dim the
# op leaves in place keeps its rows, as a Shard does. Those that make more
# elements than they read (expand, repeat) see it replicated: few rules read
# interleaved rows, and the next one would gather the larger output.
_GROWS = (aten.expand.default, aten.repeat.default)
RULES: dict = {op: rule if op in _GROWS else strided_aware(rule) for op, rule in {
    aten.view.default: view_rule,
    aten._unsafe_view.default: view_rule,
    aten.transpose.int: transpose_rule,
    aten.t.default: t_rule,
    aten.permute.default: permute_rule,
    aten.unsqueeze.default: unsqueeze_rule,
    aten.squeeze.default: squeeze_rule,
    aten.squeeze.dim: squeeze_rule,
    aten.squeeze.dims: squeeze_rule,
    aten.expand.default: expand_rule,
    aten.repeat.default: repeat_rule,
    aten.slice.Tensor: slice_rule,
    aten.narrow_copy.default: narrow_copy_rule,
    aten.select.int: drop_dim_rule,
    aten.split.Tensor: split_rule,
    aten.split_with_sizes.default: split_rule,
    aten.unbind.int: drop_dim_rule,
    aten.flip.default: _whole_dims_rule("dims"),
    aten.roll.default: _whole_dims_rule("dims"),
}.items()}
