"""Covers: dtensor/_compile.py with dtensor/parallel/ (parallel styles under
torch.compile) on a 2-rank Gloo world: a parallelized block and a
vocabulary-parallel embedding compile as one graph (``fullgraph=True``) and
train like eager; hooks installed before Dynamo is imported are still traced.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from dtensor import Replicate, Shard

from _compile_checks import assert_same, fresh_compiler  # noqa: F401 - autouse


# Parallel styles: their module hooks trace into the compiled graph ------------------------
class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.ffn = torch.nn.ModuleDict({"w1": torch.nn.Linear(8, 16), "w2": torch.nn.Linear(16, 8)})

    def forward(self, x):
        h = self.norm(x)
        return x + self.ffn["w2"](torch.relu(self.ffn["w1"](h)))


@pytest.mark.world_size(2)
def test_parallelized_block_compiles_as_one_graph_and_trains_like_eager(
    line_mesh, world
) -> None:
    from dtensor import parallel as tp

    mesh = line_mesh(2)
    torch.manual_seed(0)
    base = _Block()
    plan = {
        "norm": tp.SequenceParallel(),
        "ffn": tp.PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "ffn.w1": tp.ColwiseParallel(),
        "ffn.w2": tp.RowwiseParallel(output_layouts=Shard(1)),
    }
    blocks = [tp.parallelize_module(copy.deepcopy(base), mesh, plan) for _ in range(2)]
    cnt = CompileCounterWithBackend("aot_eager")
    # fullgraph: a hook that Dynamo skipped would raise here instead of splitting the graph
    compiled = torch.compile(blocks[1], backend=cnt, fullgraph=True)
    g = torch.Generator().manual_seed(world.rank)
    for _ in range(2):
        x = torch.randn(2, 3, 8, generator=g)  # this rank's sequence shard
        _step_like_eager(blocks, compiled, x)
    assert cnt.frame_count == 1


def _step_like_eager(models, compiled, x) -> None:
    """One forward and backward of ``models[0]`` eagerly and of ``compiled``
    (``models[1]`` compiled): same output, same parameter gradients; clears them."""
    outs = []
    for fn in (models[0], compiled):
        out = fn(x)
        out.square().sum().backward()
        outs.append(out)
    assert_same(outs[1], outs[0])
    for (name, p0), p1 in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert p1.grad is not None, name
        assert_same(p1.grad, p0.grad)
        p0.grad = p1.grad = None


class _Tiny(torch.nn.Module):
    """A vocabulary-parallel embedding feeding a sequence-parallel norm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, ids):
        return self.norm(self.emb(ids))


@pytest.mark.world_size(2)
def test_vocab_parallel_embedding_compiles_into_the_model_graph(
    line_mesh, world
) -> None:
    # Its forward lives in dtensor (skipped by Dynamo): untraced, whole-model
    # compile broke the graph there and fullgraph=True raised.
    from dtensor import parallel as tp

    mesh = line_mesh(2)
    torch.manual_seed(0)
    base = _Tiny()
    plan = {"emb": tp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": tp.SequenceParallel()}
    models = [tp.parallelize_module(copy.deepcopy(base), mesh, plan) for _ in range(2)]
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(models[1], backend=cnt, fullgraph=True)
    _step_like_eager(models, compiled, torch.tensor([[1, 9, 4, 0], [7, 7, 2, 5]]))
    assert cnt.frame_count == 1


# Hooks installed before Dynamo is imported --------------------------------------------
_LATE_SCRIPT = r"""
import copy, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
from dtensor import DeviceMesh, Replicate, Shard
from dtensor import parallel as tp

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.w1 = torch.nn.Linear(8, 16)
        self.w2 = torch.nn.Linear(16, 8)
    def forward(self, ids):
        return self.w2(torch.relu(self.w1(self.emb(ids))))

mesh = DeviceMesh("cpu", [0])
torch.manual_seed(0)
base = Block()
plan = {"emb": tp.RowwiseParallel(input_layouts=Replicate()), "w1": tp.ColwiseParallel(),
        "w2": tp.RowwiseParallel(output_layouts=Shard(1))}
models = [tp.parallelize_module(copy.deepcopy(base), mesh, plan) for _ in range(2)]
print("dynamo imported by parallelize_module:", "torch._dynamo" in sys.modules)
ids = torch.tensor([[1, 9, 4, 0], [7, 7, 2, 5]])
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
cnt = CompileCounterWithBackend("aot_eager")
# fullgraph: a hook or forward that Dynamo skipped raises instead of splitting the graph
out = torch.compile(models[1], backend=cnt, fullgraph=True)(ids)
assert cnt.frame_count == 1, cnt.frame_count
assert torch.equal(out, models[0](ids))
print("OK")
"""


def test_styles_hooks_installed_before_dynamo_is_imported_still_trace(fresh_process) -> None:
    """parallelize_module leaves torch._dynamo unimported (~0.7 s per fresh
    process); once torch.compile imports it, the styles' hooks and the
    vocabulary-parallel forward are swapped for traced ones, so the model still
    compiles as one graph."""
    p = fresh_process(_LATE_SCRIPT)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
    assert "parallelize_module: False" in p.stdout, p.stdout


def test_late_tracing_refuses_what_is_not_a_hook_handle_or_bound_method() -> None:
    from dtensor._compile import trace_hook_later, trace_method_later

    with pytest.raises(TypeError, match="expected the handle register_forward_hook"):
        trace_hook_later(lambda m, i: i)
    with pytest.raises(TypeError, match=r"Linear\.forward is not a method set on the object"):
        trace_method_later(torch.nn.Linear(2, 2), "forward")  # the class's, not set on it


pytestmark = pytest.mark.slow  # starts several worlds or compiles: the full run, not the quick tier
