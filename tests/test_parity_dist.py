"""Covers: the public behaviour PyTorch's own DTensor tests expect:
every ``Partial`` reduce op, ``redistribute(forward_dtype=, backward_dtype=,
async_op=)``, the gradient layout of a redistribute from ``Partial``, and
the constructor warning; dtensor/placement.py, dtensor/spec.py and
dtensor/redistribute.py on real Gloo worlds.

Where we differ from PyTorch on purpose, docs/porting.md says why.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from dtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, ShardingError
from dtensor.debug import CommCounter
from dtensor.errors import PlacementError
from dtensor.spec import DTensorSpec, TensorMeta


def _pieces(world, *per_rank: torch.Tensor) -> torch.Tensor:
    return per_rank[world.rank].clone()


# Partial reduce ops ------------------------------------------------------------
def test_partial_accepts_pytorchs_reduce_op_names() -> None:
    assert Partial("prod") == Partial("product") == Partial("PRODUCT")
    assert hash(Partial("prod")) == hash(Partial("product"))
    assert str(Partial("prod")) == "P(product)"
    for op in ("sum", "avg", "max", "min", "product", "band", "bor", "bxor"):
        assert Partial(op).reduce_op == op
    with pytest.raises(PlacementError, match="expected one of .*got 'median'"):
        Partial("median")


@pytest.mark.world_size(2)
def test_partial_product_reduces_by_product(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    a = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    b = torch.tensor([[2.0, 0.5, -1.0], [3.0, 1.0, 2.0]])
    x = DTensor.from_local(_pieces(world, a, b), mesh, [Partial("prod")])
    assert x.placements == (Partial("product"),)
    with CommCounter() as c:
        r = x.redistribute(mesh, [Replicate()])
    assert c.counts == {"all_reduce": 1}
    assert torch.equal(r.to_local(), a * b)
    s = x.redistribute(mesh, [Shard(0)])  # reduce-scatter with PRODUCT
    assert torch.equal(s.to_local(), (a * b)[world.rank : world.rank + 1])
    assert torch.equal(s.full_tensor(), a * b)


@pytest.mark.world_size(2)
def test_replicate_to_partial_product_holds_ones_elsewhere(world) -> None:
    # PyTorch refuses R -> P(product) (its symmetric split would need an n-th
    # root); ones on the other coordinates are exact and move nothing.
    mesh = DeviceMesh("cpu", [0, 1])
    full = torch.tensor([[-3.0, 0.0], [7.0, 0.25]])
    r = DTensor.from_local(full, mesh, [Replicate()])
    with CommCounter() as c:
        p = r.redistribute(mesh, [Partial("product")])
    assert c.total == 0
    assert torch.equal(p.to_local(), full if world.rank == 0 else torch.ones_like(full))
    assert torch.equal(p.redistribute(mesh, [Replicate()]).to_local(), full)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool], ids=str)
def test_bitwise_partials_reduce_and_round_trip(world, dtype) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    if dtype == torch.bool:
        a = torch.tensor([True, True, False, False])
        b = torch.tensor([True, False, True, False])
    else:
        a = torch.tensor([0b1100, 0b1010, 7, -1], dtype=dtype)
        b = torch.tensor([0b1010, 0b0110, 1, 5], dtype=dtype)
    want = {"band": a & b, "bor": a | b, "bxor": a ^ b}
    for op, expected in want.items():
        x = DTensor.from_local(_pieces(world, a, b), mesh, [Partial(op)])
        got = x.full_tensor()
        assert got.dtype == dtype and torch.equal(got, expected), op
        # ... and back: Replicate -> Partial(op) -> Replicate is exact.
        back = DTensor.from_local(expected, mesh, [Replicate()]).redistribute(
            mesh, [Partial(op)]
        )
        assert torch.equal(back.full_tensor(), expected), op


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    ("op", "dtype", "need"),
    [("band", torch.float32, "integer or bool"), ("bxor", torch.bfloat16, "integer or bool"),
     ("product", torch.complex64, "real dtype")],
)
def test_partial_op_the_dtype_cannot_reduce_is_refused_on_every_rank(world, op, dtype, need) -> None:
    # Raised while building the spec, before any rank communicates: every
    # rank raises the same error and none waits in a collective.
    mesh = DeviceMesh("cpu", [0, 1])
    with pytest.raises(PlacementError, match=f"Partial.*{op}.*needs an? {need}.*got torch"):
        DTensor.from_local(torch.ones(3, dtype=dtype), mesh, [Partial(op)])
    r = DTensor.from_local(torch.ones(3, dtype=dtype), mesh, [Replicate()])
    with pytest.raises(PlacementError, match=f"needs an? {need}"):
        r.redistribute(mesh, [Partial(op)])


@pytest.mark.world_size(4)
@pytest.mark.parametrize("op", ["product", "max"])
def test_partial_axes_with_different_ops_reduce_in_axis_order(world, op) -> None:
    # [P(sum), P(op)] on a 2x2 mesh: axis 0 (sum) reduces first, so the value
    # is op_j sum_i x[i, j]. Reducing only axis 1 would compute
    # sum_i op_j x[i, j] instead (5 rather than 25 for product, 9 rather than
    # 5 for max); the plan reduces axis 0 too and makes it partial again.
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    i, j = mesh.get_coordinate()
    pieces = torch.tensor([[1.0, 5.0], [4.0, 0.0]])  # x[i, j] for a 1-element tensor
    x = DTensor.from_local(pieces[i, j].reshape(1), mesh, [Partial("sum"), Partial(op)])
    col = pieces.sum(0)
    value = (col.prod() if op == "product" else col.max()).reshape(1)
    assert torch.equal(x.full_tensor(), value)
    y = x.redistribute(mesh, [Partial("sum"), Replicate()])
    assert y.placements == (Partial("sum"), Replicate())
    assert torch.equal(y.full_tensor(), value)
    # Replicate -> Partial(op) under an existing partial sum: the pieces at
    # j = 1 must still sum to the identity of op (or repeat the value, max).
    z = DTensor.from_local(pieces[i, 0].reshape(1), mesh, [Partial("sum"), Replicate()])
    zp = z.redistribute(mesh, [Partial("sum"), Partial(op)])
    assert torch.equal(zp.full_tensor(), pieces[:, 0].sum().reshape(1))


# redistribute(forward_dtype=..., backward_dtype=..., async_op=...) -----------------
@pytest.mark.world_size(2)
def test_redistribute_casts_before_moving_and_casts_the_gradient_back(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    torch.manual_seed(0)
    full = torch.randn(6, 4)
    x = DTensor.from_local(full[3 * world.rank : 3 * world.rank + 3], mesh, [Shard(0)])
    x.requires_grad_(True)
    with CommCounter() as fwd:
        y = x.redistribute(mesh, [Replicate()], forward_dtype=torch.bfloat16,
                           backward_dtype=torch.float64, async_op=False)
    assert y.dtype == torch.bfloat16 and y.placements == (Replicate(),)
    assert torch.equal(y.to_local(), full.to(torch.bfloat16))
    assert fwd.bytes == {"all_gather": full.numel() * 2}  # moved in bf16
    # A Partial gradient needs a reduce-scatter on its way back to Shard(0):
    # it runs in backward_dtype and the gradient arrives in x's dtype.
    g = DTensor.from_local(torch.ones(6, 4, dtype=torch.bfloat16), mesh, [Partial()])
    with CommCounter() as bwd:
        y.backward(g)
    assert bwd.counts == {"reduce_scatter": 1}
    assert bwd.bytes["reduce_scatter"] == full.numel() * 8  # float64 on the wire
    assert x.grad.dtype == torch.float32 and x.grad.placements == (Shard(0),)
    assert torch.equal(x.grad.full_tensor(), torch.full((6, 4), 2.0))


@pytest.mark.world_size(2)
def test_redistribute_backward_dtype_alone_and_same_placements(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    x = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)]).requires_grad_(True)
    # Same placements, a new dtype: a cast, no communication.
    with CommCounter() as c:
        h = x.redistribute(mesh, [Shard(0)], forward_dtype=torch.float64)
    assert c.total == 0 and h.dtype == torch.float64 and h.placements == (Shard(0),)
    # backward_dtype only: forward stays float32, the gradient's collective
    # runs in float64 and the gradient comes back float32.
    y = x.redistribute(mesh, [Replicate()], backward_dtype=torch.float64)
    assert y.dtype == torch.float32
    g = DTensor.from_local(torch.ones(4, 3), mesh, [Partial()])
    with CommCounter() as bwd:
        y.backward(g)
    assert bwd.bytes == {"reduce_scatter": 4 * 3 * 8}
    assert x.grad.dtype == torch.float32
    assert torch.equal(x.grad.to_local(), torch.full((2, 3), 2.0))
    with torch.no_grad():
        n = x.redistribute(mesh, [Replicate()], forward_dtype=torch.float16)
    assert n.dtype == torch.float16 and torch.equal(n.to_local(), torch.ones(4, 3).half())


@pytest.mark.world_size(2)
def test_redistribute_refuses_a_dtype_that_is_not_a_dtype_on_every_rank(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    x = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
    with pytest.raises(ShardingError, match="forward_dtype must be a torch.dtype.*'bf16'"):
        x.redistribute(mesh, [Replicate()], forward_dtype="bf16")
    with pytest.raises(ShardingError, match="backward_dtype must be a torch.dtype"):
        x.redistribute(mesh, [Replicate()], backward_dtype=2)
    p = DTensor.from_local(torch.full((2,), 0.5), mesh, [Partial()])
    with pytest.raises(ShardingError, match=r"cannot cast the Partial pieces.*to torch.int64"):
        p.redistribute(mesh, [Replicate()], forward_dtype=torch.int64)


# Gradient layout of a redistribute from Partial -----------------------------------
@pytest.mark.world_size(2)
def test_partial_source_axis_keeps_the_gradients_layout(world) -> None:
    # [P(sum), S(0)] -> [P(sum), R] on a (2, 1) mesh; the gradient arrives as
    # [P(sum), R]. Single-device equivalence holds for any layout of the
    # gradient (it is the gradient of the global value); keeping P(sum) on the
    # partial axis moves 0 bytes, while reducing it to Replicate (what we did
    # before) all-reduced the whole gradient. PyTorch keeps Partial(sum) too.
    mesh = DeviceMesh("cpu", [[0], [1]])
    local = torch.arange(6.0).reshape(3, 2) * (world.rank + 1)
    x = DTensor.from_local(local, mesh, [Partial(), Shard(0)]).requires_grad_(True)
    y = x.redistribute(mesh, [Partial(), Replicate()])
    g = DTensor.from_local(torch.full((3, 2), float(world.rank + 1)), mesh, [Partial(), Replicate()])
    with CommCounter() as c:
        y.backward(g)
    assert c.total == 0
    assert x.grad.placements == (Partial(), Shard(0))
    assert torch.equal(x.grad.full_tensor(), torch.full((3, 2), 3.0))


@pytest.mark.world_size(2)
def test_gradient_of_a_partial_piece_is_still_reduced_in_from_local(world) -> None:
    # from_local's backward hands each rank the gradient of its own piece: that
    # needs the reduced value, so that one all-reduce stays.
    mesh = DeviceMesh("cpu", [0, 1])
    local = torch.ones(2, requires_grad=True)
    x = DTensor.from_local(local, mesh, [Partial()])
    g = DTensor.from_local(torch.ones(2), mesh, [Partial()])
    x.backward(g)
    assert torch.equal(local.grad, torch.full((2,), 2.0))
    xp = DTensor.from_local(torch.ones(2, requires_grad=True), mesh, [Partial("product")])
    with pytest.raises(ShardingError, match="backward through Partial\\('product'\\)"):
        xp.backward(DTensor.from_local(torch.ones(2), mesh, [Replicate()]))


# The constructor ------------------------------------------------------------------
@pytest.mark.world_size(2)
def test_constructor_warns_when_it_cuts_the_local_graph(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    local = torch.randn(3, 3, requires_grad=True)
    spec = DTensorSpec(mesh, (Shard(0),), TensorMeta((6, 3), (3, 1), torch.float32))
    with pytest.warns(UserWarning, match="To construct DTensor from torch.Tensor"):
        DTensor(local, spec, requires_grad=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert DTensor(local, spec, requires_grad=True).shape == (6, 3)
        assert DTensor(local.detach(), spec).requires_grad is False
        # from_local of a requires-grad block records the graph: no warning.
        assert DTensor.from_local(local, mesh, [Shard(0)]).requires_grad


# Factories and random ops writing a Partial layout -------------------------------
@pytest.mark.world_size(2)
def test_factories_and_random_ops_put_the_identity_off_coordinate_0(world) -> None:
    # n copies of v reduce to v only for idempotent ops; product needs ones
    # and bxor zeros off coordinate 0 (3 * 3 = 9 and 5 ^ 5 = 0 otherwise).
    import dtensor

    mesh = DeviceMesh("cpu", [0, 1])
    for op in ("product", "sum", "max"):
        x = dtensor.full((2,), 3.0, device_mesh=mesh, placements=[Partial(op)])
        assert torch.equal(x.full_tensor(), torch.full((2,), 3.0)), op
    b = dtensor.full((2,), 5, dtype=torch.int64, device_mesh=mesh, placements=[Partial("bxor")])
    assert torch.equal(b.full_tensor(), torch.full((2,), 5))
    dtensor.manual_seed(7)
    r = dtensor.rand(4, device_mesh=mesh, placements=[Replicate()])
    dtensor.manual_seed(7)
    p = dtensor.rand(4, device_mesh=mesh, placements=[Partial("product")])
    assert torch.equal(p.full_tensor(), r.full_tensor())
