"""Covers: the gather-free rules of dtensor/rules/reduction.py for whole-tensor
``max()`` / ``min()`` / ``aminmax()`` on Gloo worlds: values equal single device (uneven and
empty shards, NaN on one rank, ±inf, -0.0, integer dtypes, a 2-D mesh) and
the wire carries one all-reduce of one element, never a gather (the
fallback-bytes audit: the replicate fallback gathered the whole tensor); and
of dtensor/rules/nn.py for mse_loss and nll_loss (cross_entropy) with
reduction="mean"/"sum" on a sharded batch: one small all-reduce."""

from __future__ import annotations

import math

import pytest
import torch

from dtensor import DeviceMesh, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommCounter

WORLDS = pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.world_size(n), id=f"w{n}") for n in (2, 4)]
)


def _same(got, want, where: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (where, got, want)
    torch.testing.assert_close(got, want, equal_nan=True, atol=0, rtol=0,
                               msg=lambda m: f"{where}: {m}")


@WORLDS
@pytest.mark.parametrize("shape", [(5, 4, 3), (3,)], ids=["uneven", "empty-shards"])
def test_max_min_of_shards_send_one_element(line_mesh, world, n, shape) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    for d in range(len(shape)):
        dx = distribute_tensor(x, line_mesh(n), [Shard(d)])
        for fn in (torch.max, torch.min):
            with CommCounter() as c:
                got = fn(dx)
            where = f"{fn.__name__} S({d}) of {shape}"
            assert got.placements == (Replicate(),), where
            # one float32 on the wire (was an all-gather of the whole tensor)
            assert c.bytes == {"all_reduce": 4}, (where, c.bytes)
            _same(got.full_tensor(), fn(x), where)


@WORLDS
def test_max_min_keep_nan_inf_and_signed_zero(line_mesh, world, n) -> None:
    mesh = line_mesh(n)
    cases = {
        "nan-last": torch.cat([torch.ones(3 * n - 1), torch.tensor([math.nan])]),
        "nan-first": torch.cat([torch.tensor([math.nan]), -torch.ones(3 * n - 1)]),
        "infs": torch.cat([torch.full((n,), -math.inf), torch.full((n,), math.inf)]),
        "negative": -torch.arange(1.0, 2.0 * n + 1),
        "zeros": torch.tensor([0.0, -0.0] * n),
        "float64": torch.randn(2 * n + 1, dtype=torch.float64),
        "bfloat16": torch.randn(2 * n + 1).to(torch.bfloat16),
    }
    for name, x in cases.items():
        dx = distribute_tensor(x, mesh, [Shard(0)])
        for fn in (torch.max, torch.min):
            _same(fn(dx).full_tensor(), fn(x), f"{fn.__name__} {name}")
    ints = torch.randint(-100, 100, (2 * n + 1,), generator=torch.Generator().manual_seed(3))
    for dtype in (torch.int64, torch.int32, torch.uint8):
        x = ints.abs().to(dtype) if dtype is torch.uint8 else ints.to(dtype)
        dx = distribute_tensor(x, mesh, [Shard(0)])
        for fn in (torch.max, torch.min):
            with CommCounter() as c:
                got = fn(dx)
            assert c["all_gather"] == 0, (dtype, c.counts)
            _same(got.full_tensor(), fn(x), f"{fn.__name__} {dtype}")


@pytest.mark.world_size(4)
def test_max_min_on_a_2d_mesh_and_of_partial_values(line_mesh, world) -> None:
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    for placements in ([Shard(0), Shard(1)], [Shard(0), Shard(0)], [Replicate(), Shard(1)]):
        dx = distribute_tensor(x, mesh, placements)
        for fn in (torch.max, torch.min):
            with CommCounter() as c:
                got = fn(dx)
            assert c["all_gather"] == 0, (placements, c.counts)
            _same(got.full_tensor(), fn(x), f"{fn.__name__} {placements}")
    part = distribute_tensor(x, line_mesh(4), [Partial()])  # reduced first: max of sums
    for fn in (torch.max, torch.min):
        _same(fn(part).full_tensor(), fn(x), f"{fn.__name__} Partial")


@WORLDS
@pytest.mark.parametrize("shape", [(5, 3), (3,)], ids=["uneven", "empty-shards"])
def test_mse_loss_of_shards_sends_one_element(line_mesh, world, n, shape) -> None:
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    mesh = line_mesh(n)
    for d in range(len(shape)):
        for px, py in (([Shard(d)], [Shard(d)]), ([Shard(d)], [Replicate()]),
                       ([Replicate()], [Shard(d)])):
            dx, dy = distribute_tensor(x, mesh, px), distribute_tensor(y, mesh, py)
            for reduction in ("mean", "sum"):
                where = f"mse_loss {reduction} {px} {py} of {shape}"
                with CommCounter() as c:
                    got = torch.nn.functional.mse_loss(dx, dy, reduction=reduction).full_tensor()
                # one float32 all-reduced (was both operands gathered)
                assert c.bytes == {"all_reduce": 4}, (where, c.bytes)
                want = torch.nn.functional.mse_loss(x, y, reduction=reduction)
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6,
                                           msg=lambda m, where=where: f"{where}: {m}")
            with CommCounter() as c:  # 'none' stays sharded: no collective
                got = torch.nn.functional.mse_loss(dx, dy, reduction="none")
            assert c.total == 0 and got.placements == (Shard(d),), (c.counts, got.placements)
            torch.testing.assert_close(got.full_tensor(),
                                       torch.nn.functional.mse_loss(x, y, reduction="none"))


@WORLDS
@pytest.mark.parametrize("batch", [5, 3], ids=["uneven", "empty-shards"])
def test_cross_entropy_mean_of_a_sharded_batch_sends_two_elements(line_mesh, world, n, batch) -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(batch, 6, generator=g)
    target = torch.randint(0, 6, (batch,), generator=g)
    target[0] = -100  # ignored: the mean's divisor depends on the data
    weight = torch.rand(6, generator=g) + 0.5
    mesh = line_mesh(n)
    for kw in ({}, {"weight": weight}):
        ref = logits.clone().requires_grad_()
        want = torch.nn.functional.cross_entropy(ref, target, **kw)
        want.backward()
        dl = distribute_tensor(logits, mesh, [Shard(0)]).requires_grad_()
        dt = distribute_tensor(target, mesh, [Shard(0)])
        dkw = {k: distribute_tensor(v, mesh, [Replicate()]) for k, v in kw.items()}
        with CommCounter() as c:
            loss = torch.nn.functional.cross_entropy(dl, dt, **dkw)
        # the local sum and weight total in one all-reduce (was the batch gathered)
        assert c.bytes == {"all_reduce": 8}, (kw.keys(), c.bytes)
        assert loss.placements == (Replicate(),)
        torch.testing.assert_close(loss.full_tensor(), want, atol=1e-6, rtol=1e-6)
        with CommCounter() as c:
            loss.backward()
        assert c["all_gather"] == 0, c.counts
        assert dl.grad.placements == (Shard(0),)
        torch.testing.assert_close(dl.grad.full_tensor(), ref.grad, atol=1e-6, rtol=1e-6)


@WORLDS
@pytest.mark.parametrize("shape", [(5, 4, 3), (3,)], ids=["uneven", "empty-shards"])
def test_aminmax_of_shards_sends_two_elements(line_mesh, world, n, shape) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    x.view(-1)[-1] = math.nan if len(shape) == 1 else x.view(-1)[-1]  # NaN on the last rank
    for d in range(len(shape)):
        dx = distribute_tensor(x, line_mesh(n), [Shard(d)])
        with CommCounter() as c:
            lo, hi = torch.aminmax(dx)
        where = f"aminmax S({d}) of {shape}"
        # a float32 min and a float32 max (was an all-gather of the tensor)
        assert c.bytes == {"all_reduce": 8}, (where, c.bytes)
        want_lo, want_hi = torch.aminmax(x)
        _same(lo.full_tensor(), want_lo, where)
        _same(hi.full_tensor(), want_hi, where)
