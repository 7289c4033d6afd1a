"""``loss_parallel``: cross-entropy on class-sharded logits, never gathering them.

Inside ``with loss_parallel():`` a call of ``F.cross_entropy`` (or
``nn.CrossEntropyLoss``) whose input is a DTensor sharded on the class dim
computes the loss from each rank's block of classes. Each rank takes the
log-sum-exp of its own block per row (stable: its local max first) and one
all-gather of those N floats gives every rank every block's, from which it
computes the global log-sum-exp itself (over more than four ranks a max
and a sum all-reduce of N floats move fewer bytes, and are used). The target logits enter a ``'mean'``
or ``'sum'`` loss only through their sum, so one scalar all-reduce carries
them (with label smoothing, the smoothed sum of logits too);
``reduction='none'`` needs each row's, an all-reduce of N floats. The
backward, ``softmax - one_hot`` from the gathered log-sum-exp, is computed
from the saved local blocks with no communication. The loss is a replicated
DTensor.

Example:
    >>> logits = model(tokens)            # DTensor [B*T, V] placed [Shard(1)]
    >>> with loss_parallel():
    ...     loss = F.cross_entropy(logits, labels)
    ...     loss.backward()
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from dtensor import _comm
from dtensor.parallel.errors import PlanError
from dtensor.placement import Replicate, Shard, format_placements
from dtensor.tensor import DTensor

__all__ = ["loss_parallel"]

_CE_SIGNATURE = inspect.signature(F.cross_entropy)


@contextmanager
def loss_parallel() -> Iterator[None]:
    """Compute ``F.cross_entropy`` on class-sharded DTensor logits without gathering them.

    Supported: class-index targets (a plain tensor holding the full target,
    or a DTensor), ``reduction`` ``'mean'``/``'sum'``/``'none'``,
    ``ignore_index``, ``label_smoothing``. Class ``weight`` and probability
    targets raise ``PlanError``. Other calls pass through unchanged; the
    backward may run inside or outside the block.

    Example:
        >>> with loss_parallel():
        ...     F.cross_entropy(logits, labels).backward()
    """
    with _LossParallelMode():
        yield


class _LossParallelMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            bound = _CE_SIGNATURE.bind(*args, **kwargs)
            bound.apply_defaults()
            if isinstance(bound.arguments["input"], DTensor):
                return sharded_cross_entropy(**bound.arguments)
        return func(*args, **kwargs)


def sharded_cross_entropy(
    input: DTensor,
    target,
    weight=None,
    size_average=None,
    ignore_index: int = -100,
    reduce=None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> DTensor:
    """``F.cross_entropy`` for logits sharded on the class dim (see ``loss_parallel``)."""
    spec = input._spec
    mesh = spec.mesh
    cdim = 1 if input.ndim >= 2 else 0
    axes = [a for a, p in enumerate(spec.placements) if p == Shard(cdim)]
    others_ok = all(p.is_replicate() for a, p in enumerate(spec.placements) if a not in axes)
    if not axes or not others_ok:
        raise PlanError(
            f"loss_parallel: cross_entropy expects logits sharded on the class dim "
            f"{cdim} and replicated on the other mesh axes, got "
            f"{format_placements(spec.placements)} on {mesh} for shape {tuple(input.shape)}. "
            "Lay out the output projection with ColwiseParallel(output_layouts=Shard(-1), "
            "use_local_output=False), or redistribute the logits."
        )
    unsupported = {
        "weight": weight is not None, "size_average": size_average is not None,
        "reduce": reduce is not None,
        "reduction": reduction not in ("mean", "sum", "none"),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise PlanError(
            f"loss_parallel: cross_entropy with {', '.join(bad)} is not supported "
            f"(got weight={'given' if weight is not None else None}, reduction={reduction!r}); "
            "use reduction='mean'/'sum'/'none' without class weights, or leave the "
            "loss_parallel block and gather the logits (full_tensor())."
        )
    if isinstance(target, DTensor):
        target = target.redistribute(target.device_mesh, [Replicate()] * target.device_mesh.ndim).to_local()
    want = tuple(s for d, s in enumerate(input.shape) if d != cdim)
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or tuple(target.shape) != want:
        raise PlanError(
            f"loss_parallel: cross_entropy expects integer class targets of shape {want}, "
            f"got {getattr(target, 'dtype', type(target).__name__)} "
            f"{tuple(getattr(target, 'shape', ()))}. Probability targets are not supported."
        )
    out_shape = want if reduction == "none" else ()
    coord = mesh.get_coordinate()
    if coord is None:  # outside the mesh: nothing to compute, nobody to talk to
        empty = torch.empty(0, dtype=input.dtype, device=input.device)
        return DTensor.from_local(empty, mesh, [Replicate()] * mesh.ndim, shape=out_shape)
    _, offset = spec.local_block(coord)
    groups = tuple((mesh.axis_group(a), mesh.shape[a]) for a in axes if mesh.shape[a] > 1)
    local = input.to_local()  # [N, c, *rest] or [c]; its gradient stays class-sharded
    rows = local.movedim(cdim, -1).reshape(-1, local.shape[cdim])  # [R, c]
    flat_t = target.reshape(-1).to(rows.device)
    summed = reduction != "none"
    out = _ShardedCrossEntropy.apply(
        rows, flat_t, offset[cdim], groups, ignore_index, float(label_smoothing),
        input.shape[cdim], summed,
    )  # the sum over rows, or [R] per row; ignored rows count 0
    if reduction == "none":
        loss = out.reshape(want)
    elif reduction == "sum":
        loss = out
    else:
        loss = out / (flat_t != ignore_index).sum()
    return DTensor.from_local(loss, mesh, [Replicate()] * mesh.ndim)


# Up to this many ranks, gathering every rank's N log-sum-exps ((n-1)*N floats
# received per rank, ring model) moves no more than a max all-reduce then a sum
# all-reduce (2 * 2(n-1)/n * N): equal at 4, and one collective instead of two.
# Beyond it the two all-reduces move less.
GATHER_MAX_RANKS = 4


def _all_reduce(t: torch.Tensor, groups: tuple) -> torch.Tensor:
    for g, _ in groups:
        t = _comm.all_reduce(t, "sum", g)
    return t


def _finite_or_zero(t: torch.Tensor) -> torch.Tensor:
    # A shift of 0 for all -inf rows (fully masked) avoids inf - inf.
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def _global_logsumexp(lse: torch.Tensor, groups: tuple) -> torch.Tensor:
    """The log-sum-exp over every rank's classes, from each rank's per-row one."""
    for g, n in groups:
        if n <= GATHER_MAX_RANKS:
            lse = torch.logsumexp(torch.stack(_comm.all_gather(lse, g)), dim=0)
        else:
            top = _finite_or_zero(_comm.all_reduce(lse, "max", g))
            lse = top + _comm.all_reduce((lse - top).exp(), "sum", g).log()
    return lse


class _ShardedCrossEntropy(torch.autograd.Function):
    """Cross-entropy of class-sharded rows, summed over rows (``summed``) or per
    row. Forward: one all-gather of the local log-sum-exps (over more than
    ``GATHER_MAX_RANKS`` ranks: a max and a sum all-reduce), one all-reduce of
    the target-logit term (a scalar when ``summed``). Backward: local."""

    @staticmethod
    def forward(ctx, x, target, start, groups, ignore_index, eps, classes, summed):
        width = x.shape[1]
        valid = target != ignore_index
        mine = valid & (target >= start) & (target < start + width)
        idx = torch.where(mine, target - start, torch.zeros_like(target))
        if width:
            row_max = _finite_or_zero(x.amax(1))  # all -inf row: log(0) = -inf, right
            lse = row_max + (x - row_max.unsqueeze(1)).exp().sum(1).log()
            picked = torch.where(mine, x.gather(1, idx.unsqueeze(1)).squeeze(1), 0.0)
            # Per row the loss is lse - t with t = (1-eps)*target logit +
            # eps/classes * sum of logits: t is additive over class blocks.
            t = (1 - eps) * picked + (eps / classes) * x.sum(1) if eps else picked
        else:  # a rank holding no classes (uneven shards)
            lse = x.new_full(x.shape[:1], float("-inf"))
            t = x.new_zeros(x.shape[:1])
        lse = _global_logsumexp(lse, groups)  # [R]
        if summed:
            t = _all_reduce(torch.where(valid, t, 0.0).sum().reshape(1), groups)[0]
            loss = torch.where(valid, lse, 0.0).sum() - t
        else:
            t = _all_reduce(t, groups)
            loss = torch.where(valid, lse - t, 0.0)
        ctx.save_for_backward(x, lse, idx, mine, valid)
        ctx.eps, ctx.classes = eps, classes
        return loss

    @staticmethod
    def backward(ctx, grad):
        x, lse, idx, mine, valid = ctx.saved_tensors
        g = x.sub(lse.unsqueeze(1)).exp()  # softmax, this rank's classes: [R, c]
        if x.shape[1]:
            g.scatter_add_(1, idx.unsqueeze(1), -(1 - ctx.eps) * mine.to(g.dtype).unsqueeze(1))
        if ctx.eps:
            g = g - ctx.eps / ctx.classes
        g = g * (grad * valid).unsqueeze(1)  # grad: a scalar when summed, else [R]
        return g, None, None, None, None, None, None, None
