"""Covers: dtensor/dispatch/random_ops.py on Gloo worlds.

The full tensor of every random op equals the plain-tensor reference of
``dtensor.random`` under the same seed, bit for bit, for every mesh and
placements (uneven and empty shards, sub-meshes); replicas agree and shards
are not copies of each other.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import dtensor
from dtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor import random as rng
from dtensor.debug import CommCounter


def _layouts():
    flat = DeviceMesh("cpu", [0, 1, 2, 3])
    grid = DeviceMesh("cpu", [[0, 1], [2, 3]])
    some = DeviceMesh("cpu", [2, 0, 3])  # leaves rank 1 out, odd size
    out = [(flat, (p,)) for p in (Replicate(), Shard(0), Shard(1))]
    out += [(grid, pl) for pl in itertools.product([Replicate(), Shard(0), Shard(1)], repeat=2)]
    out += [(some, (Shard(0),)), (some, (Replicate(),))]
    return out


OPS = {
    "uniform_": (lambda t: t.uniform_(-2.0, 3.0), lambda t: rng.uniform_(t, -2.0, 3.0)),
    "normal_": (lambda t: t.normal_(1.0, 2.0), lambda t: rng.normal_(t, 1.0, 2.0)),
    "exponential_": (lambda t: t.exponential_(0.5), lambda t: rng.exponential_(t, 0.5)),
    "bernoulli_": (lambda t: t.bernoulli_(0.3), None),
    "rand_like": (torch.rand_like, None),
    "randn_like": (torch.randn_like, None),
    "dropout": (lambda t: torch.nn.functional.dropout(t.fill_(1.0), 0.25), None),
}


def _reference(name, shape):
    t = torch.zeros(shape)
    if name == "bernoulli_":
        return rng.bernoulli(torch.full(shape, 0.3))
    if name == "rand_like":
        return rng.rand(*shape)
    if name == "randn_like":
        return rng.randn(*shape)
    if name == "dropout":
        return rng.dropout(torch.ones(shape), 0.25)
    return OPS[name][1](t)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("shape", [(5, 3), (3, 0), (7,), (2, 9)], ids=str)
@pytest.mark.parametrize("name", sorted(OPS))
def test_random_ops_equal_single_device_bit_for_bit(name, shape, world) -> None:
    for mesh, placements in _layouts():
        if any(p.is_shard() and p.dim >= len(shape) for p in placements):
            continue
        dtensor.manual_seed(7)
        x = distribute_tensor(torch.zeros(shape), mesh, placements)
        y = OPS[name][0](x)
        rng.manual_seed(7)
        ref = _reference(name, shape)
        full = y.full_tensor()
        if mesh.get_coordinate() is None:
            assert full.numel() == 0
        else:
            assert torch.equal(full, ref), (name, mesh, placements)
        # Members and outsiders alike advanced the generator once (dropout of
        # an empty tensor draws nothing, as in torch).
        drew = not (name == "dropout" and 0 in shape)
        assert rng.get_rng_state().offset == int(drew)


@pytest.mark.world_size(4)
def test_factories_match_and_replicas_agree_shards_differ(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    for factory, ref in ((dtensor.rand, rng.rand), (dtensor.randn, rng.randn)):
        for placements in ([Shard(0), Replicate()], [Shard(0), Shard(0)], [Replicate(), Shard(1)]):
            dtensor.manual_seed(11)
            x = factory(9, 4, device_mesh=mesh, placements=placements)
            rng.manual_seed(11)
            assert torch.equal(x.full_tensor(), ref(9, 4)), (factory, placements)
    x = dtensor.rand(8, 8, device_mesh=mesh, placements=[Shard(0), Replicate()])
    blocks = [torch.empty(4, 8) for _ in range(4)]
    torch.distributed.all_gather(blocks, x.to_local().contiguous())
    assert torch.equal(blocks[0], blocks[1]) and torch.equal(blocks[2], blocks[3])  # replicas
    assert not torch.equal(blocks[0], blocks[2])  # shards are not copies


@pytest.mark.world_size(4)
def test_consecutive_ops_follow_the_single_device_sequence(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    dtensor.manual_seed(3)
    a = dtensor.rand(6, device_mesh=mesh, placements=[Shard(0)])
    b = dtensor.randn(6, device_mesh=mesh, placements=[Replicate()])
    c = distribute_tensor(torch.zeros(6), mesh, [Shard(0)]).uniform_()
    rng.manual_seed(3)
    assert torch.equal(a.full_tensor(), rng.rand(6))
    assert torch.equal(b.full_tensor(), rng.randn(6))
    assert torch.equal(c.full_tensor(), rng.rand(6))
    assert not torch.equal(a.full_tensor(), c.full_tensor())


@pytest.mark.world_size(4)
def test_outsiders_advance_without_communicating(world) -> None:
    mesh = DeviceMesh("cpu", [0, 2])
    dtensor.manual_seed(5)
    with CommCounter() as c:
        x = dtensor.rand(4, device_mesh=mesh, placements=[Shard(0)])
    assert rng.get_rng_state().offset == 1
    if mesh.get_coordinate() is None:
        assert c.total == 0 and x.to_local().numel() == 0
    # The next op on a world-wide mesh agrees everywhere.
    y = dtensor.rand(4, device_mesh=DeviceMesh("cpu", [0, 1, 2, 3]), placements=[Shard(0)])
    rng.manual_seed(5)
    rng.rand(4)
    assert torch.equal(y.full_tensor(), rng.rand(4))


@pytest.mark.world_size(4)
def test_dropout_backward_uses_the_forward_mask(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    torch.manual_seed(0)
    full = torch.randn(6, 5, dtype=torch.float64)
    x = distribute_tensor(full.clone().requires_grad_(), mesh, [Shard(0), Shard(1)])
    dtensor.manual_seed(2)
    y = torch.nn.Dropout(0.4)(x)
    (y * 3).sum().backward()
    ref_x = full.clone().requires_grad_()
    rng.manual_seed(2)
    (rng.dropout(ref_x, 0.4) * 3).sum().backward()
    assert torch.equal(y.full_tensor(), rng_dropout_again(full, 2, 0.4))
    assert torch.equal(x.grad.full_tensor(), ref_x.grad)


def rng_dropout_again(full, seed, p):
    rng.manual_seed(seed)
    return rng.dropout(full, p)


@pytest.mark.world_size(4)
def test_native_dropout_and_partial_inputs(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    piece = torch.ones(8)
    p = DTensor.from_local(piece, mesh, [Partial()])
    dtensor.manual_seed(9)
    out, mask = torch.ops.aten.native_dropout(p, 0.5, True)
    assert out.placements == (Partial(),)
    assert mask.placements == (Replicate(),)  # a mask is never a partial value
    rng.manual_seed(9)
    ref = rng.dropout(torch.full((8,), 4.0), 0.5)
    assert torch.equal(out.full_tensor(), ref)
    assert torch.equal(mask.full_tensor(), ref != 0)
    assert torch.equal(mask.to_local(), ref != 0)


@pytest.mark.world_size(4)
def test_native_dropout_reduces_max_inputs_and_draws_like_dropout(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    full = torch.arange(10.0) - 4
    x = DTensor.from_local(full - world.rank, mesh, [Partial("max")])  # max is `full`
    dtensor.manual_seed(4)
    out, mask = torch.native_dropout(x, 0.3, True)
    assert out.placements == mask.placements == (Replicate(),)
    rng.manual_seed(4)
    ref = rng.dropout(full, 0.3)
    assert torch.equal(out.to_local(), ref)
    keep = rng.dropout_mask_block(4, 0, (10,), (0,), (10,), p=0.3)
    assert torch.equal(mask.to_local(), keep)
    # No draw (and so no offset) where dropout draws nothing: p == 1, empty, eval.
    y = distribute_tensor(torch.ones(6), mesh, [Shard(0)])
    empty = distribute_tensor(torch.ones(0), mesh, [Shard(0)])
    dtensor.manual_seed(4)
    for args in ((y, 1.0, True), (empty, 0.3, True), (y, 0.3, False), (y, 0.0, True)):
        out, mask = torch.native_dropout(*args)
        assert torch.equal(mask.full_tensor(), torch.full_like(
            args[0].full_tensor(), args[1] < 1, dtype=torch.bool)), args[1:]
    assert rng.get_rng_state().offset == 0


@pytest.mark.world_size(4)
def test_random_from_below_zero_covers_the_int64_range(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    x = distribute_tensor(torch.zeros(5, 7, dtype=torch.int64), mesh, [Shard(1), Shard(0)])
    dtensor.manual_seed(6)
    x.random_(-3, None)  # [-3, 2**63 - 1]: a span above 2**63
    rng.manual_seed(6)
    ref = rng.randint(-3, 2**63, (5, 7))
    assert torch.equal(x.full_tensor(), ref)


@pytest.mark.world_size(4)
def test_inplace_ops_on_partial_avg(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    f = DTensor.from_local(torch.zeros(3, 2), mesh, [Partial("avg"), Shard(1)])
    dtensor.manual_seed(8)
    f.uniform_(-1.0, 1.0)
    rng.manual_seed(8)
    ref = rng.uniform_(torch.zeros(3, 4), -1.0, 1.0)
    assert f.placements == (Partial("avg"), Shard(1))
    cols = 2 * (world.rank % 2)
    assert torch.equal(f.to_local(), ref[:, cols:cols + 2])  # the draw, on every coordinate
    assert torch.equal(f.full_tensor(), ref)  # 2 equal copies: an exact mean
    small = DTensor.from_local(torch.zeros(4, dtype=torch.int32), mesh, [Partial("avg")] * 2)
    small.random_(0, 1000)  # 4 copies of < 1000 fit in int32
    big = DTensor.from_local(torch.zeros(4, dtype=torch.int32), mesh, [Partial("avg")] * 2)
    with pytest.raises(dtensor.ShardingError, match=r"overflows torch\.int32"):
        big.random_()  # 4 copies of up to 2**31 - 1 do not
    assert rng.get_rng_state().offset == 2  # the refused op drew nothing, on every rank
    rng.manual_seed(8)
    rng.rand(1)
    assert torch.equal(small.full_tensor(), rng.randint(0, 1000, (4,), dtype=torch.int32))


@pytest.mark.world_size(4)
def test_manual_seed_on_a_sub_mesh_checks_members_only(world) -> None:
    mesh = DeviceMesh("cpu", [1, 3])
    with CommCounter() as c:
        dtensor.manual_seed(12, device_mesh=mesh)
    assert (c.total == 0) == (mesh.get_coordinate() is None)
    assert rng.get_rng_state() == rng.RNGState(12, 0)


@pytest.mark.world_size(4)
def test_seed_mismatch_is_a_clear_error_everywhere(world) -> None:
    with pytest.raises(dtensor.ShardingError, match="different seeds"):
        dtensor.manual_seed(world.rank)
    dtensor.manual_seed(0)  # agreeing seeds pass
