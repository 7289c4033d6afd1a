"""Covers: the ``gather`` rule of dtensor/rules/view.py on Gloo worlds.

``out[i][j] = x[i][index[i][j]]`` (dim 1): the index picks along ``dim`` but
every other dim is read at the *same* position in x. The rule used to let
an index sharded along another dim run against a replicated x, so each rank
gathered from x's first rows: wrong values on every rank but the first
(``gather(R x, 1, S(0) index)`` on 2 ranks), silently. Now a shard of another
dim cuts x and the index alike (where their sizes there match; otherwise
both are replicated there) and the index alone may be sharded along ``dim``.
Every (x, index) placement pair over R / S(0) / S(1), gather dims 0 and 1
(and -1 on 3-D), index shapes equal to x's and smaller, uneven shards, 2 and
4 ranks, nested shards on a 2x2 mesh, and the gradient of x. Values equal
single device; where x is sharded like the index nothing is sent.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dtensor import DeviceMesh, Replicate, Shard, distribute_tensor
from dtensor.debug import CommCounter

S0, S1, R = Shard(0), Shard(1), Replicate()

WORLDS = pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.world_size(n), id=f"w{n}") for n in (2, 4)]
)


def _index(shape, high: int, seed: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _x(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@WORLDS
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("index_shape", ["same", "smaller"])
def test_gather_equals_single_device_for_every_placement_pair(n, dim, index_shape):
    mesh = DeviceMesh("cpu", list(range(n)))
    x = _x((7, 5), 1)
    shape = (7, 5) if index_shape == "same" else (5, 3)
    index = _index(shape, x.shape[dim], 2)
    want = torch.gather(x, dim, index)
    for px, pi in itertools.product((R, S0, S1), repeat=2):
        dx, di = distribute_tensor(x, mesh, [px]), distribute_tensor(index, mesh, [pi])
        with CommCounter() as comm:
            out = torch.gather(dx, dim, di)
        where = f"gather(x {px}, {dim}, index {shape} {pi}) on {n} ranks"
        torch.testing.assert_close(out.full_tensor(), want, atol=0, rtol=0,
                                   msg=lambda m: f"{where}: {m}")
        if index_shape == "same" and px == pi and px != R and px.dim != dim:
            assert comm.total == 0, f"{where}: {comm.counts}"


@WORLDS
def test_gather_3d_last_dim(n):
    mesh = DeviceMesh("cpu", list(range(n)))
    x = _x((3, 6, 4), 3)
    index = _index((3, 6, 2), 4, 4)
    want = torch.gather(x, -1, index)
    for px, pi in itertools.product((R, S0, S1, Shard(2)), repeat=2):
        out = torch.gather(distribute_tensor(x, mesh, [px]), -1,
                           distribute_tensor(index, mesh, [pi]))
        torch.testing.assert_close(out.full_tensor(), want, atol=0, rtol=0,
                                   msg=lambda m, px=px, pi=pi: f"x {px}, index {pi}: {m}")


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    "x_pls, i_pls, sends",
    [((S0, S0), (S0, S0), False), ((R, R), (S0, S0), False), ((S0, S0), (R, R), False),
     ((S0, R), (R, S0), True), ((S0, S0), (S1, S0), True)],
    ids=lambda v: ",".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_gather_nested_shards(x_pls, i_pls, sends):
    """2x2 mesh, dim 0 sharded on both axes: x and the index cut alike in
    mesh-axis order send nothing; other mixtures move data, values right."""
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    x = _x((7, 5), 8)
    index = _index((7, 3), 5, 9)
    dx, di = distribute_tensor(x, mesh, list(x_pls)), distribute_tensor(index, mesh, list(i_pls))
    with CommCounter() as comm:
        out = torch.gather(dx, 1, di)
    where = f"gather(x {x_pls}, 1, index {i_pls})"
    assert (comm.total > 0) == sends, f"{where}: {comm.counts}"
    if not sends:
        assert tuple(out.placements) == (S0, S0), f"{where}: {out.placements}"
    torch.testing.assert_close(out.full_tensor(), torch.gather(x, 1, index), atol=0, rtol=0,
                               msg=lambda m: f"{where}: {m}")


@WORLDS
@pytest.mark.parametrize("px, pi", [(R, S0), (S0, S0), (R, S1)], ids=str)
def test_gather_gradient_equals_single_device(n, px, pi):
    mesh = DeviceMesh("cpu", list(range(n)))
    x = _x((6, 5), 5)
    index = _index((6, 5), 5, 6)
    g = _x((6, 5), 7)
    ref = x.clone().requires_grad_()
    want = torch.gather(ref, 1, index)
    (want * g).sum().backward()
    dx = distribute_tensor(x, mesh, [px]).requires_grad_()
    out = torch.gather(dx, 1, distribute_tensor(index, mesh, [pi]))
    (out * distribute_tensor(g, mesh, list(out.placements))).sum().backward()
    torch.testing.assert_close(out.full_tensor(), want.detach(), atol=0, rtol=0)
    torch.testing.assert_close(dx.grad.full_tensor(), ref.grad, atol=1e-6, rtol=1e-6)
