"""Ops that transform some dims as a whole and treat every slice along the
other dims on its own, so shards of those other dims stay and nothing is
sent:

- FFTs (``_fft_r2c``, ``_fft_c2r``, ``_fft_c2c``, under every ``torch.fft``
  function): the transformed dims are whole, the others keep their shards;
- resampling (``upsample_*``/``_upsample_*_aa`` forward, under
  ``F.interpolate``): the spatial dims are whole, batch and channel keep
  their shards; ``grid_sampler_2d/3d``: input and grid share a batch shard.

All of these are linear in the (first) input, so its ``Partial(sum/avg)``
pieces pass through (the grid of a grid sample must be whole).
A shard of a transformed dim and other pieces become ``Replicate``, as in
PyTorch: moving them onto a free dim (all-to-all, reduce-scatter) sends
less at the op, but a resampled or complex output is larger than the input,
so gathering it later sends more. A shard stays only where no rank's block
is empty (the FFT kernels refuse empty tensors, the resampling kernels zero
channels; an empty batch is fine).

Example: ``torch.fft.rfft(x, dim=1)`` of a ``Shard(0)`` tensor returns a
``Shard(0)`` tensor, with no collective.
"""

from __future__ import annotations

import torch

from dtensor.placement import Replicate, Shard, is_linear_partial
from dtensor.rules._util import bind, norm_dim, num_shards
from dtensor.sharding import Sharding

__all__ = ["RULES", "keep_independent"]

aten = torch.ops.aten


def _fits(spec, dim: int, empty_ok: bool = False) -> bool:
    """Whether ``dim`` cut into its shards leaves no rank's block empty
    (contiguous chunks: ``ceil(n / k) * (k - 1) < n``)."""
    k, n = num_shards(spec, dim), spec.shape[dim]
    return empty_ok or -(-n // k) * (k - 1) < n


def keep_independent(spec, free, *, linear: bool, empty_ok=()) -> tuple:
    """Placements of ``spec`` for an op that treats the dims in ``free``
    independently: their shards stay (``empty_ok``: free dims whose blocks
    may be empty), ``Partial(sum/avg)`` stays when the op is ``linear``,
    anything else becomes ``Replicate``."""
    return tuple(
        p if (isinstance(p, Replicate)
              or (type(p) is Shard and p.dim in free
                  and _fits(spec, p.dim, empty_ok=p.dim in empty_ok))
              or (linear and is_linear_partial(p)))
        else Replicate()
        for p in spec.placements)


def fft_rule(call):
    """``_fft_*(self, dim, normalization, ...)``: ``dim`` whole, others kept."""
    (spec,) = call.specs
    if spec.ndim == 0:
        return None
    active = {norm_dim(d, spec.ndim) for d in bind(call)["dim"]}
    free = set(range(spec.ndim)) - active
    place = keep_independent(spec, free, linear=True)
    return Sharding((place,), (place,))


def resample_rule(spatial: int):
    """Forward resampling with ``spatial`` trailing dims: batch and channel
    keep their shards, linear pieces stay."""

    def rule(call):
        spec = call.specs[0]
        lead = spec.ndim - spatial
        if len(call.specs) != 1 or lead < 1:
            return None
        place = keep_independent(spec, set(range(lead)), linear=True,
                                 empty_ok=(0,) if lead > 1 else ())
        return Sharding((place,), (place,))

    return rule


def grid_sampler_rule(call):
    """``grid_sampler_2d/3d(input, grid, ...)``: a batch shard for both, or
    the input's linear pieces beside a replicated grid."""
    x, grid = call.specs[:2]
    if x.ndim < 3 or grid.ndim != x.ndim or x.shape[0] != grid.shape[0]:
        return None
    want_x, want_g = [], []
    for p, g in zip(x.placements, grid.placements, strict=True):
        if Shard(0) in (p, g):
            want_x.append(Shard(0))
            want_g.append(Shard(0))
        elif isinstance(p, Replicate) or is_linear_partial(p):
            # A channel shard is gathered too, as in PyTorch: the output has
            # the grid's (often larger) spatial size, so keeping the shard
            # sends more when the output is gathered.
            want_x.append(p)  # the grid is made whole; the input stays
            want_g.append(Replicate())
        else:
            want_x.append(Replicate())
            want_g.append(Replicate())
    want_x, want_g = tuple(want_x), tuple(want_g)
    return Sharding((want_x, want_g), (want_x,))


RULES = {
    aten._fft_r2c.default: fft_rule,
    aten._fft_c2r.default: fft_rule,
    aten._fft_c2c.default: fft_rule,
    aten.upsample_nearest1d.default: resample_rule(1),
    aten.upsample_nearest2d.default: resample_rule(2),
    aten.upsample_nearest3d.default: resample_rule(3),
    aten._upsample_nearest_exact1d.default: resample_rule(1),
    aten._upsample_nearest_exact2d.default: resample_rule(2),
    aten._upsample_nearest_exact3d.default: resample_rule(3),
    aten.upsample_linear1d.default: resample_rule(1),
    aten.upsample_bilinear2d.default: resample_rule(2),
    aten.upsample_bicubic2d.default: resample_rule(2),
    aten.upsample_trilinear3d.default: resample_rule(3),
    aten._upsample_bilinear2d_aa.default: resample_rule(2),
    aten._upsample_bicubic2d_aa.default: resample_rule(2),
    aten.grid_sampler_2d.default: grid_sampler_rule,
    aten.grid_sampler_3d.default: grid_sampler_rule,
}
