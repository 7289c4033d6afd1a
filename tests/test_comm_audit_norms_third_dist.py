"""Covers: ``dist`` of operands of different shapes and ``glu`` of an input
cut off its halving dim, cases of the communication audit
(bench/comm_audit.py, sample 2 of each op) where ours sent more than
PyTorch's DTensor, each run with both runtimes on a 2-rank Gloo world as the
audit counts them (the op plus making its result a full tensor). Ours must
send no more wire bytes (for equal bytes, no more collectives) than
PyTorch's and equal the single-device value:

- ``dist`` of broadcasting operands (``(5, 5, 5)`` and ``(5,)``) takes
  ``sub``'s layout: the operand shard that moves the fewest bytes, an
  operand that broadcasts along the cut dim whole, a replicated one sliced;
  each rank's ``dist`` of its blocks is a norm piece (dtensor/rules/norms.py);
- ``glu`` (and its backward) keeps shards of the dims it does not halve
  (dtensor/rules/pointwise.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_comm_audit_fixes_dist import _check_no_more_than_torch, _pieces


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [
    ("S0", "S0"), ("S1", "R"), ("S2", "R"), ("R", "S0"), ("S0", "R"),
    ("S1", "S0"), ("S2", "S0"), ("S2", "Psum"),
])
@pytest.mark.parametrize("p", [2.0, 1.0, float("inf")], ids=str)
def test_dist_of_broadcasting_operands_takes_subs_layout(world, layouts, p) -> None:
    # b's only dim is a's dim 2: "S0" of b cuts the difference along dim 2
    a, b = _pieces((5, 5, 5), 200), _pieces((5,), 201)
    _check_no_more_than_torch(world, lambda x, y: torch.dist(x, y, p),
                              [(layouts[0], a), (layouts[1], b)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("S0", "R"), ("S1", "S1"), ("R", "S1")])
def test_dist_of_a_size_one_dim_broadcast_gathers_the_small_operand(world, layouts) -> None:
    # b's dim 0 has size 1: cut, it is gathered (4 B), not a re-cut
    a, b = _pieces((6, 4), 202), _pieces((1, 4), 203)
    _check_no_more_than_torch(world, lambda x, y: torch.dist(x, y),
                              [(layouts[0], a), (layouts[1], b)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("shape", "dim", "layout"), [
    ((8, 2), 0, "S1"), ((4, 6, 3), 1, "S0"), ((5, 6, 3), 1, "S2"), ((4, 6, 4), -1, "S1"),
])
def test_glu_keeps_shards_off_the_halved_dim(world, shape, dim, layout) -> None:
    _check_no_more_than_torch(world, lambda x: F.glu(x, dim), [(layout, _pieces(shape, 204))])


@pytest.mark.world_size(2)
def test_glu_backward_keeps_the_shard(world) -> None:
    """glu's gradient of an input cut off ``dim`` stays cut, nothing sent."""
    import dtensor
    from dtensor.debug import CommCounter

    mesh = dtensor.DeviceMesh("cpu", [0, 1])
    x = torch.randn(4, 6, 3, generator=torch.Generator().manual_seed(205), requires_grad=True)
    g = torch.randn(4, 3, 3, generator=torch.Generator().manual_seed(206))
    dx = dtensor.distribute_tensor(x.detach(), mesh, [dtensor.Shard(2)]).requires_grad_()
    dg = dtensor.distribute_tensor(g, mesh, [dtensor.Shard(2)])
    with CommCounter() as c:
        F.glu(dx, 1).backward(dg)
    assert c.counts == {} and dx.grad.placements == (dtensor.Shard(2),), c.counts
    F.glu(x, 1).backward(g)
    torch.testing.assert_close(dx.grad.full_tensor(), x.grad)
