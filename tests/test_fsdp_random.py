"""Covers: dtensor/fsdp/rng.py (random ops on plain tensors inside an FSDP
forward): a model with nn.Dropout (or only F.dropout) and torch.randn_like in its FSDP blocks,
trained with FSDP on 2 and 4 ranks (uneven batches, rows of the flattened
batch x sequence) and with HSDP on 2x2, gives the losses and gradients of
single-device training with dtensor's generator at every step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtensor
from dtensor import DeviceMesh, DTensor
from dtensor.fsdp import FSDPError, fully_shard

STEPS = 3
BATCH, SEQ = 7, 3  # 7 rows: 4 + 3 on 2 ranks, 2 + 2 + 2 + 1 on 4


class Block(nn.Module):
    def __init__(self, dim: int, single_device: bool, functional: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        # functional: no dropout module anywhere in the model, only F.dropout
        self.drop = (lambda h: F.dropout(h, 0.3, self.training)) if functional else nn.Dropout(0.3)
        self.single_device = single_device

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.single_device:  # the whole batch's draws, on one device
            h = dtensor.random.dropout(h, 0.3)
            noise = dtensor.random.randn(*h.flatten(0, 1).shape)
            skip = dtensor.random.dropout(x, 0.1)
        else:
            h = self.drop(h)
            noise = torch.randn_like(h.flatten(0, 1))  # (batch * seq) rows
            skip = F.dropout(x, 0.1, self.training)
        return h + 0.1 * noise.view_as(h) + skip


class Net(nn.Module):
    def __init__(self, single_device: bool = False, functional: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(6, single_device, functional) for _ in range(2)])
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _run(model, mesh, rank: int, size: int):
    """Losses and every step's gradients; the loss is the sum over the whole
    batch / BATCH, so uneven shares still average to the single-device one."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    data = torch.Generator().manual_seed(1)
    losses, grads = [], []
    dtensor.random.manual_seed(0)
    for _ in range(STEPS):
        x = torch.randn(BATCH, SEQ, 6, generator=data).chunk(size)
        x = x[rank] if rank < len(x) else torch.zeros(0, SEQ, 6)
        loss = model(x).pow(2).sum() / BATCH * size
        loss.backward()
        grads.append([(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                      for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        if mesh is not None:
            loss = DTensor.from_local(loss.detach().view(1), mesh,
                                      [dtensor.Partial("avg")] * mesh.ndim).full_tensor()[0]
        losses.append(float(loss))
    return losses, grads


def _check(mesh, rank: int, size: int, functional: bool = False) -> None:
    torch.manual_seed(0)
    ref = Net(single_device=True)
    model = Net(functional=functional)
    model.load_state_dict(ref.state_dict())
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    want_losses, want_grads = _run(copy.deepcopy(ref), None, 0, 1)
    losses, grads = _run(model, mesh, rank, size)
    assert losses == pytest.approx(want_losses, rel=1e-5)
    for step, (got, want) in enumerate(zip(grads, want_grads, strict=True)):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, i=i, step=step: f"param {i} step {step}: {m}")


@pytest.mark.parametrize("n", [
    pytest.param(n, marks=pytest.mark.world_size(n), id=f"w{n}") for n in (2, 4)])
def test_dropout_under_fsdp_trains_like_single_device(world, n) -> None:
    mesh = DeviceMesh("cpu", list(range(n)))
    _check(mesh, world.rank, n)


@pytest.mark.world_size(2)
def test_functional_dropout_alone_under_fsdp_trains_like_single_device(world) -> None:
    # no dropout module: the first training forward finds the draws
    _check(DeviceMesh("cpu", [0, 1]), world.rank, 2, functional=True)


@pytest.mark.world_size(4)
def test_dropout_under_hsdp_trains_like_single_device(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("replicate", "shard"))
    _check(mesh, world.rank, 4)


@pytest.mark.world_size(2)
def test_a_draw_without_batch_major_rows_is_refused(world) -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(x.t())  # (6, local batch): dim 0 is not the batch

    model = fully_shard(Odd(), mesh=DeviceMesh("cpu", [0, 1]))
    with pytest.raises(FSDPError, match=r"multiple of the local batch 4.*move the batch"):
        model(torch.ones(4, 6))
    # The failed forward left no mode behind: plain draws outside FSDP are torch's.
    assert not torch.overrides._get_current_function_mode_stack()
    with pytest.raises(FSDPError, match="multiple of the local batch"):
        model(torch.ones(4, 6))


@pytest.mark.world_size(2)
def test_draws_are_routed_only_for_training_models_that_draw(world) -> None:
    """Models that draw nothing run without the interception after their first
    training forward (which finds that out); eval forwards never have it."""
    from dtensor.fsdp.rng import DataParallelRandom

    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            stack = torch.overrides._get_current_function_mode_stack()
            seen.append(any(isinstance(m, DataParallelRandom) for m in stack))
            return x

    mesh = DeviceMesh("cpu", [0, 1])
    plain = fully_shard(nn.Sequential(nn.Linear(4, 4), Probe()), mesh=mesh)
    dropping = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), Probe()), mesh=mesh)
    plain(torch.ones(2, 4))
    plain(torch.ones(2, 4))
    dropping(torch.ones(2, 4))
    dropping(torch.ones(2, 4))
    dropping.eval()
    dropping(torch.ones(2, 4))
    plain.eval()
    plain(torch.ones(2, 4))
    assert seen == [True, False, True, True, False, False]

    class NoDraw(nn.Module):  # dropout of p = 0 draws nothing (as in the example's Llama)
        def forward(self, x):
            return dtensor.random.dropout(F.dropout(x, 0.0, self.training), 0.0)

    seen.clear()
    zero = fully_shard(nn.Sequential(nn.Linear(4, 4), NoDraw(), Probe()), mesh=mesh)
    zero(torch.ones(2, 4))
    zero(torch.ones(2, 4))
    assert seen == [True, False]
