"""Covers: dtensor/parallel/style.py SequenceParallel on 2-rank Gloo worlds:
norms on sequence shards equal the single-device module forward and backward;
the replicated parameters' gradients are reduced once per backward, together,
through meta init, deepcopy and many modules; dropout masks are the
single-device masks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommCounter, CommDebugMode
from dtensor.parallel import (
    PlanError,
    SequenceParallel,
    parallelize_module,
)

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _grad(p) -> torch.Tensor:
    g = p.grad
    return g.full_tensor() if isinstance(g, DTensor) else g


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
