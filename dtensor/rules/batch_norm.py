"""Batch norm: ``native_batch_norm``, ``_native_batch_norm_legit``,
``_native_batch_norm_legit_no_training`` and ``_batch_norm_with_update``.

Statistics are per channel (the input's dim 1) over every other dim, so a
channel shard of the input stays (where it leaves no coordinate without
channels), with the per-channel operands (weight, bias, running mean and
variance) and the per-channel outputs (saved mean and inverse std) cut
alike: no collective. Training over a batch or spatial shard needs
statistics of the whole batch, so the input is gathered there (as PyTorch
does) and the per-channel operands are whole. In eval mode (running
statistics read, not written) the op is per element: a shard of any input
dim stays, the per-channel operands whole off the channel dim. Partial
inputs are reduced first (the op is not linear in them).

Training writes the running statistics in place, so they keep their own
layout: they are moved to the channels' cut for the op (mean and variance
in one buffer) and, updated, moved back and stored: a replicated pair cut
on the channels costs one all-gather of the updated slices, a sharded pair
against a gathered input one all-gather before and a local slice after.

On CPU, eval mode returns empty saved statistics (and
``_batch_norm_with_update`` an empty reserve): those outputs are replicated.
``_batch_norm_with_update`` runs on CPU meshes only: elsewhere its reserve
is a kernel workspace sized by the local block.
"""

from __future__ import annotations

import torch

from dtensor.placement import Replicate, Shard
from dtensor.redistribute import redistribute_local
from dtensor.rules._util import bind, returns
from dtensor.sharding import Sharding
from dtensor.spec import DTensorSpec, TensorMeta

__all__ = ["RULES"]

aten = torch.ops.aten

_PARAMS = ("weight", "bias", "running_mean", "running_var")
_STATS = ("running_mean", "running_var")

# Ops whose mode is fixed by the op rather than a ``training`` argument.
_MODE = {
    aten._native_batch_norm_legit_no_training.default: False,
    aten._batch_norm_with_update.default: True,
}


def _no_empty_block(size: int, counts) -> bool:
    """Whether cutting ``size`` channels by each of ``counts`` in turn leaves
    every block at least one (the kernels refuse an input with no element)."""
    sizes = [size]
    for n in counts:
        nxt = []
        for s in sizes:
            piece = -(-s // n)
            if piece * (n - 1) >= s:
                return False
            nxt += [piece] * (n - 1) + [s - piece * (n - 1)]
        sizes = nxt
    return True


def batch_norm_rule(call):
    a = bind(call)
    x = call.specs[0]
    names = [n for n in ("input", *_PARAMS) if a.get(n) is not None]
    if x.ndim < 2 or len(names) != len(call.specs):
        return None
    specs = dict(zip(names, call.specs, strict=True))
    channels = x.shape[1]
    if any(tuple(specs[n].shape) != (channels,) for n in names[1:]):
        return None
    stats = [n for n in _STATS if n in specs]
    training = _MODE.get(call.func, a.get("training"))
    if len(stats) == 1 or (not training and not stats):
        return None  # refused (or undefined) on one device as well
    cpu = x.mesh.device_type == "cpu"
    if returns(call.func) == 4 and not cpu:
        return None
    mesh = x.mesh

    want_x = []
    for axis, p in enumerate(x.placements):
        cuts = [mesh.size(e) for e, q in enumerate(want_x) if q == Shard(1)]
        if p == Shard(1) and _no_empty_block(channels, [*cuts, mesh.size(axis)]):
            want_x.append(p)
        elif not training and isinstance(p, Shard) and p.dim != 1:
            want_x.append(p)
        else:
            want_x.append(Replicate())
    want_x = tuple(want_x)
    chan = tuple(Shard(0) if q == Shard(1) else Replicate() for q in want_x)
    rep = tuple(Replicate() for _ in want_x)

    # Running statistics are never moved by dispatch: the op may write them,
    # and a moved copy would take the writes (or a write-back would gather
    # statistics that eval mode only reads).
    inputs = [want_x] + [None if n in _STATS else chan for n in names[1:]]
    moves = {}
    for n in stats:
        own = specs[n].placements
        if own != chan:
            moves.setdefault((own, specs[n].dtype), []).append(n)
    stat_out = rep if not training and cpu else chan
    outputs = (want_x, stat_out, stat_out) + ((rep,) if returns(call.func) == 4 else ())
    local = None
    if moves:
        local = _stats_local(tuple((own, dtype, tuple(ns)) for (own, dtype), ns in moves.items()),
                             chan, channels, bool(training))
    return Sharding(tuple(inputs), outputs, local=local)


def _arg_at(func, name: str, args: list, kwargs: dict):
    names = [s.name for s in func._schema.arguments]
    i = names.index(name)
    return (args, i) if i < len(args) else (kwargs, name)


def _stats_local(moves, chan, channels: int, write: bool):
    """Run the op with running statistics moved to ``chan`` (their channels
    cut like the input's), statistics of one layout and dtype in one buffer;
    in training, the updated statistics are moved back into their own
    layout and stored in the operands."""

    def local(func, coord, out_specs, args, kwargs):
        mesh = out_specs[0].mesh
        args, kwargs = list(args), dict(kwargs)
        plans = []
        for own, dtype, names in moves:
            meta = TensorMeta((len(names), channels), (channels, 1), dtype)
            held = DTensorSpec(mesh, _rows(own), meta)
            cut = held.with_placements(_rows(chan))
            slots = [_arg_at(func, n, args, kwargs) for n in names]
            operands = [box[key] for box, key in slots]
            moved = redistribute_local(torch.stack(operands), held, cut)
            for (box, key), row in zip(slots, moved.unbind(0), strict=True):
                box[key] = row
            plans.append((held, cut, slots, operands))
        out = func(*args, **kwargs)
        if write:
            for held, cut, slots, operands in plans:
                block = torch.stack([box[key] for box, key in slots])
                back = redistribute_local(block, cut, held)
                for t, row in zip(operands, back.unbind(0), strict=True):
                    t.copy_(row)
        return out

    return local


def _rows(placements):
    """Placements of statistics stacked as rows: their dim 0 is now dim 1."""
    return tuple(Shard(1) if p == Shard(0) else p for p in placements)


RULES: dict = {
    aten.native_batch_norm.default: batch_norm_rule,
    aten._native_batch_norm_legit.default: batch_norm_rule,
    aten._native_batch_norm_legit_no_training.default: batch_norm_rule,
    aten._batch_norm_with_update.default: batch_norm_rule,
}
