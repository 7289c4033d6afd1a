"""Views and shape ops: view/reshape, transpose/permute/t, (un)squeeze,
expand, slice, select, split/unbind, cat/stack, index_select, gather, flip,
roll.

Shards follow the dims they live on. A view that merges or splits dims keeps
a shard only on the leading (major) dim of the group and only when the
pieces are even, so every local block is exactly the block of the output
layout; otherwise that dim is gathered first. Ops whose size arguments name
global sizes (view, expand) are run with this rank's block sizes. Views only
move, pick or repeat elements, so partial values of every reduce op pass
through them (cat, index_select and gather keep only sum/avg partials).
"""

from __future__ import annotations

import torch

from dtensor._norm_wire import refuse_negative
from dtensor.placement import Partial, Replicate, Shard, is_linear_partial
from dtensor.rules._util import bind, norm_dim, num_shards
from dtensor.sharding import Sharding
from dtensor.spec import local_block

__all__ = ["RULES", "view_groups"]

aten = torch.ops.aten


def _map_dims(spec, dim_map):
    """Placements through ``dim_map`` (input dim -> output dim or None = gather).

    Every Partial passes, max/min included: these ops only move, pick or
    repeat elements, and that commutes with any elementwise reduction. (It
    also lets in-place views on a Partial keep their storage, and with it
    their aliases: dtensor/dispatch/general.py refuses ones that would not.)
    """
    want, out = [], []
    for p in spec.placements:
        if isinstance(p, Shard):
            od = dim_map(p.dim)
            if od is None:
                want.append(Replicate())
                out.append(Replicate())
            else:
                want.append(p)
                out.append(Shard(od))
        else:
            want.append(p)
            out.append(p)
    return tuple(want), tuple(out)


# (spec, coordinate) -> local block shape: views run on every cached call.
_block_shapes: dict = {}


def _block_shape(out_spec, coord):
    key = (out_spec, coord)
    shape = _block_shapes.get(key)
    if shape is None:
        shape = local_block(out_spec.shape, out_spec.mesh.shape, out_spec.placements, coord)[0]
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
    return func(args[0], _block_shape(out_specs[0], coord))


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
    where = {}
    for ins, outs in groups:
        major_in = next((d for d in ins if spec.shape[d] != 1), None)
        major_out = next((d for d in outs if size[d] != 1), None)
        big_in = [d for d in ins if spec.shape[d] != 1]
        big_out = [d for d in outs if size[d] != 1]
        for d in ins:
            if d != major_in or major_out is None:
                where[d] = None
            elif len(big_in) == 1 and len(big_out) == 1:
                where[d] = major_out
            else:
                k = num_shards(spec, d)
                ok = spec.shape[d] % k == 0 and size[major_out] % k == 0
                where[d] = major_out if ok else None
    # Size-1 dims grouped away hold a shard of size 1 or 0: gather them.
    want, out = _map_dims(spec, lambda d: where.get(d))
    return Sharding((want,), (out,), local=_view_local)


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


# cat / stack -------------------------------------------------------------------------
def _join(specs, dim: int, shift: bool):
    """Shared placements for concatenated operands; their output placements."""
    want, out = [], []
    for axis in range(specs[0].mesh.ndim):
        kinds = [s.placements[axis] for s in specs]
        choice = Replicate()
        partials = {k for k in kinds if isinstance(k, Partial)}
        if all(k == kinds[0] for k in kinds) and is_linear_partial(kinds[0]):
            choice = kinds[0]
        elif (len(partials) == 1 and next(iter(partials)).norm_order is not None
              and all(isinstance(k, (Partial, Replicate)) for k in kinds)):
            # Norm pieces (clip_grad_norm_'s stack of per-tensor norms): a
            # replicated norm joins them without communication (it stays on
            # coordinate 0, zeros elsewhere), where reducing the pieces
            # would send one all-reduce per norm.
            choice = next(iter(partials))
        else:
            for s, k in zip(specs, kinds):
                # A dim sharded on earlier axes is sharded again (nested) only
                # from an operand that nests it so itself: it moves nothing.
                if isinstance(k, Shard) and (shift or k.dim != dim) and all(
                    s.placements[e] == k for e, q in enumerate(want) if q == k
                ):
                    choice = k
                    break
        want.append(choice)
        if isinstance(choice, Shard) and shift and choice.dim >= dim:
            out.append(Shard(choice.dim + 1))
        else:
            out.append(choice)
    return tuple(want), tuple(out)


def _joined(specs, want, out, shape=None) -> Sharding:
    """The Sharding of a cat/stack whose operands take ``want``.

    Replicated operands joining norm pieces stay as they are and become
    pieces inside the op (zeros off coordinate 0 of a finite p-norm axis):
    the same values ``Replicate -> Partial("norm<p>")`` gives, without a
    redistribute per operand (``clip_grad_norm_`` stacks one per replicated
    gradient every step), so the plan keeps a fast form.
    """
    axes = [a for a, p in enumerate(want) if isinstance(p, Partial) and p.norm_order is not None]
    keep = [i for i, s in enumerate(specs)
            if axes and any(s.placements[a] == Replicate() for a in axes)]
    shapes = None if shape is None else (shape,)
    if not keep:
        return Sharding((want,) * len(specs), (out,), shapes=shapes)
    inputs = []
    for i, s in enumerate(specs):
        if i in keep:
            inputs.append(tuple(s.placements[a] if a in axes and s.placements[a] == Replicate()
                                else p for a, p in enumerate(want)))
        else:
            inputs.append(want)
    zero = tuple((i, tuple(a for a in axes if specs[i].placements[a] == Replicate()
                           and not want[a].is_idempotent)) for i in keep)
    return Sharding(tuple(inputs), (out,), local=_norm_join_local(zero, want), shapes=shapes)


def _norm_join_local(zero, want):
    pieces = next(p for p in want if isinstance(p, Partial) and p.norm_order is not None)

    def local(func, coord, out_specs, args, kwargs):
        tensors = list(args[0])
        for i, axes in zero:
            t = tensors[i]
            # NOTE: the message is built only on failure (formatting the op
            # cost more than the check, three times per clip_grad_norm_).
            refuse_negative(t, _JoinOperand(func, i), pieces)
            for a in axes:
                if coord[a] != 0:
                    tensors[i] = torch.zeros_like(t)
                    break
        return func(tensors, *args[1:], **kwargs)

    return local


class _JoinOperand:
    """Names a replicated operand of a cat/stack in an error, when formatted."""

    __slots__ = ("func", "i")

    def __init__(self, func, i: int) -> None:
        self.func, self.i = func, i

    def __str__(self) -> str:
        return f"{self.func}: operand {self.i} (Replicate()) joining norm pieces"


def cat_rule(call):
    specs = call.specs
    if not specs or any(s.ndim != specs[0].ndim for s in specs) or specs[0].ndim == 0:
        return None
    dim = norm_dim(bind(call)["dim"], specs[0].ndim)
    want, out = _join(specs, dim, shift=False)
    return _joined(specs, want, out)


def stack_rule(call):
    specs = call.specs
    if not specs or any(s.shape != specs[0].shape for s in specs):
        return None
    dim = norm_dim(bind(call)["dim"], specs[0].ndim + 1)
    want, out = _join(specs, dim, shift=True)
    shape = list(specs[0].shape)
    shape.insert(dim, len(specs))
    return _joined(specs, want, out, tuple(shape))


# index_select / gather -------------------------------------------------------------
def index_select_rule(call):
    x, index = call.specs
    dim = norm_dim(bind(call)["dim"], x.ndim)
    wx, wi, out = [], [], []
    for px, pi in zip(x.placements, index.placements, strict=True):
        if isinstance(px, Shard) and px.dim != dim:
            wx.append(px), wi.append(Replicate()), out.append(px)
        elif is_linear_partial(px):
            wx.append(px), wi.append(Replicate()), out.append(px)
        elif isinstance(pi, Shard) and x.ndim > 0:
            wx.append(Replicate()), wi.append(pi), out.append(Shard(dim))
        else:
            wx.append(Replicate()), wi.append(Replicate()), out.append(Replicate())
    return Sharding((tuple(wx), tuple(wi)), (tuple(out),))


def gather_rule(call):
    """``gather(x, dim, index)``: ``out[..i..] = x[..index[..i..]..]`` along
    ``dim`` and at the *same* position along every other dim, so a shard of
    another dim must cut x and the index alike (their sizes there must match);
    the index may be sharded along ``dim`` itself against a replicated x."""
    x, index = call.specs
    if x.ndim != index.ndim or x.ndim == 0:
        return None
    dim = norm_dim(bind(call)["dim"], x.ndim)
    wx, wi, out = [], [], []
    for px, pi in zip(x.placements, index.placements, strict=True):
        if isinstance(px, Shard) and px.dim != dim and index.shape[px.dim] == x.shape[px.dim]:
            wx.append(px), wi.append(px), out.append(px)
        elif is_linear_partial(px) and not isinstance(pi, Shard):
            wx.append(px), wi.append(Replicate()), out.append(px)
        elif isinstance(pi, Shard) and pi.dim == dim:
            wx.append(Replicate()), wi.append(pi), out.append(pi)
        elif isinstance(pi, Shard) and index.shape[pi.dim] == x.shape[pi.dim]:
            wx.append(pi), wi.append(pi), out.append(pi)  # x cut like the index
        else:
            wx.append(Replicate()), wi.append(Replicate()), out.append(Replicate())
    # Every shard of a dim other than ``dim`` cuts both operands alike, and
    # shards of ``dim`` come from the index alone: nested shards of one dim
    # (several axes) line up in mesh-axis order.
    return Sharding((tuple(wx), tuple(wi)), (tuple(out),))


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


RULES: dict = {
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
    aten.slice.Tensor: slice_rule,
    aten.select.int: drop_dim_rule,
    aten.split.Tensor: split_rule,
    aten.split_with_sizes.default: split_rule,
    aten.unbind.int: drop_dim_rule,
    aten.cat.default: cat_rule,
    aten.stack.default: stack_rule,
    aten.index_select.default: index_select_rule,
    aten.gather.default: gather_rule,
    aten.flip.default: _whole_dims_rule("dims"),
    aten.roll.default: _whole_dims_rule("dims"),
}
