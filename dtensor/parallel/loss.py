"""``loss_parallel``: cross-entropy on class-sharded logits, never gathering them.

Inside ``with loss_parallel():`` a call of ``F.cross_entropy`` (or
``nn.CrossEntropyLoss``) whose input is a DTensor sharded on the class dim
computes the loss from each rank's block of classes: one all-reduce (max) for
a stable log-sum-exp, one (sum) for the sum of exponentials and the target
logit. The backward, ``softmax - one_hot``, is computed from the saved local
blocks with no communication. The loss is a replicated DTensor.

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
    groups = tuple(mesh.axis_group(a) for a in axes if mesh.shape[a] > 1)
    local = input.to_local()  # [N, c, *rest] or [c]; its gradient stays class-sharded
    rows = local.movedim(cdim, -1).reshape(-1, local.shape[cdim])  # [R, c]
    flat_t = target.reshape(-1).to(rows.device)
    per_row = _ShardedCrossEntropy.apply(
        rows, flat_t, offset[cdim], groups, ignore_index, float(label_smoothing),
        input.shape[cdim],
    )  # [R]; ignored rows are 0
    if reduction == "none":
        loss = per_row.reshape(want)
    elif reduction == "sum":
        loss = per_row.sum()
    else:
        loss = per_row.sum() / (flat_t != ignore_index).sum()
    return DTensor.from_local(loss, mesh, [Replicate()] * mesh.ndim)


def _all_reduce(t: torch.Tensor, op: str, groups: tuple) -> torch.Tensor:
    for g in groups:
        t = _comm.all_reduce(t, op, g)
    return t


class _ShardedCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of class-sharded rows: two all-reduces in forward
    (max, then sums); the backward ``softmax - smoothed one_hot`` is local."""

    @staticmethod
    def forward(ctx, x, target, start, groups, ignore_index, eps, classes):
        width = x.shape[1]
        valid = target != ignore_index
        mine = valid & (target >= start) & (target < start + width)
        idx = torch.where(mine, target - start, torch.zeros_like(target))
        if width:
            row_max = x.detach().amax(1)
            picked = x.gather(1, idx.unsqueeze(1)).squeeze(1) * mine
        else:  # a rank holding no classes (uneven shards)
            row_max = x.new_full(x.shape[:1], float("-inf"))
            picked = x.new_zeros(x.shape[:1])
        row_max = _all_reduce(row_max, "max", groups)  # [R]
        # The sum of logits only matters with label smoothing: without it the
        # second all-reduce moves two rows, the least a sharded softmax needs.
        rows = [(x - row_max.unsqueeze(1)).exp().sum(1), picked]
        if eps:
            rows.append(x.sum(1))
        sums = _all_reduce(torch.stack(rows), "sum", groups)  # [2 or 3, R]
        logz = row_max + sums[0].log()
        loss = logz - sums[1]
        if eps:
            loss = (1 - eps) * loss + eps * (logz - sums[2] / classes)
        ctx.save_for_backward(x, logz, idx, mine, valid)
        ctx.eps, ctx.classes = eps, classes
        return loss * valid

    @staticmethod
    def backward(ctx, grad):
        x, logz, idx, mine, valid = ctx.saved_tensors
        g = x.sub(logz.unsqueeze(1)).exp()  # softmax, this rank's classes: [R, c]
        if x.shape[1]:
            g.scatter_add_(1, idx.unsqueeze(1), -(1 - ctx.eps) * mine.to(g.dtype).unsqueeze(1))
        if ctx.eps:
            g = g - ctx.eps / ctx.classes
        g = g * (grad * valid).unsqueeze(1)
        return g, None, None, None, None, None, None
