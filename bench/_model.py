"""A tiny Llama-style model and its tensor-parallel plans, for either runtime.

The model follows torchtitan's Llama layout (token embedding, blocks of
RMSNorm -> attention (wq, wk, wv, wo) and RMSNorm -> SwiGLU feed-forward
(w1, w2, w3), final norm, output projection) without rotary embeddings:
rotary is local elementwise work that neither runtime communicates for.

``plan(lib, kind)`` builds the same plan from either runtime's
``parallel`` package (``lib`` is ``dtensor`` or ``torch.distributed.tensor``):

- ``"sp"``: torchtitan's plan — vocabulary-parallel embedding reduce-scattered
  to sequence shards, sequence-parallel norms, attention and feed-forward
  inputs all-gathered once by ``PrepareModuleInput``, colwise wq/wk/wv/w1/w3,
  rowwise wo/w2 reduce-scattered back to sequence shards, colwise output
  kept class-sharded for ``loss_parallel``.
- ``"tp"``: plain Megatron — replicated embedding and norms, colwise/rowwise
  pairs with replicated activations in between (each colwise group takes one
  replicated DTensor input, so its input gradient is reduced once),
  class-sharded output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Config", "Llama", "plan"]


@dataclass(frozen=True)
class Config:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab: int = 128
    hidden: int = 128
    seq: int = 16
    batch: int = 4


class RMSNorm(nn.Module):
    """RMSNorm from elementwise ops and a mean over the last dim (shards fine on S(1))."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x):
        bs, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp heads.
        q = self.wq(x).view(bs, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bs, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bs, seq, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def plan(lib, kind: str = "sp") -> dict:
    """The tensor-parallel plan of ``kind`` built from ``lib.parallel``'s styles."""
    par = lib.parallel
    R, S = lib.Replicate, lib.Shard
    if kind == "tp":
        # One replicated DTensor input per colwise group: wq/wk/wv (and w1/w3)
        # then add their Partial input gradients up as one tensor, reduced
        # once at the group's boundary instead of once per linear.
        share_in = par.PrepareModuleInput(input_layouts=(R(),), desired_input_layouts=(R(),),
                                          use_local_output=False)
        return {
            "layers.*.attention": share_in,
            "layers.*.feed_forward": share_in,
            "layers.*.attention.wq": par.ColwiseParallel(),
            "layers.*.attention.wk": par.ColwiseParallel(),
            "layers.*.attention.wv": par.ColwiseParallel(),
            "layers.*.attention.wo": par.RowwiseParallel(),
            "layers.*.feed_forward.w1": par.ColwiseParallel(),
            "layers.*.feed_forward.w3": par.ColwiseParallel(),
            "layers.*.feed_forward.w2": par.RowwiseParallel(),
            "output": par.ColwiseParallel(output_layouts=S(-1), use_local_output=False),
        }
    if kind != "sp":
        raise ValueError(f"plan kind must be 'sp' or 'tp', got {kind!r}")
    gather_in = par.PrepareModuleInput(input_layouts=(S(1),), desired_input_layouts=(R(),))
    return {
        "tok_embeddings": par.RowwiseParallel(input_layouts=R(), output_layouts=S(1)),
        "norm": par.SequenceParallel(),
        "output": par.ColwiseParallel(
            input_layouts=S(1), output_layouts=S(-1), use_local_output=False
        ),
        "layers.*.attention_norm": par.SequenceParallel(),
        "layers.*.attention": gather_in,
        "layers.*.attention.wq": par.ColwiseParallel(),
        "layers.*.attention.wk": par.ColwiseParallel(),
        "layers.*.attention.wv": par.ColwiseParallel(),
        "layers.*.attention.wo": par.RowwiseParallel(output_layouts=S(1)),
        "layers.*.ffn_norm": par.SequenceParallel(),
        "layers.*.feed_forward": gather_in,
        "layers.*.feed_forward.w1": par.ColwiseParallel(),
        "layers.*.feed_forward.w3": par.ColwiseParallel(),
        "layers.*.feed_forward.w2": par.RowwiseParallel(output_layouts=S(1)),
    }
