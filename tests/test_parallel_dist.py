"""Covers: dtensor/parallel/ (parallelize_module, the column/row-wise styles,
embeddings, PrepareModule*, plans and their errors) on 2- and 4-rank Gloo
worlds: every parallelized module computes what the single-device module
computes, forward and backward, with the collectives the style promises and no
others. SequenceParallel: test_parallel_sequence_dist.py; loss_parallel:
test_parallel_loss_dist.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dtensor import DeviceMesh, DTensor, Replicate, Shard
from dtensor.debug import CommCounter
from dtensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PlanError,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    UnsupportedModuleError,
    parallelize_module,
)

TOL = {"atol": 1e-5, "rtol": 1e-5}
WORLDS = pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.world_size(n), id=f"w{n}") for n in (2, 4)]
)


def _grad(p) -> torch.Tensor:
    g = p.grad
    return g.full_tensor() if isinstance(g, DTensor) else g


class MLP(nn.Module):
    def __init__(self, d=8, h=12):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


# Column- then row-parallel -----------------------------------------------------
@WORLDS
def test_colwise_rowwise_mlp_matches_single_device(line_mesh, world, n) -> None:
    torch.manual_seed(0)
    ref = MLP()
    model = parallelize_module(copy.deepcopy(ref), line_mesh(n),
                               {"up": ColwiseParallel(), "down": RowwiseParallel()})
    assert model.up.weight.placements == (Shard(0),) and model.up.bias.placements == (Shard(0),)
    assert model.down.weight.placements == (Shard(1),)
    assert model.down.bias.placements == (Replicate(),)
    x = torch.randn(5, 8)
    with CommCounter() as c:
        out = model(x)
    assert c.counts == {"all_reduce": 1}  # the row-parallel output, nothing else
    assert not isinstance(out, DTensor)  # use_local_output=True
    torch.testing.assert_close(out, ref(x), **TOL)
    out.sum().backward()
    ref(x).sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(_grad(p), q.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.world_size(2)
def test_output_layouts_and_dtensor_outputs(line_mesh, world) -> None:
    torch.manual_seed(1)
    ref = MLP()
    mesh = line_mesh(2)
    model = parallelize_module(copy.deepcopy(ref), mesh, {
        "up": ColwiseParallel(output_layouts=Replicate(), use_local_output=False),
        "down": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0),
                                use_local_output=False),
    })
    h = model.up(torch.randn(4, 8))
    assert isinstance(h, DTensor) and h.placements == (Replicate(),)
    x = torch.randn(4, 8)
    out = model(x)
    assert isinstance(out, DTensor) and out.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), ref(x), **TOL)


@pytest.mark.world_size(2)
def test_colwise_input_layouts_shard_gathers_the_input(line_mesh, world) -> None:
    torch.manual_seed(2)
    ref = nn.Linear(8, 6)
    mesh = line_mesh(2)
    model = parallelize_module(copy.deepcopy(ref), mesh, ColwiseParallel(input_layouts=Shard(0)))
    x = torch.randn(4, 8)
    local_rows = x.chunk(2)[world.rank]
    with CommCounter() as c:
        out = model(local_rows)  # this rank's rows; gathered to Replicate first
    assert c.counts == {"all_gather": 1}
    torch.testing.assert_close(out, ref(x).chunk(2, dim=1)[world.rank], **TOL)


# Embeddings ---------------------------------------------------------------------
@WORLDS
@pytest.mark.parametrize("vocab", [8, 7])  # 7: uneven rows (4 ranks: 2, 2, 2, 1)
def test_rowwise_embedding_is_vocab_parallel(line_mesh, world, n, vocab) -> None:
    torch.manual_seed(3)
    ref = nn.Embedding(vocab, 6, padding_idx=vocab - 1)
    mesh = line_mesh(n)
    model = parallelize_module(copy.deepcopy(ref), mesh, RowwiseParallel(input_layouts=Replicate()))
    assert model.weight.placements == (Shard(0),)
    ids = torch.randint(0, vocab, (3, 5))
    ids[0, 0] = vocab - 1
    with CommCounter() as c:
        out = model(ids)
    assert c.counts == {"all_reduce": 1}  # the partial rows summed; the table never moves
    torch.testing.assert_close(out, ref(ids), **TOL)
    w = torch.randn(3, 5, 6)
    (out * w).sum().backward()
    (ref(ids) * w).sum().backward()
    assert model.weight.grad.placements == (Shard(0),)
    torch.testing.assert_close(model.weight.grad.full_tensor(), ref.weight.grad, **TOL)


@pytest.mark.world_size(2)
def test_rowwise_embedding_reduce_scatters_to_sequence_shards(line_mesh, world) -> None:
    torch.manual_seed(4)
    ref = nn.Embedding(10, 4)
    model = parallelize_module(copy.deepcopy(ref), line_mesh(2),
                               RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))
    ids = torch.randint(0, 10, (2, 6))
    torch.testing.assert_close(model(ids), ref(ids).chunk(2, dim=1)[world.rank], **TOL)


@pytest.mark.world_size(2)
def test_colwise_embedding_shards_the_embedding_dim(line_mesh, world) -> None:
    torch.manual_seed(5)
    ref = nn.Embedding(10, 6)
    model = parallelize_module(copy.deepcopy(ref), line_mesh(2), ColwiseParallel())
    assert model.weight.placements == (Shard(1),)
    ids = torch.randint(0, 10, (2, 3))
    torch.testing.assert_close(model(ids), ref(ids).chunk(2, dim=-1)[world.rank], **TOL)


# PrepareModuleInput / Output ----------------------------------------------------
class Two(nn.Module):
    def forward(self, a, b, *, c=None):
        self.seen = (a, b, c)
        return a, b


@pytest.mark.world_size(2)
def test_prepare_module_input_positional_and_keyword(line_mesh, world) -> None:
    mesh = line_mesh(2)
    m = parallelize_module(Two(), mesh, PrepareModuleInput(
        input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None),
        input_kwarg_layouts={"c": Shard(1)}, desired_input_kwarg_layouts={"c": Replicate()}))
    a, b, c = torch.randn(2, 3), torch.randn(5), torch.randn(4, 2)
    m(a, b, c=c)
    sa, sb, sc = m.seen
    assert isinstance(sa, DTensor) and sa.placements == (Replicate(),)
    assert sa.shape == (4, 3) and sb is b
    assert isinstance(sc, DTensor) and sc.shape == (4, 4)
    with pytest.raises(PlanError, match="expected 2 positional inputs"):
        m(a)


@pytest.mark.world_size(2)
def test_prepare_module_output_and_input_output(line_mesh, world) -> None:
    mesh = line_mesh(2)
    m = parallelize_module(Two(), mesh, PrepareModuleOutput(
        output_layouts=(Replicate(), None), desired_output_layouts=(Shard(0), None)))
    a, b = torch.arange(8.0).reshape(4, 2), torch.ones(1)
    oa, ob = m(a, b)
    torch.testing.assert_close(oa, a.chunk(2)[world.rank])  # use_local_output=True
    assert ob is b
    m2 = parallelize_module(nn.Identity(), mesh, PrepareModuleInputOutput(
        input_layouts=Shard(0), desired_input_layouts=Replicate(), use_local_input=True,
        output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False))
    x = torch.arange(12.0).reshape(2, 6) + world.rank
    out = m2(x)  # gathered rows (a plain tensor inside), then taken as replicated, cut by cols
    full = torch.cat([torch.arange(12.0).reshape(2, 6), torch.arange(12.0).reshape(2, 6) + 1])
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)
    torch.testing.assert_close(out.full_tensor(), full)


def test_prepare_module_bad_arguments() -> None:
    with pytest.raises(PlanError, match="as many desired layouts"):
        PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(),))
    with pytest.raises(PlanError, match="same keywords"):
        PrepareModuleInput(input_kwarg_layouts={"a": Shard(0)}, desired_input_kwarg_layouts={})
    with pytest.raises(PlanError, match="expected a Placement"):
        PrepareModuleOutput(output_layouts="S(0)", desired_output_layouts=Replicate())
    with pytest.raises(PlanError, match="expected a Placement"):
        ColwiseParallel(input_layouts=[Shard(0)])
    with pytest.raises(PlanError, match="sequence_dim"):
        SequenceParallel(sequence_dim="1")


# Plans: paths, wildcards, errors --------------------------------------------------
class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MLP(), MLP()])
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.world_size(2)
def test_wildcard_plan_matches_single_device(line_mesh, world) -> None:
    torch.manual_seed(8)
    ref = Stack()
    model = parallelize_module(copy.deepcopy(ref), line_mesh(2), {
        "layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel(),
    })
    assert all(model.layers[i].up.weight.placements == (Shard(0),) for i in range(2))
    assert isinstance(model.head.weight, nn.Parameter) and not isinstance(model.head.weight, DTensor)
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), ref(x), **TOL)


@pytest.mark.world_size(2)
def test_src_data_rank_none_keeps_local_values(line_mesh, world) -> None:
    mesh = line_mesh(2)
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        lin.weight.fill_(float(world.rank))
    parallelize_module(lin, mesh, ColwiseParallel(), src_data_rank=None)
    assert torch.all(lin.weight.to_local() == world.rank)
    lin2 = nn.Linear(4, 4)
    with torch.no_grad():
        lin2.weight.fill_(float(world.rank))
    parallelize_module(lin2, mesh, ColwiseParallel())  # default: rank 0's values
    assert torch.all(lin2.weight.to_local() == 0)


@pytest.mark.world_size(2)
def test_plan_errors_raise_on_every_rank_before_any_communication(
    line_mesh, world
) -> None:
    mesh = line_mesh(2)
    model = Stack()
    with CommCounter() as c, pytest.raises(PlanError, match=r"'layers.\*.nope'.*children: \['down', 'up'\]"):
        parallelize_module(model, mesh, {"layers.*.up": ColwiseParallel(),
                                         "layers.*.nope": RowwiseParallel()})
    assert c.total == 0 and not isinstance(model.layers[0].up.weight, DTensor)
    with pytest.raises(UnsupportedModuleError, match=r"expected nn\.Linear or nn\.Embedding, got MLP") as e:
        parallelize_module(model, mesh, {"layers.0": ColwiseParallel()})
    assert isinstance(e.value, ValueError) and isinstance(e.value, NotImplementedError)
    with pytest.raises(UnsupportedModuleError, match="RowwiseParallel"):
        parallelize_module(nn.LayerNorm(4), mesh, RowwiseParallel())
    with pytest.raises(UnsupportedModuleError, match="max_norm"):
        parallelize_module(nn.Embedding(4, 4, max_norm=1.0), mesh, RowwiseParallel())
    with pytest.raises(PlanError, match="expected a ParallelStyle or a dict"):
        parallelize_module(model, mesh, [ColwiseParallel()])
    with pytest.raises(PlanError, match="must map a module path"):
        parallelize_module(model, mesh, {"head": "colwise"})
    with pytest.raises(PlanError, match="expected a 1-D mesh"):
        parallelize_module(model, DeviceMesh("cpu", [[0], [1]]), {"head": ColwiseParallel()})
    with pytest.warns(UserWarning, match="no parallelize_plan"):
        assert parallelize_module(model, mesh) is model


@pytest.mark.world_size(2)
def test_current_mesh_and_custom_style(line_mesh, world) -> None:
    mesh = line_mesh(2)

    class Double(ParallelStyle):
        def _apply(self, module, device_mesh):
            module.register_forward_hook(lambda m, i, o: o * device_mesh.size())
            return module

    lin = nn.Linear(2, 2)
    with mesh:
        parallelize_module(lin, parallelize_plan={"": Double()})
    x = torch.randn(1, 2)
    torch.testing.assert_close(lin(x), 2 * F.linear(x, lin.weight, lin.bias))


@WORLDS
def test_parallelize_module_sends_the_source_values_in_one_broadcast(
    line_mesh, world, n
) -> None:
    """Setup cost: the plan's parameters travel in one broadcast per dtype,
    not one per parameter, and every rank ends up with rank 0's values."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MLP()
            self.norm = nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(self.mlp(x))

    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(world.rank)  # every rank but 0 holds other values
    plan = {"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(),
            "norm": SequenceParallel(sequence_dim=0)}
    with CommCounter() as c:
        parallelize_module(model, line_mesh(n), plan)
    assert c.counts == {"broadcast": 1}, c.counts
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert isinstance(p, DTensor), name
        torch.testing.assert_close(p.full_tensor(), q.detach(), **TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
