"""Covers: dtensor/rules/nn.py's rules for the losses training loops use that
the fallback-bytes audit (docs/fallback_bytes.md) found moving more than
PyTorch's DTensor: N-d ``cross_entropy`` / ``nll_loss`` (``nll_loss2d_forward``
/ ``nll_loss2d_backward``: logits (N, C, d1) or (N, C, d1, d2) sharded on a
batch dim, 20 B vs torch's 4 B) and ``smooth_l1_loss`` / ``huber_loss`` /
``soft_margin_loss`` (24 vs 4 B), with the element-wise losses' backward ops
(``mse_loss_backward`` and the others), which gathered their operands. On
Gloo worlds of 2 and 4 ranks and a 2-D mesh: values and gradients through
autograd equal single device (reductions none/sum/mean, class weights,
ignored targets, uneven and empty shards), and the wire carries exactly the
small all-reduce the loss needs, never the batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtensor import DeviceMesh, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommCounter

WORLDS = pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.world_size(n), id=f"w{n}") for n in (2, 4)]
)
TOL = {"atol": 1e-5, "rtol": 1e-5}
C = 4  # classes


def _close(got, want, where: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (where, got.shape, want.shape)
    torch.testing.assert_close(got, want, equal_nan=True, **TOL,
                               msg=lambda m: f"{where}: {m}")


def _nd_case(shape, seed: int, ignore_index: int = -100):
    """Logits of ``shape`` (N, C, ...), targets with one ignored entry, and
    class weights."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, generator=g)
    target = torch.randint(0, C, (shape[0], *shape[2:]), generator=g)
    if target.numel():
        target.view(-1)[0] = ignore_index  # the mean's divisor depends on the data
    weight = torch.rand(C, generator=g) + 0.5
    return logits, target, weight


def _run_cross_entropy(mesh, logits, target, lp, tp, kw, reduction):
    """Single device and distributed cross_entropy, forward and backward:
    (want, want_grad, loss DTensor, its full value, the logits' DTensor
    gradient, forward bytes, full_tensor bytes, backward bytes)."""
    ref = logits.clone().requires_grad_()
    want = F.cross_entropy(ref, target, reduction=reduction, **kw)
    go = torch.randn(want.shape, generator=torch.Generator().manual_seed(9))
    want.backward(go)
    dl = distribute_tensor(logits, mesh, lp).requires_grad_()
    dt = distribute_tensor(target, mesh, tp)
    dkw = {k: (distribute_tensor(v, mesh, [Replicate()] * mesh.ndim)
               if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    with CommCounter() as fwd:
        loss = F.cross_entropy(dl, dt, reduction=reduction, **dkw)
    with CommCounter() as full:
        got = loss.full_tensor()
    dgo = distribute_tensor(go, mesh, loss.placements if reduction == "none"
                            else [Replicate()] * mesh.ndim)
    with CommCounter() as bwd:
        loss.backward(dgo)
    return want, ref.grad, loss, got, dl.grad, fwd.bytes, full.bytes, bwd


ND_SHAPES = {
    "2d": (5, C),  # nll_loss_forward: the (N, C) rule, its backward too
    # N uneven at 2 and 4 ranks; at 4 ranks 3 leaves an empty shard
    "3d": (5, C, 3),
    "4d": (5, C, 3, 2),
    "3d-empty": (3, C, 2),
    "4d-empty-h": (2, C, 3, 2),
}


@WORLDS
@pytest.mark.parametrize("name", list(ND_SHAPES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nd_cross_entropy_keeps_the_batch_sharded(
    line_mesh, world, n, name, reduction
) -> None:
    shape = ND_SHAPES[name]
    mesh = line_mesh(n)
    logits, target, weight = _nd_case(shape, seed=len(shape) * 10 + shape[0])
    batch_dims = [d for d in range(len(shape)) if d != 1]
    for d in batch_dims:
        td = 0 if d == 0 else d - 1
        for kw in ({}, {"weight": weight}, {"ignore_index": 2}):
            for lp, tp in (([Shard(d)], [Shard(td)]), ([Replicate()], [Shard(td)]),
                           ([Shard(d)], [Replicate()])):
                where = f"cross_entropy {reduction} {name} {lp} {tp} {list(kw)} on {n}"
                # -100 is a class index out of range once ignore_index is 2
                tgt = target.clamp(min=0) if "ignore_index" in kw else target
                want, want_grad, loss, got, grad, fwd, full, bwd = _run_cross_entropy(
                    mesh, logits, tgt, lp, tp, kw, reduction)
                _close(got, want, where)
                _close(grad.full_tensor(), want_grad, where + " grad")
                # the gradient keeps the batch shard, the loss never gathers the batch
                assert grad.placements == (Shard(d),), (where, grad.placements)
                assert bwd.bytes == {}, (where, bwd.bytes)
                if reduction == "mean":
                    # the local sum and weight total in one all-reduce (the
                    # replicate fallback gathered logits and targets)
                    assert fwd == {"all_reduce": 8} and full == {}, (where, fwd, full)
                    assert loss.placements == (Replicate(),)
                elif reduction == "sum":
                    assert fwd == {} and full == {"all_reduce": 4}, (where, fwd, full)
                    assert loss.placements == (Partial(),)
                else:
                    assert fwd == {} and set(full) == {"all_gather"}, (where, fwd, full)
                    assert loss.placements == (Shard(td),), (where, loss.placements)


@WORLDS
def test_nd_nll_loss_all_ignored_and_class_dim_shards(line_mesh, world, n) -> None:
    mesh = line_mesh(n)
    logits, target, weight = _nd_case((5, C, 3, 2), seed=3)
    lsm = logits.log_softmax(1)
    # every target ignored: the global mean is 0/0 = NaN like single device
    ignored = torch.full_like(target, -100)
    dl = distribute_tensor(lsm, mesh, [Shard(2)])
    got = F.nll_loss(dl, distribute_tensor(ignored, mesh, [Shard(1)]))
    _close(got.full_tensor(), F.nll_loss(lsm, ignored), "all ignored")
    # a shard of the class dim is never kept: replicated first, still exact
    for reduction in ("mean", "sum", "none"):
        dl = distribute_tensor(lsm, mesh, [Shard(1)])
        dt = distribute_tensor(target, mesh, [Replicate()])
        dw = distribute_tensor(weight, mesh, [Replicate()])
        got = F.nll_loss(dl, dt, weight=dw, reduction=reduction)
        _close(got.full_tensor(), F.nll_loss(lsm, target, weight=weight,
                                             reduction=reduction), f"S(1) {reduction}")


@pytest.mark.world_size(4)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nd_cross_entropy_on_a_2d_mesh(world, reduction) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    logits, target, weight = _nd_case((3, C, 5, 2), seed=7)
    layouts = (
        ([Shard(0), Shard(2)], [Shard(0), Shard(1)]),  # N and H: 2+1 / 3+2
        ([Shard(2), Shard(3)], [Shard(1), Shard(2)]),  # H and W
        ([Shard(0), Shard(0)], [Shard(0), Shard(0)]),  # N twice: one empty piece
        ([Shard(3), Replicate()], [Replicate(), Shard(1)]),  # one from each operand
    )
    for lp, tp in layouts:
        for kw in ({}, {"weight": weight}):
            where = f"2-D mesh {reduction} {lp} {tp} {list(kw)}"
            want, want_grad, loss, got, grad, fwd, full, bwd = _run_cross_entropy(
                mesh, logits, target, lp, tp, kw, reduction)
            _close(got, want, where)
            _close(grad.full_tensor(), want_grad, where + " grad")
            assert "all_gather" not in fwd and bwd.bytes == {}, (where, fwd, bwd.bytes)
            if reduction == "mean":
                # two elements per sharded mesh axis
                assert fwd == {"all_reduce": 16} and full == {}, (where, fwd, full)


def _elementwise_losses():
    return {
        "mse": lambda a, b, r: F.mse_loss(a, b, reduction=r),
        "smooth_l1": lambda a, b, r: F.smooth_l1_loss(a, b, reduction=r),
        "smooth_l1-beta0.5": lambda a, b, r: F.smooth_l1_loss(a, b, reduction=r, beta=0.5),
        "huber": lambda a, b, r: F.huber_loss(a, b, reduction=r),
        "huber-delta0.3": lambda a, b, r: F.huber_loss(a, b, reduction=r, delta=0.3),
        "soft_margin": lambda a, b, r: F.soft_margin_loss(a, b.sign(), reduction=r),
    }


@WORLDS
@pytest.mark.parametrize("shape", [(5, 3), (3,)], ids=["uneven", "empty-shards"])
@pytest.mark.parametrize("loss_name", list(_elementwise_losses()))
def test_elementwise_losses_and_their_backward_keep_shards(
    line_mesh, world, n, shape, loss_name
) -> None:
    fn = _elementwise_losses()[loss_name]
    g = torch.Generator().manual_seed(11)
    # differences on both sides of beta/delta, so both branches are taken
    x, y = torch.randn(*shape, generator=g) * 2, torch.randn(*shape, generator=g)
    if loss_name == "soft_margin":
        y = y.sign()
    mesh = line_mesh(n)
    for d in range(len(shape)):
        for px, py in (([Shard(d)], [Shard(d)]), ([Shard(d)], [Replicate()]),
                       ([Replicate()], [Shard(d)])):
            for reduction in ("mean", "sum", "none"):
                where = f"{loss_name} {reduction} {px} {py} of {shape} on {n}"
                # soft_margin_loss has no target gradient (torch refuses one)
                wants_ty = loss_name != "soft_margin"
                rx, ry = x.clone().requires_grad_(), y.clone().requires_grad_(wants_ty)
                want = fn(rx, ry, reduction)
                go = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))
                want.backward(go)
                dx = distribute_tensor(x, mesh, px).requires_grad_()
                dy = distribute_tensor(y, mesh, py).requires_grad_(wants_ty)
                with CommCounter() as fwd:
                    loss = fn(dx, dy, reduction)
                with CommCounter() as full:
                    got = loss.full_tensor()
                _close(got, want, where)
                if reduction == "none":
                    assert fwd.bytes == {} and loss.placements == (Shard(d),), where
                    dgo = distribute_tensor(go, mesh, [Shard(d)])
                else:
                    # one float32 all-reduced (the fallback gathered both operands)
                    assert fwd.bytes == {} and full.bytes == {"all_reduce": 4}, (
                        where, fwd.bytes, full.bytes)
                    dgo = distribute_tensor(go, mesh, [Replicate()])
                with CommCounter() as bwd:
                    loss.backward(dgo)
                # gradients are element-wise: nothing moves, both stay sharded
                assert bwd.bytes == {}, (where, bwd.bytes)
                for name, dt, ref in (("input", dx, rx), ("target", dy, ry)):
                    if not wants_ty and name == "target":
                        continue
                    _close(dt.grad.full_tensor(), ref.grad, f"{where} {name} grad")


@pytest.mark.world_size(4)
def test_elementwise_losses_on_a_2d_mesh(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    g = torch.Generator().manual_seed(13)
    x, y = torch.randn(5, 3, generator=g) * 2, torch.randn(5, 3, generator=g)
    for loss_name, fn in _elementwise_losses().items():
        yy = y.sign() if loss_name == "soft_margin" else y
        for px, py in (([Shard(0), Shard(1)], [Shard(0), Shard(1)]),
                       ([Shard(0), Shard(0)], [Replicate(), Replicate()]),
                       ([Replicate(), Shard(1)], [Shard(0), Replicate()])):
            for reduction in ("mean", "sum"):
                where = f"{loss_name} {reduction} {px} {py} on a 2-D mesh"
                rx = x.clone().requires_grad_()
                want = fn(rx, yy, reduction)
                want.backward()
                dx = distribute_tensor(x, mesh, px).requires_grad_()
                dy = distribute_tensor(yy, mesh, py)
                with CommCounter() as c:
                    loss = fn(dx, dy, reduction)
                    got = loss.full_tensor()
                _close(got, want, where)
                assert "all_gather" not in c.bytes, (where, c.bytes)
                with CommCounter() as c:
                    loss.backward()
                assert c.bytes == {}, (where, c.bytes)
                _close(dx.grad.full_tensor(), rx.grad, where + " grad")
