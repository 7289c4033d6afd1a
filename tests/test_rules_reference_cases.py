"""Covers: dtensor/rules/ against the distributed tests: every registered op
is run by the distributed op table, the model tests or the optimizer, clipping
and norm tests (exact overloads, recorded on plain tensors in one process)."""

from __future__ import annotations

import importlib.util
import pathlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dtensor.rules import RULES
from dtensor.sharding import overloads_of
from dtensor.testing.op_table import TABLE


class _Record(TorchDispatchMode):
    """Records every aten overload that reaches the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func)
        return func(*args, **(kwargs or {}))


def _optimizer_clip_and_norm_calls() -> None:
    """What tests/test_optim_dist.py (SGD/Adam/AdamW steps, foreach and fused;
    clip_grad_norm_ with norm types 2, 1, inf; clip_grad_value_;
    get_total_norm), tests/test_norms_dist.py (vector norms, Tensor.norm,
    torch.norm with dim) and tests/test_norm_partial_dist.py (torch.dist) run
    on DTensors, here on plain tensors."""
    import math

    from torch import nn

    def params():
        ps = [torch.randn(4, 3, requires_grad=True), torch.randn(5, requires_grad=True)]
        sum((p * p).sum() for p in ps).backward()
        return ps

    makers = (
        lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, **kw),
        lambda ps, **kw: torch.optim.Adam(ps, lr=0.05, **kw),
        lambda ps, **kw: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, **kw),
        lambda ps, **kw: torch.optim.AdamW(ps, lr=0.05, amsgrad=True, **kw),
    )
    for kw in ({"foreach": True}, {"fused": True}):
        for make in makers:
            ps = params()
            opt = make(ps, **kw)
            opt.step()
            opt.step()
    for norm_type in (2.0, 1.0, math.inf):
        ps = params()
        nn.utils.clip_grad_norm_(ps, 0.01, norm_type=norm_type, foreach=True)
    nn.utils.clip_grad_value_(ps, 0.1, foreach=True)
    nn.utils.get_total_norm([p.grad for p in ps])
    x = torch.randn(6, 4)
    torch.linalg.vector_norm(x, 2, (0,), False)
    x.norm(1)
    torch.norm(x, dim=1)
    torch.dist(x, torch.randn(6, 4), 3.0)
    # tests/test_comm_audit_fixes_dist.py: the triplet loss's norm(dim=), take,
    # narrow_copy, rsub, adaptive_avg_pool3d
    nn.functional.triplet_margin_loss(x, torch.randn(6, 4), torch.randn(6, 4))
    torch.take(x, torch.tensor([0, 5]))
    torch.narrow_copy(x, 1, 1, 2)
    torch.rsub(x, x)
    nn.functional.adaptive_avg_pool3d(torch.randn(2, 3, 2, 4, 4), 2)
    # tests/test_comm_audit_misc_dist.py: isin (a tensor or a scalar test
    # set), linalg.cross, repeat, bucketize, searchsorted
    torch.isin(x, torch.tensor([1.0, 2.0]))
    torch.isin(x, 2.0)
    torch.linalg.cross(torch.randn(4, 3), torch.randn(4, 3))
    x.repeat(2, 1)
    torch.bucketize(x, torch.tensor([-1.0, 0.0, 1.0]), right=True)
    torch.bucketize(0.1, torch.tensor([-1.0, 0.0, 1.0]))
    torch.searchsorted(torch.tensor([[-1.0, 0.0, 1.0]]), torch.randn(1, 2))
    torch.searchsorted(torch.tensor([-1.0, 0.0, 1.0]), 0.1, side="right")
    # tests/test_loss_rules_nd_dist.py: N-d cross entropy (nll_loss2d) and the
    # element-wise losses, forward and backward
    logits = torch.randn(3, 4, 5, 2, requires_grad=True)
    nn.functional.cross_entropy(logits, torch.randint(0, 4, (3, 5, 2))).backward()
    a, b = torch.randn(5, 3, requires_grad=True), torch.randn(5, 3)
    for loss in (nn.functional.mse_loss, nn.functional.smooth_l1_loss,
                 nn.functional.huber_loss, nn.functional.soft_margin_loss):
        loss(a, b).backward()
    # tests/test_comm_audit_scatter_dist.py: scatter (a tensor or a scalar
    # source), scatter_add, select/slice_scatter, index_put (and x[i] = v),
    # index_add, index_copy, index_fill (a scalar or a 0-d tensor value)
    i = torch.tensor([2, 0])
    torch.scatter(x, 0, i.expand(4, 2).T, x[:2])
    torch.scatter(x, 0, i.expand(4, 2).T, 2.0)
    torch.scatter_add(x, 0, i.expand(4, 2).T, x[:2])
    torch.select_scatter(x, x[0], 0, 1)
    torch.slice_scatter(x, x[:2], 0, 0, 2)
    torch.index_put(x, (i,), x[:2])
    x.clone()[i] = 1.0
    torch.index_add(x, 0, i, x[:2])
    torch.index_copy(x, 0, i, x[:2])
    torch.index_fill(x, 1, i, 2.0)
    torch.index_fill(x, 1, i, torch.tensor(2.0))
    # tests/test_comm_audit_norm_dist.py: batch norm (training and eval, and
    # its aten forms), group norm, max_unpool1d/2d/3d, embedding
    xb, stats = torch.randn(4, 5, 3), [torch.zeros(5), torch.ones(5)]
    nn.functional.batch_norm(xb, *stats, torch.ones(5), torch.zeros(5), training=True)
    nn.functional.batch_norm(xb, *stats, training=False)
    torch.ops.aten._native_batch_norm_legit(xb, None, None, *stats, True, 0.1, 1e-5)
    torch.ops.aten._native_batch_norm_legit_no_training(xb, None, None, *stats, 0.1, 1e-5)
    torch.ops.aten._batch_norm_with_update(xb, None, None, *stats, 0.1, 1e-5)
    torch.ops.aten.native_group_norm(xb, None, None, 4, 5, 3, 5, 1e-5)
    for pool, unpool, shape in ((nn.functional.max_pool1d, nn.functional.max_unpool1d, (2, 4, 6)),
                                (nn.functional.max_pool2d, nn.functional.max_unpool2d,
                                 (2, 4, 4, 6)),
                                (nn.functional.max_pool3d, nn.functional.max_unpool3d,
                                 (2, 4, 2, 4, 4))):
        unpool(*pool(torch.randn(shape), 2, return_indices=True), 2)
    nn.functional.embedding(torch.tensor([1, 3]), torch.randn(10, 5))
    # tests/test_comm_audit_matmul_dist.py: vdot
    torch.vdot(torch.randn(6), torch.randn(6))
    # tests/test_comm_audit_norms_third_dist.py: glu, forward and backward
    nn.functional.glu(torch.randn(4, 6, 3, requires_grad=True), 1).sum().backward()
    # tests/test_comm_audit_linalg_dist.py: batched linear algebra
    spd = torch.eye(3).expand(2, 3, 3) * 2
    torch.linalg.householder_product(torch.randn(2, 5, 5), torch.randn(2, 3))
    torch.cholesky_inverse(spd)
    torch.linalg.matrix_exp(spd)


def _ops_run_by_the_distributed_tests() -> set:
    """Overloads reached by tests/test_ops_dist.py's table rows (forward),
    tests/test_models_dist.py's training steps (forward and backward), and the
    optimizer, clipping and norm tests (``_optimizer_clip_and_norm_calls``),
    run on plain tensors: composite ops decompose alike for plain tensors and
    DTensors."""
    spec_ = importlib.util.spec_from_file_location(
        "_models", pathlib.Path(__file__).with_name("test_models_dist.py"))
    models = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(models)
    rec = _Record()
    with rec:
        for case in TABLE:
            if case.example is not None:
                case.fn(*[torch.randn(*s) for s in case.example])
        mask = torch.triu(torch.ones(models.T, models.T, dtype=torch.bool), 1)
        for make, forward, extra in ((models._mlp_init, models._mlp, {}),
                                     (models._block_init, models._block, {"mask": mask})):
            init, batches = make()
            params = {k: v.clone().requires_grad_() for k, v in init.items()}
            forward({**params, **extra}, *batches[0]).backward()
        _optimizer_clip_and_norm_calls()
    return rec.seen


def test_every_registered_op_has_a_distributed_reference_case() -> None:
    """Each op in the rule table is run by a distributed test that compares
    with the single-device result (exact overloads, no name matching)."""
    seen = _ops_run_by_the_distributed_tests()
    missing = []
    for op in RULES:
        overloads = overloads_of(op)  # a packet: any of its overloads
        if not any(o in seen for o in overloads):
            missing.append(str(op))
    assert not missing, f"registered ops no distributed test runs: {missing}"
