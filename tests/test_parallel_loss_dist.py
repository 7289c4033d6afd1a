"""Covers: dtensor/parallel/loss.py (loss_parallel) on 2- and 4-rank Gloo
worlds: cross entropy of logits sharded on the class dim equals the
single-device loss and gradient, with the collectives the docs promise
(docs/parallel.md) and no gather of the logits; bad inputs raise PlanError."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommCounter, CommDebugMode
from dtensor.parallel import PlanError, loss_parallel

TOL = {"atol": 1e-5, "rtol": 1e-5}
WORLDS = pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.world_size(n), id=f"w{n}") for n in (2, 4)]
)


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
