"""Covers: rules that keep a layout where the replicate fallback gathered
(dtensor/rules/batched.py: selections along an unsharded dim, pooling,
group norm, ``histc`` with a range, ``as_strided`` identity, ``prims.view_of``;
dtensor/rules/view.py ``cat`` of pieces; dtensor/rules/pointwise.py
monotone ops of max/min pieces; dtensor/rules/tensor_ops.py ``fill``): no
collective at the op, and the full value equals single device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommDebugMode

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _x(*shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def _quiet(fn, *args):
    """``fn(*args)`` and the collectives it sent."""
    with CommDebugMode() as comm:
        out = fn(*args)
    return out, comm.get_total_counts()


def _full(x):
    if isinstance(x, (tuple, list)):
        return tuple(_full(y) for y in x)
    return x.full_tensor() if isinstance(x, DTensor) else x


CASES = {
    "kthvalue": (lambda a: tuple(a.kthvalue(2, 1)), (6, 5)),
    "mode": (lambda a: tuple(a.mode(1)), (6, 5)),
    "median_dim": (lambda a: tuple(a.median(1)), (6, 5)),
    "nanmedian_dim": (lambda a: tuple(a.nanmedian(1, keepdim=True)), (6, 5)),
    "max_pool2d": (lambda a: tuple(F.max_pool2d(a, 2, return_indices=True)), (6, 2, 4, 5)),
    "avg_pool2d": (lambda a: F.avg_pool2d(a, 2), (6, 2, 4, 5)),
    "adaptive_avg_pool2d": (lambda a: F.adaptive_avg_pool2d(a, 3), (6, 2, 4, 5)),
    "adaptive_max_pool2d": (lambda a: F.adaptive_max_pool2d(a, 3), (6, 2, 4, 5)),
    "max_pool3d": (lambda a: F.max_pool3d(a, 2), (6, 2, 2, 4, 4)),
    "avg_pool3d": (lambda a: F.avg_pool3d(a, 2), (6, 2, 2, 4, 4)),
    "group_norm": (lambda a: F.group_norm(a, 2), (6, 4, 5)),
    "as_strided_self": (lambda a: a.as_strided(a.size(), a.stride(), a.storage_offset()),
                        (6, 5)),
    "prims_view_of": (lambda a: torch.ops.prims.view_of(a), (6, 5)),
    "fill": (lambda a: torch.fill(a, 2.0), (6, 5)),
}


@pytest.mark.world_size(4)
@pytest.mark.parametrize("name", list(CASES))
def test_batch_sharded_ops_send_nothing(line_mesh, world, name) -> None:
    fn, shape = CASES[name]
    x = _x(*shape)
    d = distribute_tensor(x, line_mesh(4), [Shard(0)])
    got, sent = _quiet(fn, d)
    assert sent == 0, (name, sent)  # PyTorch: 0 (the batch shard stays)
    torch.testing.assert_close(_full(got), fn(x), **TOL)


@pytest.mark.world_size(4)
def test_histc_with_a_range_counts_per_shard(line_mesh, world) -> None:
    x = _x(9, 4)
    d = distribute_tensor(x, line_mesh(4), [Shard(0)])
    got, sent = _quiet(lambda a: torch.histc(a, 6, -1.5, 1.5), d)
    assert sent == 0 and got.placements == (Partial(),)
    torch.testing.assert_close(got.full_tensor(), torch.histc(x, 6, -1.5, 1.5))


def _pieces(mesh, x: torch.Tensor, kind: str) -> DTensor:
    """4 ranks' pieces of ``Partial(kind)`` on ``mesh`` whose reduction is ``x``."""
    me = mesh.get_coordinate()[0]
    if kind == "sum":
        local = x / 4
    else:  # max/min: one rank holds x, the others a worse value
        local = x if me == 2 else x + (-1.0 if kind == "max" else 1.0)
    return DTensor.from_local(local, mesh, [Partial(kind)], run_check=False)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("kind", ["max", "min", "sum"])
def test_cat_of_pieces_and_replicated_values_sends_nothing(
    line_mesh, world, kind
) -> None:
    x, y = _x(3, 4), _x(2, 4)
    a = _pieces(line_mesh(4), x, kind)
    b = distribute_tensor(y, line_mesh(4), [Replicate()])
    got, sent = _quiet(lambda p, q: torch.cat([p, q, p]), a, b)
    assert sent == 0 and got.placements == (Partial(kind),)
    torch.testing.assert_close(got.full_tensor(), torch.cat([x, y, x]), **TOL)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("fn", [lambda a: a.clamp(-0.5, 0.5), torch.relu, torch.exp,
                                torch.floor], ids=["clamp", "relu", "exp", "floor"])
def test_monotone_ops_keep_max_and_min_pieces(line_mesh, world, kind, fn) -> None:
    x = _x(5, 3)
    got, sent = _quiet(fn, _pieces(line_mesh(4), x, kind))
    assert sent == 0 and got.placements == (Partial(kind),)
    torch.testing.assert_close(got.full_tensor(), fn(x), **TOL)


@pytest.mark.world_size(4)
def test_avg_pool_keeps_pieces_of_a_sum(line_mesh, world) -> None:
    x = _x(2, 2, 4, 4)
    got, sent = _quiet(lambda a: F.avg_pool2d(a, 2), _pieces(line_mesh(4), x, "sum"))
    assert sent == 0 and got.placements == (Partial(),)
    torch.testing.assert_close(got.full_tensor(), F.avg_pool2d(x, 2), **TOL)
