"""Covers: dtensor/tensor.py (ways in and out, autograd, bad input) on Gloo worlds."""

from __future__ import annotations

import pytest
import torch

from dtensor import (
    DeviceMesh,
    DTensor,
    MeshError,
    Partial,
    PlacementError,
    Replicate,
    Shard,
    ShardingError,
    distribute_tensor,
)


@pytest.mark.world_size(2)
def test_from_local_infers_even_shape_and_takes_given_uneven_shape(
    line_mesh, world
) -> None:
    mesh = line_mesh(2)
    x = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
    assert x.shape == (4, 3) and x.placements == (Shard(0),)
    rows = 3 if world.rank == 0 else 2
    y = DTensor.from_local(torch.ones(rows, 3), mesh, [Shard(0)], shape=(5, 3), run_check=True)
    assert torch.equal(y.full_tensor(), torch.ones(5, 3))


@pytest.mark.world_size(2)
def test_from_local_run_check_fails_on_every_rank(line_mesh, world) -> None:
    mesh = line_mesh(2)
    rows = 3  # right on rank 0; rank 1 should hold 2 of 5 rows: one bad rank
    with pytest.raises(PlacementError, match=r"expected \(2, 3\)|does not fit"):
        DTensor.from_local(torch.ones(rows, 3), mesh, [Shard(0)], shape=(5, 3), run_check=True)


@pytest.mark.world_size(2)
def test_bad_input_raises_clear_value_errors(line_mesh, world) -> None:
    mesh = line_mesh(2)
    t = torch.ones(4, 4)
    with pytest.raises(PlacementError, match="expected 1 \\(one per mesh axis\\), got 2"):
        distribute_tensor(t, mesh, [Shard(0), Shard(1)])
    with pytest.raises(PlacementError, match=r"valid shard dims are -2\.\.1"):
        distribute_tensor(t, mesh, [Shard(2)])
    with pytest.raises(ShardingError, match=r"expected a torch\.Tensor, got list"):
        distribute_tensor([1, 2], mesh, [Shard(0)])
    with pytest.raises(MeshError, match="no device_mesh given"):
        distribute_tensor(t, None, [Shard(0)])
    a = distribute_tensor(t, mesh, [Shard(0)])
    b = distribute_tensor(t, DeviceMesh("cpu", [1, 0]), [Shard(0)])
    with pytest.raises(MeshError, match="different meshes"):
        a + b
    with pytest.raises(ShardingError, match=r"plain torch\.Tensor of shape \(4, 4\)"):
        a + t
    for err in (PlacementError, MeshError, ShardingError):
        assert issubclass(err, RuntimeError) and not issubclass(err, TypeError)


@pytest.mark.world_size(2)
def test_current_mesh_is_the_default_and_nests(line_mesh, world) -> None:
    outer, inner = line_mesh(2), DeviceMesh("cpu", [1, 0])
    with outer:
        assert distribute_tensor(torch.ones(2)).device_mesh is outer
        with pytest.raises(RuntimeError, match="boom"), inner:
            assert distribute_tensor(torch.ones(2)).device_mesh is inner
            raise RuntimeError("boom")
        assert distribute_tensor(torch.ones(2)).device_mesh is outer


@pytest.mark.world_size(2)
def test_gradients_through_distribute_redistribute_to_local(line_mesh, world) -> None:
    mesh = line_mesh(2)
    torch.manual_seed(0)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64)
    d = distribute_tensor(x * 1, mesh, [Shard(0)])  # non-leaf: differentiable
    y = d.redistribute(mesh, [Shard(1)]).redistribute(mesh, [Replicate()])
    (y.to_local() * w).sum().backward()
    assert torch.allclose(x.grad, w)


@pytest.mark.world_size(2)
def test_leaf_distribute_gives_a_leaf_with_sharded_grad(line_mesh, world) -> None:
    mesh = line_mesh(2)
    torch.manual_seed(0)
    full = torch.randn(5, 3, dtype=torch.float64)
    w = distribute_tensor(full.clone().requires_grad_(), mesh, [Shard(0)])
    assert w.is_leaf and w.requires_grad
    (w.full_tensor() * 3).sum().backward()
    assert isinstance(w.grad, DTensor) and w.grad.placements == (Shard(0),)
    assert torch.allclose(w.grad.full_tensor(), torch.full_like(full, 3.0))


@pytest.mark.world_size(2)
def test_partial_from_local_gets_the_full_gradient(line_mesh, world) -> None:
    mesh = line_mesh(2)
    piece = torch.full((4,), float(world.rank + 1), requires_grad=True)
    dt = DTensor.from_local(piece, mesh, [Partial()])
    w = torch.arange(4.0)
    total = dt.full_tensor()
    assert torch.equal(total, torch.full((4,), 3.0))
    (total * w).sum().backward()
    assert torch.equal(piece.grad, w)  # d(sum of pieces)/d(piece) = 1


@pytest.mark.world_size(2)
def test_partial_avg_gradient_is_scaled(line_mesh, world) -> None:
    mesh = line_mesh(2)
    piece = torch.full((3,), float(world.rank), requires_grad=True)
    dt = DTensor.from_local(piece, mesh, [Partial("avg")])
    dt.full_tensor().sum().backward()
    assert torch.equal(piece.grad, torch.full((3,), 0.5))


@pytest.mark.world_size(2)
def test_grad_placements_partial_sums_per_rank_gradients(line_mesh, world) -> None:
    mesh = line_mesh(2)
    x = distribute_tensor(torch.ones(3, requires_grad=True), mesh, [Replicate()])
    local = x.to_local(grad_placements=[Partial()])
    weight = torch.full((3,), float(world.rank + 1))
    (local * weight).sum().backward()
    assert x.grad.placements == (Partial(),)
    # Loss summed over ranks: 1*x + 2*x, so the gradient is 3.
    assert torch.equal(x.grad.full_tensor(), torch.full((3,), 3.0))


@pytest.mark.world_size(2)
def test_ops_on_dtensors_backpropagate_like_single_device(line_mesh, world) -> None:
    mesh = line_mesh(2)
    torch.manual_seed(1)
    a_full = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b_full = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    a = distribute_tensor(a_full.detach().clone().requires_grad_(), mesh, [Shard(0)])
    b = distribute_tensor(b_full.detach().clone().requires_grad_(), mesh, [Replicate()])
    loss = (torch.mm(a, b).relu() * 2).sum()
    loss.backward()
    ref = (torch.mm(a_full, b_full).relu() * 2).sum()
    ref.backward()
    assert torch.allclose(loss.full_tensor(), ref)
    assert torch.allclose(a.grad.full_tensor(), a_full.grad)
    assert torch.allclose(b.grad.full_tensor(), b_full.grad)


@pytest.mark.world_size(2)
def test_repr_shows_local_and_spec(line_mesh, world) -> None:
    x = distribute_tensor(torch.zeros(4, 2), line_mesh(2), [Shard(0)])
    text = repr(x)
    assert "local_tensor=" in text and "f32[4,2](S(0))" in text


@pytest.mark.world_size(2)
def test_tensor_flatten_round_trips(line_mesh, world) -> None:
    x = distribute_tensor(torch.arange(8.0).reshape(4, 2), line_mesh(2), [Shard(0)])
    names, ctx = x.__tensor_flatten__()
    y = DTensor.__tensor_unflatten__(
        {n: getattr(x, n) for n in names}, ctx, x.shape, x.stride()
    )
    assert y._spec is x._spec and torch.equal(y.to_local(), x.to_local())
