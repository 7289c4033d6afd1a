"""Covers: the runtime on CUDA tensors: ``DeviceMesh("cuda")`` blocks stay on the
device through ops, redistribute and random ops, FSDP trains like one device,
and on a GPU world (``cpu:gloo,cuda:nccl``) CPU meshes keep working beside
CUDA ones. Marked ``cuda``: skipped with the reason on hosts without a device
per local rank; the 2-rank cases run on two GPUs, or on one under
``--dist-sim`` (every simulated rank shares the device)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor import random as rng
from dtensor.fsdp import fully_shard

pytestmark = pytest.mark.cuda

SIZES = pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.world_size(n), id=f"w{n}") for n in (1, 2)]
)


def _cuda_mesh(n: int) -> DeviceMesh:
    return DeviceMesh("cuda", list(range(n)))


@SIZES
def test_ops_and_redistribute_keep_blocks_on_the_device(n, world) -> None:
    mesh = _cuda_mesh(n)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2 * n + 3, 8, generator=g).cuda()
    w = torch.randn(8, 5, generator=g).cuda()
    d = distribute_tensor(x, mesh, [Shard(0)])
    assert d.to_local().is_cuda, d.to_local().device
    y = (d * 2 + 1) @ distribute_tensor(w, mesh, [Replicate()])
    assert y.placements == (Shard(0),) and y.to_local().is_cuda
    torch.testing.assert_close(y.full_tensor(), (x * 2 + 1) @ w)
    for target in ([Replicate()], [Shard(1)], [Shard(0)]):
        z = y.redistribute(mesh, target)
        assert z.to_local().is_cuda
        torch.testing.assert_close(z.full_tensor(), (x * 2 + 1) @ w)
    p = DTensor.from_local(torch.full((3, 2), float(world.rank + 1), device="cuda"),
                           mesh, [Partial()])
    want = torch.full((3, 2), float(sum(range(1, n + 1))), device="cuda")
    torch.testing.assert_close(p.full_tensor(), want)
    torch.testing.assert_close(p.sum().full_tensor(), want.sum())


@SIZES
def test_random_ops_equal_the_single_device_reference(n, world) -> None:
    mesh = _cuda_mesh(n)
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        rng.manual_seed(11)
        d = distribute_tensor(torch.zeros(2 * n + 1, 5, device="cuda"), mesh, placements)
        d.uniform_(-1.0, 2.0)
        rng.manual_seed(11)
        want = rng.uniform_(torch.zeros(2 * n + 1, 5, device="cuda"), -1.0, 2.0)
        assert d.to_local().is_cuda
        torch.testing.assert_close(d.full_tensor(), want, rtol=0, atol=0)
        rng.manual_seed(12)
        drop = torch.nn.functional.dropout(
            distribute_tensor(torch.ones(4 * n, 3, device="cuda"), mesh, placements), 0.5)
        rng.manual_seed(12)
        ref = rng.dropout(torch.ones(4 * n, 3, device="cuda"), 0.5)
        torch.testing.assert_close(drop.full_tensor(), ref, rtol=0, atol=0)


@SIZES
def test_fsdp_trains_like_one_device(n, world) -> None:
    mesh = _cuda_mesh(n)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 3)).cuda()
    model = copy.deepcopy(ref)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4 * n, 6, generator=g).cuda()
        model(x.chunk(n)[mesh.get_rank()]).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert p.grad.to_local().is_cuda
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6)
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6)


@SIZES
def test_cpu_meshes_work_beside_cuda_meshes(n, world) -> None:
    # A GPU world joins with cpu:gloo,cuda:nccl: CPU-tensor tests keep running.
    cpu = DeviceMesh("cpu", list(range(n)))
    x = torch.arange(float(6 * n)).reshape(3 * n, 2)
    d = distribute_tensor(x, cpu, [Shard(0)])
    assert not d.to_local().is_cuda
    torch.testing.assert_close(d.redistribute(cpu, [Replicate()]).to_local(), x)
    c = distribute_tensor(x.cuda(), _cuda_mesh(n), [Shard(0)])
    torch.testing.assert_close(c.full_tensor().cpu(), d.full_tensor())
