"""Covers: dtensor/fsdp/ with dtensor/checkpoint.py and torch.utils.checkpoint:
a DCP checkpoint saved with FSDP on 4 ranks resumes with FSDP on 2; activation
checkpointing inside and around FSDP modules gives the single-device
gradients."""

from __future__ import annotations

import copy
import pathlib
import sys

import pytest
import torch
from torch import nn

from dtensor import DeviceMesh
from dtensor.fsdp import fully_shard

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_fsdp import ADAMW, MLP, _pair, _train  # the MLP and its training loop


@pytest.mark.world_size(4)
def test_dcp_checkpoint_on_4_ranks_resumes_with_fsdp_on_2(world, shared_dir) -> None:
    """Model and AdamW state saved mid-training with FSDP on 4 ranks (an empty
    shard among them), loaded into FSDP on ranks 0-1: the resumed run's
    gradients and parameters are the uninterrupted single-device run's."""
    import dtensor.checkpoint as ckpt

    mesh4 = DeviceMesh("cpu", [0, 1, 2, 3])
    ref, model = _pair(mesh4)
    make = ADAMW["foreach"]
    _train(ref, model, mesh4, 2, make)
    opt = make(model.parameters())
    ropt = make(ref.parameters())
    x = torch.randn(8, 5)
    model(x.chunk(4)[world.rank]).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    opt.step()
    ropt.step()
    opt.zero_grad()
    ropt.zero_grad()
    with shared_dir() as path:
        ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
        if world.rank < 2:
            mesh2 = DeviceMesh("cpu", [0, 1])
            torch.manual_seed(5)  # other initial values: the checkpoint must win
            resumed = MLP()
            for m in (resumed.a, resumed.b):
                fully_shard(m, mesh=mesh2)
            fully_shard(resumed, mesh=mesh2)
            opt2 = make(resumed.parameters())
            resumed(torch.zeros(1, 5)).sum().backward()  # create the AdamW state to fill
            opt2.step()
            opt2.zero_grad()
            sd = {"model": resumed.state_dict(), "optim": opt2.state_dict()}
            ckpt.load(sd, path)
            resumed.load_state_dict(sd["model"])
            opt2.load_state_dict(sd["optim"])
            _train(ref, resumed, mesh2, 2, make, opts=(opt2, ropt))


class _Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("where", ["inside", "outside"])
def test_activation_checkpointing_gives_the_single_device_gradients(world, where) -> None:
    """``inside``: the FSDP module's forward checkpoints its child (recompute
    sees the parameters the pre-backward gather shows); ``outside``: the
    FSDP module itself is checkpointed (its hooks run again in recompute)."""
    mesh = DeviceMesh("cpu", [0, 1])
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    model = copy.deepcopy(ref)
    if where == "inside":
        model = nn.Sequential(_Checkpointed(model[0]), model[1], _Checkpointed(model[2]))
        for m in (model[0], model[2]):
            fully_shard(m, mesh=mesh)
    else:
        for m in (model[0], model[2]):
            fully_shard(m, mesh=mesh)
        model = nn.Sequential(_Checkpointed(model[0]), model[1], _Checkpointed(model[2]))
    fully_shard(model, mesh=mesh)
    x = torch.randn(4, 5)
    for _ in range(2):  # the second step sees the first step's resharded state
        model(x.chunk(2)[world.rank]).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad)  # 2 steps, /2 ranks
