"""Covers: dtensor/fsdp/ with torch.compile of the blocks (backend
``aot_eager``, ``fullgraph=True``): blocks compiled then sharded (torchtitan's
order) or sharded then compiled with ``module.compile()`` train on 2 ranks
like the eager single-device model (losses, every step's gradients, final
parameters), with one graph per block and no recompile across steps."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from dtensor import DeviceMesh
from dtensor.fsdp import FSDPModule, fully_shard

STEPS = 3


@pytest.fixture(autouse=True)
def _fresh_compiler():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 10)  # 10 and 6 rows: 5 + 5 and 3 + 3 on 2 ranks
        self.b = nn.Linear(10, 6)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


def _sharded(ref, mesh, how: str, cnt):
    model = copy.deepcopy(ref)
    for i in range(2):
        if how == "compile-then-shard":
            model[i] = torch.compile(model[i], backend=cnt, fullgraph=True)
        fully_shard(model[i], mesh=mesh)
        if how == "shard-then-compile":
            model[i].compile(backend=cnt, fullgraph=True)
    fully_shard(model, mesh=mesh)
    return model


@pytest.mark.world_size(2)
@pytest.mark.parametrize("how", ["compile-then-shard", "shard-then-compile"])
def test_compiled_fsdp_blocks_train_like_eager(world, how) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(Block(), Block(), nn.Linear(6, 2))
    cnt = CompileCounterWithBackend("aot_eager")
    model = _sharded(ref, DeviceMesh("cpu", [0, 1]), how, cnt)
    assert isinstance(model[0], FSDPModule)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(8, 6, generator=g)
        loss = model(x.chunk(2)[world.rank]).pow(2).mean()
        loss.backward()
        want = ref(x.chunk(2)[world.rank]).pow(2).mean()  # this rank's loss
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        ref(x).pow(2).mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name, step=step: f"{name} {step}: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), rtol=1e-5, atol=1e-6)
    assert cnt.frame_count == 2  # one graph per block, none recompiled
