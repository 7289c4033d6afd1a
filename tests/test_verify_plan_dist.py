"""Covers: dtensor/testing/verify_plan.py: right tensor-parallel plans pass on
both runtimes; wrong ones (a norm between the two linears run on local shards
with no input redistribute; Colwise and Rowwise swapped; a Colwise layer whose
bias is added again on every shard; a row-wise layer whose bias is sharded
as a column-wise one) are caught with the first module and tensor that
differ, or the module that raised, with its parameters' placements."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from torch import nn

from dtensor import Replicate, Shard
from dtensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
)
from dtensor.testing import tensors
from dtensor.testing.verify_plan import verify_plan


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


@pytest.mark.world_size(2)
def test_megatron_mlp_plan_passes(world) -> None:
    verify_plan(MLP, {"w1": ColwiseParallel(), "w2": RowwiseParallel()},
                inputs=_inputs())


@pytest.mark.world_size(4)
def test_plan_passes_on_torch(world) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel as TCol
    from torch.distributed.tensor.parallel import RowwiseParallel as TRow

    verify_plan(MLP, {"w1": TCol(), "w2": TRow()}, inputs=_inputs(), impl="torch",
                max_examples=5)


@pytest.mark.world_size(2)
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


@pytest.mark.world_size(2)
def test_swapped_colwise_rowwise_is_caught(world) -> None:
    msg = _caught(MLP, {"w1": RowwiseParallel(), "w2": ColwiseParallel()},
                  inputs=_inputs())
    assert "first difference" in msg, msg


class HandRowwise(ParallelStyle):
    """Megatron's row-parallel linear written by hand, as users wrote tensor
    parallelism before plans: the weight's input features sharded, the matmul
    on this rank's blocks, the partial sums all-reduced, then the bias. The
    bias is laid out by ``bias``: ``Replicate()`` (right), ``Shard(0)`` (the
    layout ColwiseParallel gives a bias: wrong here). ``early=True`` adds the
    bias to the partial sums, before the all-reduce (wrong: counted on every
    rank)."""

    def __init__(self, bias, early: bool = False) -> None:
        self.bias, self.early = bias, early

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        from dtensor import DTensor, Partial, distribute_module, distribute_tensor

        def partition(name, mod, mesh):
            if name == "":
                mod.weight = nn.Parameter(distribute_tensor(mod.weight.data, mesh, [Shard(1)]))
                mod.bias = nn.Parameter(distribute_tensor(mod.bias.data, mesh, [self.bias]))

        def forward(x):  # x: this rank's block of the input features
            b = module.bias.to_local()
            y = torch.nn.functional.linear(x, module.weight.to_local(),
                                           b if self.early else None)
            y = DTensor.from_local(y, mesh, [Partial()]).redistribute(mesh, [Replicate()])
            y = y.to_local()
            return y if self.early else y + b

        distribute_module(module, mesh, partition)
        module.forward = forward
        return module


def _hand_plan(bias, early: bool = False) -> dict:
    return {"w1": ColwiseParallel(), "w2": HandRowwise(bias, early)}


@pytest.mark.world_size(2)
def test_hand_written_rowwise_plan_passes(world) -> None:
    verify_plan(MLP, _hand_plan(Replicate()), inputs=_inputs())


@pytest.mark.world_size(2)
def test_bias_sharded_as_colwise_in_a_rowwise_layer_is_caught(world) -> None:
    msg = _caught(MLP, _hand_plan(Shard(0)), inputs=_inputs())
    # the module that raised, with its parameters' layouts: the bias is S(0)
    assert "in module 'w2' (Linear; weight S(1), bias S(0))" in msg, msg


@pytest.mark.world_size(2)
def test_bias_added_on_every_rank_before_the_reduction_is_caught(world) -> None:
    msg = _caught(MLP, _hand_plan(Replicate(), early=True), inputs=_inputs())
    assert "forward output of module 'w2' (Linear; weight S(1), bias R)" in msg, msg
