"""Covers: dtensor/rules/spatial.py against PyTorch's DTensor, as the
communication audit (bench/comm_audit.py) counts it: the op plus making its
result a full tensor, both runtimes on a 2-rank Gloo world. Ours must send
no more wire bytes (for equal bytes, no more collectives) than PyTorch's and
equal the single-device value:

- FFTs keep the shards of the dims they do not transform and the pieces
  of a sum;
- resampling (``F.interpolate``) keeps batch and channel shards and the
  pieces of a sum;
- ``grid_sample`` keeps a batch shard of input and grid, and the input's
  pieces of a sum beside a whole grid;
- pooling (dtensor/rules/batched.py) gathers a batch shorter than the mesh
  axis where its outputs (values and indices, or a padded window's larger
  output) are the larger, and reduces pieces onto a leading dim, evenly cut
  or not, only where that and gathering the pooled values later send less
  than an all-reduce.

And one accepted difference (``comm_audit.ACCEPTED``): PyTorch passes
``Partial("max")`` pieces through an FFT, which sends less but is wrong.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_comm_audit_fixes_dist import (
    _check_no_more_than_torch,
    _global,
    _libs,
    _make,
    _pieces,
    _run,
)


def _complex(shape, seed: int, n: int = 2) -> list[torch.Tensor]:
    re, im = _pieces(shape, seed, n), _pieces(shape, seed + 100, n)
    return [torch.complex(a, b) for a, b in zip(re, im, strict=True)]


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("name", "layout"), [
    ("irfft", "S0"), ("irfft", "S1"), ("hfft", "S1"), ("irfft", "Psum"), ("irfftn", "S0"),
])
def test_fft_keeps_untransformed_shards_and_sum_pieces(world, name, layout) -> None:
    fns = {"irfft": lambda x: torch.fft.irfft(x, n=8),
           "hfft": lambda x: torch.fft.hfft(x, dim=2),
           "irfftn": lambda x: torch.fft.irfftn(x, dim=(1, 2))}
    _check_no_more_than_torch(world, fns[name], [(layout, _complex((4, 3, 6), 70))])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layout", ["S0", "S1", "Psum"])
@pytest.mark.parametrize("mode", ["nearest", "bilinear", "bicubic-aa", "linear", "trilinear"])
def test_interpolate_keeps_batch_and_channel_shards(world, mode, layout) -> None:
    shape = {"linear": (4, 3, 5), "trilinear": (4, 3, 3, 4, 5)}.get(mode, (4, 3, 5, 6))
    kw = {"mode": mode.removesuffix("-aa"), "antialias": mode.endswith("-aa")}
    if mode == "nearest":
        kw = {"mode": "nearest"}
    _check_no_more_than_torch(world, lambda x: F.interpolate(x, scale_factor=0.5, **kw),
                              [(layout, _pieces(shape, 71))])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("S0", "R"), ("Psum", "R"), ("Psum", "Psum")])
@pytest.mark.parametrize("dims", [2, 3])
def test_grid_sample_keeps_batch_shards_and_sum_pieces(world, layouts, dims) -> None:
    x = _pieces((4, 3, *(5,) * dims), 72)
    g = [t.tanh() for t in _pieces((4, *(3,) * dims, dims), 73)]
    _check_no_more_than_torch(world, lambda a, b: F.grid_sample(a, b, align_corners=False),
                              [(layouts[0], x), (layouts[1], g)])


@pytest.mark.world_size(2)
def test_fft_of_max_pieces_is_right_where_torch_is_not(world) -> None:
    """Why ``fft.*`` of ``Partial(max)`` pieces is an accepted difference."""
    import comm_audit

    assert comm_audit.accepted("fft.irfft2", "P(max)")
    pieces = [torch.tensor([[1.0, -2.0, 3.0, 0.5]]), torch.tensor([[0.0, 4.0, -1.0, 2.0]])]
    got, want = _run(world, lambda x: torch.fft.irfft(x, n=6), [("Pmax", pieces)])
    torch.testing.assert_close(got["ours"][2], want)
    assert not torch.allclose(got["torch"][2], want)  # max of each piece's FFT


def _check_pool(world, fn, layout, pieces) -> None:
    """``_check_no_more_than_torch`` for a pooling call returning (values, indices)."""
    from _comm_bytes import CommBytes

    got = {}
    for name, (lib, mesh) in _libs(world).items():
        x = _make(lib, mesh, layout, pieces, world.rank)
        with CommBytes() as cb:
            full = [t.full_tensor() for t in fn(x)]
        got[name] = (len(cb.records), cb.wire, full)
    want = fn(_global(layout, pieces))
    (oc, ow, ov), (tc, tw, _) = got["ours"], got["torch"]
    for g, w in zip(ov, want, strict=True):
        torch.testing.assert_close(g, w)
    assert ow < tw + 1e-6, f"ours {oc} collectives / {ow:.0f} B, torch {tc} / {tw:.0f} B"
    assert ow < tw - 1e-6 or oc <= tc, f"ours {oc} collectives, torch {tc} ({ow:.0f} B)"


@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", ["adaptive_max2d", "max1d"])
def test_pooling_gathers_a_short_batch_whose_indices_outweigh_it(world, case) -> None:
    if case == "adaptive_max2d":
        fn, shape = (lambda x: F.adaptive_max_pool2d(x, (2, 3), return_indices=True),
                     (1, 4, 4, 4))
    else:
        fn, shape = (lambda x: F.max_pool1d(x, 3, 2, ceil_mode=True, return_indices=True),
                     (1, 2, 3))
    _check_pool(world, fn, "S0", _pieces(shape, 74, 1))


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layout", ["S0", "Pmax"])
def test_pooling_gathers_a_short_batch_whose_output_outgrows_it(world, layout) -> None:
    _check_no_more_than_torch(
        world, lambda x: F.avg_pool3d(x, 2, 1, 1, ceil_mode=True, count_include_pad=False,
                                      divisor_override=2),
        [(layout, _pieces((1, 2, 4, 4, 4), 75))])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["Pmax", "Pmin"])
def test_pooling_reduces_pieces_onto_an_uneven_channel_dim(world, kind) -> None:
    _check_no_more_than_torch(
        world, lambda x: F.avg_pool2d(x, (4, 4), (2, 3), 1, True, False, 2),
        [(kind, _pieces((1, 3, 9, 9), 76))])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["Psum", "Pmax"])
def test_max_pool_without_indices_reduces_pieces_onto_channels(world, kind) -> None:
    _check_no_more_than_torch(world, lambda x: F.max_pool1d(x, 3, 2, ceil_mode=True),
                              [(kind, _pieces((1, 2, 3), 77))])
