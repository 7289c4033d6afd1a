"""Covers: dtensor/testing/verify_plan.py: right tensor-parallel plans pass on
both runtimes; wrong ones (a norm between the two linears run on local shards
with no input redistribute; Colwise and Rowwise swapped; a Colwise layer whose
bias is added again on every shard) are caught with the first module and
tensor that differ."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from torch import nn

from dtensor import Replicate, Shard
from dtensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from dtensor.testing import tensors
from dtensor.testing.verify_plan import verify_plan

W2 = pytest.mark.world_size(2)
W4 = pytest.mark.world_size(4)


class MLP(nn.Module):
    def __init__(self, d: int = 6, h: int = 8, act: nn.Module | None = None,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, h)
        self.act = act or nn.ReLU()
        self.drop = nn.Dropout(dropout)
        self.w2 = nn.Linear(h, d)

    def forward(self, x):
        return self.w2(self.drop(self.act(self.w1(x))))


class Softmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x, -1)


def _inputs(d: int = 6):
    return tensors(shape=st.tuples(st.integers(1, 5), st.just(d)), dtype=torch.float32,
                   fills=("small", "normal"))


def _caught(*args, **kwargs) -> str:
    with pytest.raises(AssertionError) as e:
        verify_plan(*args, **kwargs)
    msg = str(e.value)
    assert "parallel plan counterexample" in msg and "Replay:" in msg, msg
    return msg


@W2
def test_megatron_mlp_plan_passes(world) -> None:
    verify_plan(MLP, {"w1": ColwiseParallel(), "w2": RowwiseParallel()},
                inputs=_inputs())


@W4
def test_plan_passes_on_torch(world) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel as TCol
    from torch.distributed.tensor.parallel import RowwiseParallel as TRow

    verify_plan(MLP, {"w1": TCol(), "w2": TRow()}, inputs=_inputs(), impl="torch",
                max_examples=5)


@W2
def test_norm_on_local_shards_without_input_redistribute_is_caught(world) -> None:
    def make():
        return MLP(act=Softmax())

    msg = _caught(make, {"w1": ColwiseParallel(), "w2": RowwiseParallel()},
                  inputs=_inputs())
    assert "module 'w2'" in msg or "module 'act'" in msg or "model's output" in msg, msg
    # With the redistribute the plan was missing, it passes.
    verify_plan(make, {
        "w1": ColwiseParallel(use_local_output=False),
        "act": PrepareModuleInput(input_layouts=(Shard(-1),),
                                  desired_input_layouts=(Replicate(),)),
        "w2": RowwiseParallel(input_layouts=Replicate()),
    }, inputs=_inputs())


@W2
def test_swapped_colwise_rowwise_is_caught(world) -> None:
    msg = _caught(MLP, {"w1": RowwiseParallel(), "w2": ColwiseParallel()},
                  inputs=_inputs())
    assert "first difference" in msg, msg
