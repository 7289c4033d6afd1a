"""Covers: dtensor/parallel/ (parallelize_module, the styles, PrepareModule*,
loss_parallel, plan errors) on 2- and 4-rank Gloo worlds: every parallelized
module computes what the single-device module computes, forward and backward,
with the collectives the style promises and no others."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommCounter, CommDebugMode
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
    loss_parallel,
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


# Sequence parallel --------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm_module", "custom_rms_norm"])
def test_sequence_parallel_norms(line_mesh, world, kind) -> None:
    torch.manual_seed(6)
    ref = {"layer_norm": lambda: nn.LayerNorm(8), "rms_norm_module": lambda: nn.RMSNorm(8),
           "custom_rms_norm": lambda: RMSNorm(8)}[kind]()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    mesh = line_mesh(2)
    model = parallelize_module(copy.deepcopy(ref), mesh, SequenceParallel())
    assert all(p.placements == (Replicate(),) for p in model.parameters())
    x = torch.randn(2, 6, 8)
    with CommCounter() as c:
        out = model(x.chunk(2, dim=1)[world.rank])  # this rank's sequence block
    assert c.total == 0
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)
    torch.testing.assert_close(out.full_tensor(), ref(x), **TOL)
    w = torch.randn(2, 6, 8)
    (out * distribute_tensor(w, mesh, [Shard(1)])).sum().backward()
    (ref(x) * w).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(_grad(p), q.grad, **TOL)


def _seq_block(x, mesh, rank, n=2):
    """This rank's sequence block of ``x`` as a Shard(1) DTensor (no communication)."""
    return DTensor.from_local(x.chunk(n, dim=1)[rank], mesh, [Shard(1)])


@pytest.mark.world_size(2)
def test_sequence_parallel_weight_grads_are_reduced_once_per_backward(
    line_mesh, world
) -> None:
    """A replicated norm weight on sequence shards gets a Partial gradient: it
    is all-reduced once per backward, together with the bias in one buffer,
    so p.grad is Replicate after every micro-batch, micro-batches accumulate
    the right sums, and clipping and AdamW need no collective (left Partial,
    AdamW all-reduced it three times per step)."""
    torch.manual_seed(11)
    ref = nn.LayerNorm(8)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    mesh = line_mesh(2)
    model = parallelize_module(copy.deepcopy(ref), mesh, SequenceParallel())
    funcol = torch.ops.c10d_functional
    for _ in range(3):  # three micro-batches accumulate into one step
        x, w = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
        out = model(x.chunk(2, dim=1)[world.rank])
        with CommDebugMode() as comm:
            (out * _seq_block(w, mesh, world.rank)).sum().backward()
        assert comm.get_comm_counts() == {funcol.all_reduce: 1}  # weight and bias, one buffer
        assert comm.get_comm_bytes() == {funcol.all_reduce: 2 * 8 * 4}
        (ref(x) * w).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert p.grad.placements == (Replicate(),)
            torch.testing.assert_close(p.grad.to_local(), q.grad, **TOL)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.1)
    with CommDebugMode() as comm:
        norm = nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    assert comm.get_total_counts() == 0
    torch.testing.assert_close(norm.full_tensor(), nn.utils.clip_grad_norm_(ref.parameters(), 0.5), **TOL)
    opt_ref.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach().to_local(), q.detach(), **TOL)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad.placements == (Replicate(),) and not p.grad.to_local().any()
               for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.world_size(2)
def test_grad_reduction_survives_meta_init_and_deepcopy(line_mesh, world) -> None:
    """to_empty swaps the tensor under each parameter (its hooks stay behind)
    and deepcopy makes new parameters: the next forward hooks them again."""
    mesh = line_mesh(2)
    with torch.device("meta"):
        model = nn.LayerNorm(8)
    parallelize_module(model, mesh, SequenceParallel())
    model.to_empty(device="cpu")
    model.reset_parameters()  # ones and zeros, as nn.LayerNorm(8) starts
    ref = nn.LayerNorm(8)
    torch.manual_seed(12)
    x, w = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    (ref(x) * w).sum().backward()
    for m in (model, copy.deepcopy(model)):
        out = m(x.chunk(2, dim=1)[world.rank])
        with CommCounter() as c:
            (out * _seq_block(w, mesh, world.rank)).sum().backward()
        assert c.counts == {"all_reduce": 1}
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            assert p.grad.placements == (Replicate(),)
            torch.testing.assert_close(p.grad.to_local(), q.grad, **TOL)


@pytest.mark.world_size(2)
def test_norm_grads_of_many_modules_share_one_all_reduce(line_mesh, world) -> None:
    """Every hooked parameter of one backward is reduced in one flat buffer at
    its end; torch.autograd.grad (no accumulation) hands back the partial
    gradients and leaves p.grad alone; a backward that raised midway does
    not keep the next one from reducing."""
    torch.manual_seed(13)
    ref = nn.Sequential(nn.LayerNorm(8), nn.Tanh(), nn.LayerNorm(8))
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    mesh = line_mesh(2)
    model = parallelize_module(copy.deepcopy(ref), mesh, {"0": SequenceParallel(),
                                                          "2": SequenceParallel()})
    x, w = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    wl = _seq_block(w, mesh, world.rank)

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    # Raises at the very end, after every parameter's hook ran: the callback
    # that would have reduced them never runs.
    xl = x.chunk(2, dim=1)[world.rank].clone().requires_grad_()
    out = model(Boom.apply(xl))
    with pytest.raises(RuntimeError, match="boom"):
        (out * wl).sum().backward()
    assert all(p.grad.placements == (Partial(),) for p in model.parameters())
    model.zero_grad(set_to_none=True)

    out = model(x.chunk(2, dim=1)[world.rank])
    with CommCounter() as c:
        (out * wl).sum().backward()
    assert c.counts == {"all_reduce": 1}
    assert c.bytes == {"all_reduce": 4 * 8 * 4}
    (ref(x) * w).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad.placements == (Replicate(),)
        torch.testing.assert_close(p.grad.to_local(), q.grad, **TOL)

    before = [p.grad for p in model.parameters()]
    out = model(x.chunk(2, dim=1)[world.rank])
    grads = torch.autograd.grad((out * wl).sum(), list(model.parameters()))
    assert all(g.placements == (Partial(),) for g in grads)
    for g, q in zip(grads, ref.parameters(), strict=True):
        torch.testing.assert_close(g.full_tensor(), q.grad, **TOL)
    assert all(p.grad is b for p, b in zip(model.parameters(), before, strict=True))


def test_reduce_partial_grads_names_what_it_needs() -> None:
    from dtensor.parallel.grad_reduce import reduce_partial_grads

    with pytest.raises(PlanError, match=r"expected an nn\.Module.*got Tensor"):
        reduce_partial_grads(torch.ones(2))


@pytest.mark.world_size(2)
def test_sequence_parallel_redistributes_a_dtensor_input(line_mesh, world) -> None:
    ref = nn.LayerNorm(4)
    mesh = line_mesh(2)
    model = parallelize_module(copy.deepcopy(ref), mesh,
                               SequenceParallel(sequence_dim=0, use_local_output=True))
    x = torch.randn(6, 4)
    out = model(distribute_tensor(x, mesh, [Replicate()]))
    torch.testing.assert_close(out, ref(x).chunk(2)[world.rank], **TOL)


@pytest.mark.world_size(2)
def test_sequence_parallel_dropout_mask_is_the_single_device_mask(
    line_mesh, world
) -> None:
    import dtensor

    mesh = line_mesh(2)
    model = parallelize_module(nn.Dropout(0.5), mesh, SequenceParallel())
    x = torch.randn(2, 8, 4)
    dtensor.random.manual_seed(7)
    out = model(x.chunk(2, dim=1)[world.rank]).full_tensor()
    dtensor.random.manual_seed(7)
    want = dtensor.random.dropout(x, 0.5)
    assert torch.equal(out, want)  # bit for bit


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


# loss_parallel --------------------------------------------------------------------
def _logits(n_rows=6, classes=10, seed=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_rows, classes, generator=g), torch.randint(0, classes, (n_rows,), generator=g)


@WORLDS
@pytest.mark.parametrize("classes", [10, 7])
@pytest.mark.parametrize("kw", [{}, {"reduction": "sum"}, {"reduction": "none"},
                                {"ignore_index": 3}, {"label_smoothing": 0.1},
                                {"label_smoothing": 0.2, "ignore_index": 1}])
def test_loss_parallel_matches_cross_entropy_without_gathering(
    line_mesh, world, n, classes, kw
) -> None:
    mesh = line_mesh(n)
    x, y = _logits(classes=classes)
    y[0] = kw.get("ignore_index", y[0])
    ref = x.clone().requires_grad_()
    want = F.cross_entropy(ref, y, **kw)
    dx = distribute_tensor(x.clone(), mesh, [Shard(1)]).requires_grad_()
    with CommDebugMode() as comm, loss_parallel():
        loss = F.cross_entropy(dx, y, **kw)
    # The least a class-sharded softmax needs: each rank's per-row log-sum-exp
    # gathered (N floats from each rank), and the target-logit term summed over
    # ranks: one float for a 'mean'/'sum' loss (label smoothing folds the sum
    # of logits into it), a row of N for 'none'. No max, no gather of logits.
    funcol = torch.ops.c10d_functional
    rows, f32 = x.shape[0], x.element_size()
    assert comm.get_comm_counts() == {funcol.all_gather_into_tensor: 1, funcol.all_reduce: 1}
    per_row = kw.get("reduction") == "none"
    assert comm.get_comm_bytes() == {
        funcol.all_gather_into_tensor: n * rows * f32,
        funcol.all_reduce: (rows if per_row else 1) * f32,
    }
    assert isinstance(loss, DTensor) and loss.placements == (Replicate(),)
    torch.testing.assert_close(loss.full_tensor(), want, **TOL)
    with CommDebugMode() as comm:
        loss.backward(torch.ones_like(loss)) if kw.get("reduction") == "none" else loss.backward()
    want.backward(torch.ones_like(want))
    assert comm.get_total_counts() == 0
    assert dx.grad.placements == (Shard(1),)
    torch.testing.assert_close(dx.grad.full_tensor(), ref.grad, **TOL)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kw", [{}, {"reduction": "none", "label_smoothing": 0.1}])
def test_loss_parallel_over_many_ranks_all_reduces_max_and_sum(
    line_mesh, world, monkeypatch, kw
) -> None:
    """Past GATHER_MAX_RANKS the gather costs more than a max and a sum
    all-reduce of N floats; forced here at 2 ranks (the rule is per group size)."""
    import dtensor.parallel.loss as loss_mod

    monkeypatch.setattr(loss_mod, "GATHER_MAX_RANKS", 1)
    mesh = line_mesh(2)
    x, y = _logits(classes=9)
    x[2, :5] = float("-inf")  # rank 0's whole block
    ref = x.clone().requires_grad_()
    want = F.cross_entropy(ref, y, **kw)
    dx = distribute_tensor(x.clone(), mesh, [Shard(1)]).requires_grad_()
    with CommCounter() as c, loss_parallel():
        loss = F.cross_entropy(dx, y, **kw)
    target_term = x.shape[0] if kw.get("reduction") == "none" else 1
    assert c.counts == {"all_reduce": 3}
    assert c.bytes == {"all_reduce": (2 * x.shape[0] + target_term) * 4}
    torch.testing.assert_close(loss.full_tensor(), want, **TOL)
    loss.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(dx.grad.full_tensor(), ref.grad, **TOL)


@WORLDS
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_parallel_large_and_masked_logits(line_mesh, world, n, reduction) -> None:
    """Logits far beyond exp's range, and a row whose first block of classes
    (one rank's whole shard) is -inf: the local max shift keeps both finite."""
    mesh = line_mesh(n)
    x, y = _logits(classes=12)
    x = x * 1e4
    x[1, :6] = float("-inf")
    y[1] = 8
    ref = x.clone().requires_grad_()
    want = F.cross_entropy(ref, y, reduction=reduction, label_smoothing=0.0)
    dx = distribute_tensor(x.clone(), mesh, [Shard(1)]).requires_grad_()
    with loss_parallel():
        loss = F.cross_entropy(dx, y, reduction=reduction)
    torch.testing.assert_close(loss.full_tensor(), want, **TOL)
    loss.sum().backward() if reduction == "none" else loss.backward()
    want.sum().backward()
    assert torch.isfinite(dx.grad.full_tensor()).all()
    torch.testing.assert_close(dx.grad.full_tensor(), ref.grad, **TOL)


@pytest.mark.world_size(2)
def test_loss_parallel_3d_logits_module_and_dtensor_target(line_mesh, world) -> None:
    mesh = line_mesh(2)
    g = torch.Generator().manual_seed(10)
    x, y = torch.randn(2, 8, 3, generator=g), torch.randint(0, 8, (2, 3), generator=g)
    dx = distribute_tensor(x, mesh, [Shard(1)])
    with loss_parallel():
        loss = nn.CrossEntropyLoss()(dx, distribute_tensor(y, mesh, [Shard(0)]))
    torch.testing.assert_close(loss.full_tensor(), F.cross_entropy(x, y), **TOL)


@pytest.mark.world_size(2)
def test_loss_parallel_bad_inputs(line_mesh, world) -> None:
    mesh = line_mesh(2)
    x, y = _logits()
    with loss_parallel():
        with pytest.raises(PlanError, match="sharded on the class dim 1"):
            F.cross_entropy(distribute_tensor(x, mesh, [Shard(0)]), y)
        dx = distribute_tensor(x, mesh, [Shard(1)])
        with pytest.raises(PlanError, match="weight"):
            F.cross_entropy(dx, y, weight=torch.ones(10))
        with pytest.raises(PlanError, match="integer class targets"):
            F.cross_entropy(dx, torch.rand(6, 10))
        plain = F.cross_entropy(x, y)  # plain tensors pass through
    torch.testing.assert_close(plain, F.cross_entropy(x, y))


@pytest.mark.world_size(2)
def test_loss_parallel_partial_and_replicated_logits_rejected(line_mesh, world) -> None:
    mesh = line_mesh(2)
    x, y = _logits()
    with loss_parallel(), pytest.raises(PlanError, match="Shard"):
        F.cross_entropy(DTensor.from_local(x, mesh, [Partial()]), y)


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
