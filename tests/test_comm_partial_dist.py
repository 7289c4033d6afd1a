"""Covers: the collectives of ops on ``Partial`` operands and of their
gradients, against PyTorch's DTensor counts (dtensor/rules/pointwise.py
partial operands, dtensor/rules/norms.py ``vector_norm`` pieces,
dtensor/rules/tensor_ops.py ``new_empty_strided`` of a partial template,
dtensor/_tensor_grad.py ``grad_placements``, dtensor/redistribute.py one
all-reduce over several partial axes): each case counts collectives with
``CommDebugMode`` and compares the full value with the single-device value.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommDebugMode
from dtensor.parallel import RowwiseParallel, parallelize_module

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _pieces(shape, mesh: DeviceMesh, kind: str = "sum", seed: int = 0):
    """A ``Partial(kind)`` DTensor from rank-dependent pieces, and its global value."""
    g = torch.Generator().manual_seed(seed)
    pieces = [torch.randn(shape, generator=g) for _ in range(mesh.size())]
    me = mesh.get_coordinate()[0]
    want = {"sum": sum, "max": lambda ps: torch.stack(ps).amax(0),
            "min": lambda ps: torch.stack(ps).amin(0)}[kind](pieces)
    return DTensor.from_local(pieces[me], mesh, [Partial(kind)], run_check=False), want


def _counts(comm: CommDebugMode) -> dict[str, int]:
    keys = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
    return {k: comm.get_comm_counts()[k] for k in keys if comm.get_comm_counts()[k]}


@pytest.mark.world_size(4)
def test_partial_sum_plus_replicate_stays_partial_without_communication(
    line_mesh, world
) -> None:
    mesh = line_mesh(4)
    a, want_a = _pieces((6, 5), mesh)
    b = torch.randn(5, generator=torch.Generator().manual_seed(3))
    rb = distribute_tensor(b, mesh, [Replicate()])
    for op, want in ((torch.add, want_a + b), (torch.sub, want_a - b)):
        with CommDebugMode() as comm:
            out = op(a, rb)
        assert _counts(comm) == {}, (op, _counts(comm))  # PyTorch: 0, result Partial
        assert out.placements == (Partial(),)
        torch.testing.assert_close(out.full_tensor(), want, **TOL)
    with CommDebugMode() as comm:
        out = torch.sub(rb, a)  # replicated minuend: its piece sits on one rank
    assert _counts(comm) == {} and out.placements == (Partial(),)
    torch.testing.assert_close(out.full_tensor(), b - want_a, **TOL)


@pytest.mark.world_size(4)
def test_partial_times_partial_reduces_one_operand(line_mesh, world) -> None:
    mesh = line_mesh(4)
    a, want_a = _pieces((6, 5), mesh, seed=1)
    b, want_b = _pieces((6, 5), mesh, seed=2)
    with CommDebugMode() as comm:
        out = a * b
    assert _counts(comm) == {"all_reduce": 1}, _counts(comm)  # PyTorch: 1
    assert out.placements == (Partial(),)
    torch.testing.assert_close(out.full_tensor(), want_a * want_b, **TOL)


@pytest.mark.world_size(4)
def test_maximum_keeps_a_partial_max_and_reduces_the_other(line_mesh, world) -> None:
    mesh = line_mesh(4)
    a, want_a = _pieces((6, 5), mesh, "max", seed=4)
    b, want_b = _pieces((6, 5), mesh, "sum", seed=5)
    with CommDebugMode() as comm:
        out = torch.maximum(a, b)
    assert _counts(comm) == {"all_reduce": 1}, _counts(comm)
    assert out.placements == (Partial("max"),)
    torch.testing.assert_close(out.full_tensor(), torch.maximum(want_a, want_b), **TOL)
    c, want_c = _pieces((6, 5), mesh, "min", seed=6)
    rb = distribute_tensor(want_b, mesh, [Replicate()])
    with CommDebugMode() as comm:
        out = torch.minimum(c, rb)
    assert _counts(comm) == {} and out.placements == (Partial("min"),)
    torch.testing.assert_close(out.full_tensor(), torch.minimum(want_c, want_b), **TOL)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("ord", [math.inf, 0.0, 1.0, 2.0, 3.0], ids=str)
@pytest.mark.parametrize("rows", [12, 5, 2], ids=["even", "uneven", "empty-shards"])
def test_vector_norm_of_a_sharded_dim_is_partial_without_communication(
    line_mesh, world, ord, rows
) -> None:
    mesh = line_mesh(4)
    x = torch.randn(rows, 3, generator=torch.Generator().manual_seed(rows))
    d = distribute_tensor(x, mesh, [Shard(0)])
    for dim in (None, 0):
        with CommDebugMode() as comm:
            n = torch.linalg.vector_norm(d, ord, dim=dim)
        assert _counts(comm) == {}, (dim, _counts(comm))  # PyTorch: Partial, 0
        assert n.placements[0].is_partial(), n.placements
        torch.testing.assert_close(n.full_tensor(), torch.linalg.vector_norm(x, ord, dim=dim),
                                   **TOL)


@pytest.mark.world_size(4)
def test_gradient_of_a_partial_stays_partial(line_mesh, world) -> None:
    mesh = line_mesh(4)
    p = distribute_tensor(torch.ones(12, 3, requires_grad=True), mesh, [Partial()])
    r = p.redistribute(mesh, [Partial()])
    with CommDebugMode() as comm:
        r.backward(DTensor.from_local(torch.ones(12, 3), mesh, [Partial()]))
    assert _counts(comm) == {}, _counts(comm)  # PyTorch: no collective
    assert p.grad.placements == (Partial(),)
    assert torch.equal(p.grad.to_local(), torch.ones(12, 3))
    torch.testing.assert_close(p.grad.full_tensor(), torch.full((12, 3), 4.0))


@pytest.mark.world_size(4)
def test_rowwise_shard0_output_backward_gathers_once(line_mesh, world) -> None:
    mesh = line_mesh(4)
    torch.manual_seed(0)
    ref = nn.Linear(8, 6)
    mod = parallelize_module(nn.Linear(8, 6), mesh, RowwiseParallel(output_layouts=Shard(0)))
    with torch.no_grad():
        mod.weight.copy_(distribute_tensor(ref.weight.detach(), mesh, [Shard(1)]))
        mod.bias.copy_(distribute_tensor(ref.bias.detach(), mesh, [Replicate()]))
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    me = mesh.get_coordinate()[0]
    xl = x.chunk(4, 1)[me].clone().requires_grad_()
    y = mod(xl)
    with CommDebugMode() as comm:
        y.sum().backward()
    assert _counts(comm) == {"all_gather": 1}, _counts(comm)  # PyTorch: 1
    xr = x.clone().requires_grad_()
    ref(xr).sum().backward()
    torch.testing.assert_close(mod.weight.grad.full_tensor(), ref.weight.grad, **TOL)
    torch.testing.assert_close(mod.bias.grad.full_tensor(), ref.bias.grad, **TOL)
    torch.testing.assert_close(xl.grad, xr.grad.chunk(4, 1)[me], **TOL)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("kind", ["sum", "avg", "max"])
def test_partial_on_two_axes_reduces_in_one_all_reduce(world, kind) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("a", "b"))
    g = torch.Generator().manual_seed(7)
    pieces = [torch.randn(4, 4, generator=g) for _ in range(4)]
    flat = mesh.get_coordinate()[0] * 2 + mesh.get_coordinate()[1]
    x = DTensor.from_local(pieces[flat], mesh, [Partial(kind), Partial(kind)], run_check=False)
    stacked = torch.stack(pieces)
    want = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.amax(0)}[kind]
    with CommDebugMode() as comm:
        r = x.redistribute(mesh, [Replicate(), Replicate()])
    assert _counts(comm) == {"all_reduce": 1}, _counts(comm)  # PyTorch, flattened: 1
    torch.testing.assert_close(r.to_local(), want, **TOL)


@pytest.mark.world_size(8)
def test_partial_on_three_flattened_axes_reduces_in_one_all_reduce(world) -> None:
    mesh = DeviceMesh("cpu", torch.arange(8).reshape(2, 2, 2), mesh_dim_names=("a", "b", "c"))
    mesh["a", "b", "c"].flatten("abc")
    g = torch.Generator().manual_seed(8)
    pieces = [torch.randn(5, 3, generator=g) for _ in range(8)]
    x = DTensor.from_local(pieces[mesh.get_rank()], mesh, [Partial()] * 3, run_check=False)
    with CommDebugMode() as comm:
        r = x.redistribute(mesh, [Replicate()] * 3)
    assert _counts(comm) == {"all_reduce": 1}, _counts(comm)
    torch.testing.assert_close(r.to_local(), sum(pieces), **TOL)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["sum", "max", "min"])
def test_lazy_neg_view_of_pieces(world, kind) -> None:
    # neg of a max's pieces is not the pieces of -max: those are reduced first;
    # pieces of a sum stay pieces
    mesh = DeviceMesh("cpu", [0, 1])
    x, want = _pieces((4, 3), mesh, kind, seed=7)
    y = torch.ops.aten._neg_view(x)
    torch.testing.assert_close(y.full_tensor(), -want, **TOL)
    assert (y.placements[0] == Partial("sum")) == (kind == "sum")
