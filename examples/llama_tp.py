"""A torchtitan-style Llama trained with tensor (and data) parallelism on dtensor.

Run it on 4 ranks (2-D: data parallel 2 x tensor parallel 2), 2 ranks (tensor
parallel with sequence parallel) or 1:

    torchrun --nproc_per_node=4 examples/llama_tp.py
    torchrun --nproc_per_node=2 examples/llama_tp.py --dropout 0.1

The model is built on the meta device, parallelized with a
``parallelize_module`` plan, materialised with ``to_empty`` and initialised
with ``init_weights`` (random numbers from dtensor's generator, so every
layout gets the single-device values). It trains with AdamW and
``loss_parallel`` and prints its losses beside a single-device run's.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import dtensor
from dtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, init_device_mesh
from dtensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 64
    hidden_dim: int = 64
    max_seq_len: int = 8
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dropout: float = 0.0


# Model ------------------------------------------------------------------------------
def _normal_(t: torch.Tensor, std: float) -> None:
    """Initialise from dtensor's generator: the same values for every layout."""
    with torch.no_grad():
        if isinstance(t, DTensor):
            t.normal_(0.0, std)  # dtensor's counter-based generator
        else:
            dtensor.random.normal_(t, 0.0, std)  # the same stream on one device


class Dropout(nn.Dropout):
    """``nn.Dropout`` drawing from dtensor's generator on plain tensors too, so a
    single-device run and a sharded run drop the same elements."""

    def forward(self, x):
        if isinstance(x, DTensor):
            return F.dropout(x, self.p, self.training)
        return dtensor.random.dropout(x, self.p, self.training)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)


def precompute_freqs_cis(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len).float(), freqs)  # [T, hd/2]
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(xq, xk, freqs_cis):
    """Rotate pairs of features by position-dependent angles (xq/xk: [B, T, H, hd])."""
    def rot(x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3).type_as(x)

    return rot(xq), rot(xk)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x, freqs_cis):
        bsz, seqlen = x.shape[:2]
        # Under tensor parallelism these are this rank's heads: -1, not n_heads.
        xq = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True
        )  # [B, H, T, hd]
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.attention_dropout = Dropout(args.dropout)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)
        self.ffn_dropout = Dropout(args.dropout)

    def forward(self, x, freqs_cis):
        h = x + self.attention_dropout(self.attention(self.attention_norm(x), freqs_cis))
        return h + self.ffn_dropout(self.feed_forward(self.ffn_norm(h)))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("freqs_cis", self._freqs(), persistent=False)

    def _freqs(self) -> torch.Tensor:
        a = self.args
        return precompute_freqs_cis(a.dim // a.n_heads, a.max_seq_len, a.rope_theta)

    def init_weights(self) -> None:
        """Initialise every parameter (also after ``to_empty`` from the meta device)."""
        self.freqs_cis = self._freqs().to(self.tok_embeddings.weight.device)
        _normal_(self.tok_embeddings.weight, 1.0)
        for layer in self.layers.values():
            for lin in (*layer.attention.children(), *layer.feed_forward.children()):
                _normal_(lin.weight, 0.02)
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        _normal_(self.output.weight, self.args.dim ** -0.5)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


# Parallelism ------------------------------------------------------------------------
def tp_plan(sequence_parallel: bool) -> dict:
    """torchtitan's plan: embedding rowwise (vocab-parallel), attention and MLP
    column- then row-parallel, class-sharded logits for ``loss_parallel``."""
    if not sequence_parallel:
        return {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "layers.*.attention.w[qkv]": ColwiseParallel(),
            "layers.*.attention.wo": RowwiseParallel(),
            "layers.*.feed_forward.w[13]": ColwiseParallel(),
            "layers.*.feed_forward.w2": RowwiseParallel(),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "layers.*.attention.w[qkv]": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.attention_dropout": SequenceParallel(use_local_output=True),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "layers.*.feed_forward.w[13]": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_dropout": SequenceParallel(use_local_output=True),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
    }


def _replicated_io(module, inputs, mesh):
    return (DTensor.from_local(inputs[0], mesh, [Replicate()]), *inputs[1:])


def _local_out(module, out, mesh):
    return out.to_local()


def parallelize(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool) -> Transformer:
    parallelize_module(model, tp_mesh, tp_plan(sequence_parallel))
    if not sequence_parallel:
        # Norms act on replicated activations: replicated DTensor weights, so every
        # parameter is a DTensor and foreach optimizers see one kind of tensor.
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                dtensor.distribute_module(mod, tp_mesh, None, _replicated_io, _local_out)
    return model


def all_reduce_grads(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Average gradients over the data-parallel axis (what DDP/FSDP would do)."""
    if dp_mesh.size() == 1:
        return
    for p in model.parameters():
        g = p.grad
        local = g.to_local() if isinstance(g, DTensor) else g
        avg = DTensor.from_local(local, dp_mesh, [Partial("avg")]).full_tensor()
        p.grad = (DTensor.from_local(avg, g.device_mesh, g.placements, shape=g.shape)
                  if isinstance(g, DTensor) else avg)


def dp_mean(x: torch.Tensor, dp_mesh: DeviceMesh | None) -> torch.Tensor:
    if dp_mesh is None or dp_mesh.size() == 1:
        return x
    return DTensor.from_local(x, dp_mesh, [Partial("avg")] * dp_mesh.ndim).full_tensor()


# Training ---------------------------------------------------------------------------
def batches(args: ModelArgs, steps: int, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, args.vocab_size, (batch, args.max_seq_len + 1), generator=g)
            for _ in range(steps)]


def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def train(model, data, *, lr=1e-2, dp_mesh=None, grad_hook=None, optimizer=None):
    """AdamW steps; returns the loss of every step (averaged over data parallel)."""
    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, foreach=True)
    dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
    dp_size = dp_mesh.size() if dp_mesh is not None else 1
    losses = []
    for tokens in data:
        tokens = tokens.chunk(dp_size)[dp_rank]  # this data-parallel rank's sequences
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        with loss_parallel():
            loss = loss_fn(model(inputs), labels)
            loss.backward()
        if dp_mesh is not None:
            all_reduce_grads(model, dp_mesh)
        if grad_hook is not None:
            grad_hook(model)
        opt.step()
        opt.zero_grad()
        local = loss.full_tensor() if isinstance(loss, DTensor) else loss
        losses.append(float(dp_mean(local.detach(), dp_mesh)))
    return losses


def build_parallel(args: ModelArgs, tp_mesh: DeviceMesh, sequence_parallel: bool) -> Transformer:
    """Meta-device build, parallelize, materialise, initialise (torchtitan's order)."""
    with torch.device("meta"):
        model = Transformer(args)
    parallelize(model, tp_mesh, sequence_parallel)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def build_reference(args: ModelArgs) -> Transformer:
    model = Transformer(args)
    model.init_weights()
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--no-sequence-parallel", action="store_true")
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = 2 if world % 4 == 0 else 1
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    args = ModelArgs(dropout=a.dropout if dp == 1 else 0.0)
    data = batches(args, a.steps, batch=2)
    dtensor.random.manual_seed(0)
    ref = build_reference(args)
    ref_losses = train(ref, data)
    dtensor.random.manual_seed(0)
    model = build_parallel(args, tp_mesh, not a.no_sequence_parallel)
    losses = train(model, data, dp_mesh=dp_mesh)
    if mesh.get_rank() == 0:
        print(f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))}, "
              f"dropout {args.dropout}, sequence parallel {not a.no_sequence_parallel}")
        for step, (x, y) in enumerate(zip(losses, ref_losses, strict=True)):
            print(f"step {step:2d}  loss {x:.6f}  single-device {y:.6f}")
    worst = max(abs(x - y) for x, y in zip(losses, ref_losses, strict=True))
    assert worst < 1e-4 and math.isfinite(worst), f"losses differ by {worst}"

if __name__ == "__main__":
    main()
