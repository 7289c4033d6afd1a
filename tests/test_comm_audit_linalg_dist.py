"""Covers: linear-algebra cases of the communication audit
(bench/comm_audit.py) where ours sent more than PyTorch's DTensor, each run
with both runtimes on a 2-rank Gloo world as the audit counts them (the op
plus making its result a full tensor). Ours must send no more wire bytes
(for equal bytes, no more collectives) than PyTorch's and equal the
single-device value:

- a product whose output shard would cut a dim shorter than the mesh axis
  counts gathering that output later, so ``matrix_power`` of a cut 1x1
  matrix replicates its factors once instead of gathering every product
  (dtensor/rules/matmul.py);
- batched linear algebra (``householder_product``, ``cholesky_inverse``,
  ``matrix_exp``) keeps a shard of a batch dim (dtensor/rules/linalg.py).

And why ``linalg.pinv`` of ``Partial`` pieces is an accepted difference:
PyTorch reads a partial ``rtol`` tensor piece by piece (each rank its own),
so ranks disagree; ours reduces it first (one 4-byte collective more).
"""

from __future__ import annotations

import pytest
import torch
from test_comm_audit_fixes_dist import _check_no_more_than_torch, _libs, _make, _pieces


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layout", ["S0", "S1"])
@pytest.mark.parametrize("n", [4, 5, 7])
def test_matrix_power_of_a_cut_1x1_matrix_replicates_once(world, layout, n) -> None:
    _check_no_more_than_torch(world, lambda x: torch.linalg.matrix_power(x, n),
                              [(layout, _pieces((1, 1), 120 + n, 1))])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layout", ["S0", "S1"])
def test_householder_product_keeps_batch_shards(world, layout) -> None:
    a, tau = _pieces((4, 2, 5, 5), 130, 1), _pieces((4, 2, 3), 131, 1)
    # both cut alike; then one cut beside a replicated one: a cut matrix
    # stays cut, a cut tau alone is gathered (less than the output later)
    for layouts in ((layout, layout), (layout, "R"), ("R", layout)):
        _check_no_more_than_torch(world, torch.linalg.householder_product,
                                  [(layouts[0], a), (layouts[1], tau)])


def _spd(shape, seed):
    b = _pieces(shape, seed, 1)[0]
    return [b @ b.mT + shape[-1] * torch.eye(shape[-1])]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("fn", [torch.cholesky_inverse, torch.linalg.matrix_exp],
                         ids=["cholesky_inverse", "matrix_exp"])
@pytest.mark.parametrize("layout", ["S0", "S1"])
def test_batched_linalg_keeps_batch_shards(world, fn, layout) -> None:
    # then a sum over each matrix, which keeps the batch shard too: only the
    # small result is gathered, not the input
    _check_no_more_than_torch(world, lambda x: fn(x).sum((-2, -1)),
                              [(layout, _spd((4, 2, 3, 3), 140))])


@pytest.mark.world_size(2)
def test_pinv_of_a_partial_rtol_reduces_it_first(world) -> None:
    """Why ``linalg.pinv`` of ``Partial`` pieces is an accepted difference:
    PyTorch computes with each rank's own piece of ``rtol``."""
    import torch.distributed as dist

    a = _pieces((5, 5), 150, 1)[0]
    rtol = [torch.tensor(0.3), torch.tensor(0.8)]  # Partial(min): 0.3
    want = torch.linalg.pinv(a, rtol=rtol[0])
    right = {}
    for name, (lib, mesh) in _libs(world).items():
        x = _make(lib, mesh, "Pmin", [a, a + 0.5], world.rank)
        r = _make(lib, mesh, "Pmin", rtol, world.rank)
        got = torch.linalg.pinv(x, rtol=r).full_tensor()
        ok = torch.tensor(float(torch.allclose(got, want, atol=1e-5)))
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=world.group)
        right[name] = bool(ok)
    assert right == {"ours": True, "torch": False}, right
