"""Covers: dtensor/experimental.py (local_map, register_sharding) on Gloo worlds."""

from __future__ import annotations

import pytest
import torch

from dtensor import (
    DeviceMesh,
    DTensor,
    PlacementError,
    Replicate,
    Shard,
    UnsupportedOpError,
    distribute_tensor,
)
from dtensor.debug import CommCounter
from dtensor.experimental import local_map, register_sharding


@torch.library.custom_op("dtensor_c2::row_normalize", mutates_args=())
def row_normalize(x: torch.Tensor) -> torch.Tensor:
    """Each row divided by its sum: right on row blocks, wrong on column blocks."""
    return x / x.sum(dim=1, keepdim=True)


@row_normalize.register_fake
def _(x):
    return torch.empty_like(x)


@register_sharding(torch.ops.dtensor_c2.row_normalize.default)
def _row_normalize_strategies(x):
    assert x.ndim == 2 and len(x.placements) >= 1  # gets specs, as in torch
    return [([Shard(0)], [Shard(0)]), ([Replicate()], [Replicate()])]


def _full() -> torch.Tensor:
    return torch.arange(1.0, 43.0).reshape(7, 6)  # uneven over 2 and 4 ranks


def _even() -> torch.Tensor:
    # local_map infers global shapes assuming even blocks (as PyTorch's does).
    return torch.arange(1.0, 49.0).reshape(8, 6)


@pytest.mark.world_size(2)
def test_local_map_runs_on_blocks_without_communication(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    x = distribute_tensor(_even(), mesh, [Shard(0)]).requires_grad_()
    row_sq = local_map(
        lambda t, k: ((t * t).sum(1) * k, "note"),
        out_placements=([Shard(0)], None),
        in_placements=([Shard(0)], None),
    )
    with CommCounter() as c:
        y, note = row_sq(x, 2.0)
    assert c.total == 0 and note == "note"
    assert isinstance(y, DTensor) and y.placements == (Shard(0),)
    assert torch.equal(y.full_tensor(), (_even() ** 2).sum(1) * 2)
    y.sum().backward()
    assert torch.equal(x.grad.full_tensor(), 4 * _even())


@pytest.mark.world_size(2)
def test_local_map_checks_or_redistributes_inputs(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    x = distribute_tensor(_even(), mesh, [Shard(1)])

    @local_map(out_placements=[Shard(0)], in_placements=([Shard(0)],))
    def rowsum(t):
        return t.sum(1)

    with pytest.raises(ValueError, match=r"expected \(Shard\(dim=0\),\)"):
        rowsum(x)
    fixed = local_map(rowsum.__wrapped__, [Shard(0)], ([Shard(0)],), redistribute_inputs=True)
    assert torch.equal(fixed(x).full_tensor(), _even().sum(1))
    with pytest.raises(PlacementError, match="1 entries but the call has 2"):
        rowsum(x, x)
    with pytest.raises(PlacementError, match="2 outputs but 1 out_placements"):
        local_map(lambda t: (t, t), [Shard(0)])(x)
    with pytest.raises(PlacementError, match="already a DTensor"):
        local_map(lambda t: x, [Shard(0)])(x)
    # No DTensor argument: plain in, plain out.
    assert torch.equal(rowsum(torch.ones(2, 3)), torch.full((2,), 3.0))


@pytest.mark.world_size(2)
def test_register_sharding_keeps_row_blocks_local(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    want = row_normalize(_full())
    x = distribute_tensor(_full(), mesh, [Shard(0)])
    with CommCounter() as c:
        y = row_normalize(x)
    assert c.total == 0 and y.placements == (Shard(0),)
    assert torch.allclose(y.full_tensor(), want)
    # Column blocks must move first (the op is wrong on them).
    z = row_normalize(distribute_tensor(_full(), mesh, [Shard(1)]))
    assert torch.allclose(z.full_tensor(), want)


@pytest.mark.world_size(4)
def test_register_sharding_applies_per_mesh_axis(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    x = distribute_tensor(_full(), mesh, [Shard(0), Replicate()])
    with CommCounter() as c:
        y = row_normalize(x)
    assert c.total == 0 and y.placements == (Shard(0), Replicate())
    assert torch.allclose(y.full_tensor(), row_normalize(_full()))


@pytest.mark.world_size(2)
def test_register_sharding_bad_input_is_a_clear_error(world) -> None:
    with pytest.raises(UnsupportedOpError, match="expected an op overload"):
        register_sharding("not an op")

    @torch.library.custom_op("dtensor_c2::bad_strategy", mutates_args=())
    def bad(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    bad.register_fake(lambda x: torch.empty_like(x))

    @register_sharding(torch.ops.dtensor_c2.bad_strategy.default)
    def _bad_strategies(x):
        return [([Shard(0)], [None])]

    mesh = DeviceMesh("cpu", [0, 1])
    with pytest.raises(PlacementError, match="has placement None"):
        bad(distribute_tensor(torch.ones(4), mesh, [Shard(0)]))
