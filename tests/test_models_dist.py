"""Covers: dtensor/rules/ end to end: a 2-layer MLP and a transformer block
(attention + MLP, column- then row-parallel linears) trained for a few SGD
steps with DTensor parameters on 2 and 4 ranks; losses and gradients equal
the single-device run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dtensor import Replicate, Shard, distribute_tensor

LR = 0.1
STEPS = 3


def _train(params: dict, forward, batches, dist_grad=lambda g: g):
    """SGD steps; returns the losses and the gradients of every step."""
    losses, grads = [], []
    for batch in batches:
        loss = forward(params, *batch)
        loss.backward()
        losses.append(float(dist_grad(loss.detach())))
        grads.append({k: dist_grad(p.grad.detach()).clone() for k, p in params.items()})
        with torch.no_grad():
            for p in params.values():
                p.sub_(LR * p.grad)
                p.grad = None
    return losses, grads


def _compare(mesh, init: dict, layout: dict, forward, batches, batch_layout) -> None:
    ref_params = {k: v.clone().requires_grad_() for k, v in init.items()}
    ref_losses, ref_grads = _train(ref_params, forward, batches)
    params = {
        k: distribute_tensor(v.clone(), mesh, layout.get(k, [Replicate()])).requires_grad_()
        for k, v in init.items()
    }
    dbatches = [
        tuple(distribute_tensor(t, mesh, pl) for t, pl in zip(b, batch_layout, strict=True))
        for b in batches
    ]
    losses, grads = _train(params, forward, dbatches, lambda g: g.full_tensor())
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for step, (got, want) in enumerate(zip(grads, ref_grads, strict=True)):
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-4,
                                       msg=lambda m, k=k, step=step: f"grad {k} step {step}: {m}")
    for k in init:  # parameters after training, in their own layout
        assert params[k].placements == tuple(layout.get(k, [Replicate()]))


# MLP ------------------------------------------------------------------------------
def _mlp(p, x, y):
    h = torch.relu(F.linear(x, p["w1"], p["b1"]))
    return F.cross_entropy(F.linear(h, p["w2"], p["b2"]), y)


def _mlp_init():
    g = torch.Generator().manual_seed(0)
    init = {
        "w1": torch.randn(16, 8, generator=g) * 0.3, "b1": torch.randn(16, generator=g) * 0.1,
        "w2": torch.randn(5, 16, generator=g) * 0.3, "b2": torch.randn(5, generator=g) * 0.1,
    }
    batches = [(torch.randn(6, 8, generator=g), torch.randint(0, 5, (6,), generator=g))
               for _ in range(STEPS)]
    return init, batches


TENSOR_PARALLEL = {"w1": [Shard(0)], "b1": [Shard(0)], "w2": [Shard(1)]}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("style", ["tensor_parallel", "data_parallel", "mixed"])
def test_mlp_trains_like_single_device_on_2_ranks(line_mesh, world, style) -> None:
    init, batches = _mlp_init()
    if style == "tensor_parallel":
        layout, batch_layout = TENSOR_PARALLEL, ([Replicate()], [Replicate()])
    elif style == "data_parallel":
        layout, batch_layout = {}, ([Shard(0)], [Shard(0)])
    else:  # sharded batch and sharded weights at once
        layout, batch_layout = TENSOR_PARALLEL, ([Shard(0)], [Shard(0)])
    _compare(line_mesh(2), init, layout, _mlp, batches, batch_layout)


@pytest.mark.world_size(4)
def test_mlp_trains_like_single_device_on_4_ranks(line_mesh, world) -> None:
    init, batches = _mlp_init()
    _compare(line_mesh(4), init, TENSOR_PARALLEL, _mlp, batches, ([Replicate()], [Replicate()]))


# Transformer block -----------------------------------------------------------------
D, H, T, B, V = 8, 4, 5, 2, 7


def _block(p, x, y):
    """Pre-norm attention + MLP; q/k/v/fc1 column-parallel, o/fc2 row-parallel."""
    hd = D // H
    h = F.layer_norm(x, (D,), p["ln1_w"], p["ln1_b"])

    def heads(t):  # [B, T, D] -> [B, H, T, hd]
        return t.view(B, T, H, hd).transpose(1, 2)

    q, k, v = (heads(F.linear(h, p[n])) for n in ("wq", "wk", "wv"))
    scores = q @ k.transpose(-2, -1) / math.sqrt(hd)               # [B, H, T, T]
    scores = scores.masked_fill(p["mask"], float("-inf"))
    att = scores.softmax(-1) @ v                                    # [B, H, T, hd]
    att = att.transpose(1, 2).reshape(B, T, D)
    x = x + F.linear(att, p["wo"], p["bo"])
    h = F.layer_norm(x, (D,), p["ln2_w"], p["ln2_b"])
    x = x + F.linear(F.gelu(F.linear(h, p["fc1"], p["fc1_b"])), p["fc2"], p["fc2_b"])
    logits = F.linear(x, p["head"])                                 # [B, T, V]
    return F.cross_entropy(logits.view(B * T, V), y.view(B * T))


def _block_init():
    g = torch.Generator().manual_seed(1)

    def r(*s, scale=0.3):
        return torch.randn(*s, generator=g) * scale

    init = {
        "ln1_w": 1 + r(D, scale=0.1), "ln1_b": r(D, scale=0.1),
        "wq": r(D, D), "wk": r(D, D), "wv": r(D, D), "wo": r(D, D), "bo": r(D, scale=0.1),
        "ln2_w": 1 + r(D, scale=0.1), "ln2_b": r(D, scale=0.1),
        "fc1": r(4 * D, D), "fc1_b": r(4 * D, scale=0.1), "fc2": r(D, 4 * D),
        "fc2_b": r(D, scale=0.1), "head": r(V, D),
    }
    batches = [(r(B, T, D, scale=1.0), torch.randint(0, V, (B, T), generator=g))
               for _ in range(STEPS)]
    return init, batches


BLOCK_TP = {
    "wq": [Shard(0)], "wk": [Shard(0)], "wv": [Shard(0)], "wo": [Shard(1)],
    "fc1": [Shard(0)], "fc1_b": [Shard(0)], "fc2": [Shard(1)],
}




def _run_block(mesh, batch_layout) -> None:
    init, batches = _block_init()
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    dmask = distribute_tensor(mask, mesh, [Replicate()])

    def forward(p, x, y):
        from dtensor import DTensor

        return _block({**p, "mask": dmask if isinstance(x, DTensor) else mask}, x, y)

    _compare(mesh, init, BLOCK_TP, forward, batches, batch_layout)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("batch", ["replicated", "sharded"])
def test_transformer_block_trains_like_single_device_on_2_ranks(
    line_mesh, world, batch
) -> None:
    layout = [Replicate()] if batch == "replicated" else [Shard(0)]
    _run_block(line_mesh(2), (layout, layout))


@pytest.mark.world_size(4)
def test_transformer_block_trains_like_single_device_on_4_ranks(
    line_mesh, world
) -> None:
    _run_block(line_mesh(4), ([Replicate()], [Replicate()]))


@pytest.mark.world_size(2)
def test_tensor_parallel_mlp_forward_communicates_once(line_mesh, world) -> None:
    """Column- then row-parallel: the only collective is the final all-reduce."""
    from dtensor.debug import CommCounter

    mesh = line_mesh(2)
    init, batches = _mlp_init()
    p = {k: distribute_tensor(v, mesh, TENSOR_PARALLEL.get(k, [Replicate()]))
         for k, v in init.items()}
    x = distribute_tensor(batches[0][0], mesh, [Replicate()])
    with CommCounter() as c:
        h = torch.relu(F.linear(x, p["w1"], p["b1"]))
        out = F.linear(h, p["w2"], p["b2"])
    assert c.total == 0 and h.placements == (Shard(1),)
    assert out.placements[0].is_partial()
    with CommCounter() as c:
        out.full_tensor()
    assert c.counts == {"all_reduce": 1}
