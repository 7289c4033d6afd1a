"""Covers: dtensor/fsdp/group.py memory order: in backward a group's unsharded
parameters are freed before its gradients are reduce-scattered (the peak
holds one full-size buffer fewer), except when a gradient shares their
storage, which then stays readable until the reduction has read it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtensor import DeviceMesh
from dtensor.fsdp import fully_shard
from dtensor.fsdp import group as fsdp_group

WORLDS = pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.world_size(n), id=f"w{n}") for n in (2, 4)]
)


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 7)
        self.b = nn.Linear(7, 5)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@WORLDS
def test_unsharded_parameters_are_freed_before_the_reduce_scatter(world, n, monkeypatch):
    mesh = DeviceMesh("cpu", list(range(n)))
    torch.manual_seed(0)
    model = _Blocks()
    for m in (model.a, model.b):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    seen = []
    reduce_grads = fsdp_group.ParamGroup.reduce_grads

    def spy(self, grads):
        seen.append(self.flat.untyped_storage().size())
        return reduce_grads(self, grads)

    monkeypatch.setattr(fsdp_group.ParamGroup, "reduce_grads", spy)
    model(torch.randn(3, 6)).sum().backward()
    assert len(seen) == 2  # a and b; the root has no parameters of its own
    assert seen == [0, 0], f"unsharded bytes still held at the reduce-scatter: {seen}"
    assert model.a.weight.grad is not None and model.b.weight.grad is not None


class _GradIsWeight(torch.autograd.Function):
    """``w.sum()`` whose gradient for ``w`` is ``w`` itself (a view of the
    unsharded buffer), as an op that hands back a saved input could."""

    @staticmethod
    def forward(ctx, w):
        ctx.save_for_backward(w)
        return w.sum()

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return w


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(35.0).view(7, 5))

    def forward(self, x):
        return _GradIsWeight.apply(self.w) + x.sum()


@WORLDS
def test_a_gradient_sharing_the_unsharded_storage_is_read_before_it_is_freed(world, n):
    mesh = DeviceMesh("cpu", list(range(n)))
    inner = _Holder()
    model = nn.Sequential(inner)
    fully_shard(inner, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.ones(2)).backward()
    # Every rank's gradient is the whole weight: their average is the weight.
    grad = inner.w.grad
    assert torch.equal(grad.full_tensor(), torch.arange(35.0).view(7, 5))
    assert inner._fsdp_state.group.flat.untyped_storage().size() == 0  # freed after
