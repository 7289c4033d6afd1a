"""Covers: dtensor/fsdp/ with torch.compile of the blocks (backend
``aot_eager``, ``fullgraph=True``): blocks compiled then sharded (torchtitan's
order) or sharded then compiled with ``module.compile()`` train on 2 ranks
like the eager single-device model (losses, every step's gradients, final
parameters), with one graph per block and no recompile across steps; a block
with dropout, compiled without ``fullgraph``, breaks its graph at the draw
and still gives the single-device masks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import dtensor
from dtensor import DeviceMesh
from dtensor.fsdp import FSDPModule, fully_shard

STEPS = 3


@pytest.fixture(autouse=True)
def _fresh_compiler():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.a = nn.Linear(6, 10)  # 10 and 6 rows: 5 + 5 and 3 + 3 on 2 ranks
        self.b = nn.Linear(10, 6)
        self.drop = nn.Dropout(p)
        self.single_device = False  # draw the whole batch's mask on one device

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.drop.p:
            h = dtensor.random.dropout(h, self.drop.p) if self.single_device \
                else self.drop(h)
        return x + self.b(h)


def _sharded(ref, mesh, how: str, cnt):
    model = copy.deepcopy(ref)
    for i in range(2):
        model[i].single_device = False
        if how == "compile-then-shard":
            model[i] = torch.compile(model[i], backend=cnt, fullgraph=True)
        if how == "dropout":  # the draw breaks the graph: fullgraph=False
            model[i] = torch.compile(model[i], backend=cnt)
        fully_shard(model[i], mesh=mesh)
        if how == "shard-then-compile":
            model[i].compile(backend=cnt, fullgraph=True)
    fully_shard(model, mesh=mesh)
    return model


@pytest.mark.world_size(2)
@pytest.mark.parametrize("how", ["compile-then-shard", "shard-then-compile", "dropout"])
def test_compiled_fsdp_blocks_train_like_eager(world, how) -> None:
    torch.manual_seed(0)
    drop = 0.3 if how == "dropout" else 0.0
    ref = nn.Sequential(Block(drop), Block(drop), nn.Linear(6, 2))
    for block in ref[:2]:
        block.single_device = True
    cnt = CompileCounterWithBackend("aot_eager")
    model = _sharded(ref, DeviceMesh("cpu", [0, 1]), how, cnt)
    assert isinstance(model[0], FSDPModule)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(8, 6, generator=g)
        dtensor.random.manual_seed(step)
        loss = model(x.chunk(2)[world.rank]).pow(2).mean()
        loss.backward()
        if not drop:
            want = ref(x.chunk(2)[world.rank]).pow(2).mean()  # this rank's loss
            torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        dtensor.random.manual_seed(step)
        ref(x).pow(2).mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name, step=step: f"{name} {step}: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), rtol=1e-5, atol=1e-6)
    # One graph per block (two around each draw), none recompiled.
    assert cnt.frame_count == (4 if drop else 2)
