"""Covers: dtensor/redistribute.py, dtensor/_comm.py on real Gloo worlds.

Exhaustive: every source x target placement on 1-D and 2-D meshes, for 0-d,
1-d uneven, empty and 3-d tensors; each result's local block is compared with
the slice of the single-device tensor that the layout math says it holds.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommCounter
from dtensor.errors import MeshError
from dtensor.spec import local_block

SHAPES = [(), (5,), (3, 0, 2), (5, 3, 2), (1, 7)]


def _meshes(n: int, tensor_ndim: int) -> list[DeviceMesh]:
    meshes = [DeviceMesh("cpu", list(range(n)))]
    if n == 4:
        meshes.append(DeviceMesh("cpu", [[0, 1], [2, 3]]))
        if tensor_ndim < 3:  # a transposed rank grid, where it stays cheap
            meshes.append(DeviceMesh("cpu", [[0, 2], [1, 3]]))
    return meshes


def _all_placements(mesh_ndim: int, tensor_ndim: int):
    opts = [Replicate(), Partial("sum"), Partial("max")]
    if mesh_ndim == 1:
        opts.append(Partial("avg"))
    opts += [Shard(d) for d in range(tensor_ndim)]
    return list(itertools.product(opts, repeat=mesh_ndim))


def _make(full: torch.Tensor, mesh: DeviceMesh, placements) -> DTensor:
    """A DTensor of value ``full`` laid out by ``placements`` (Partial included)."""
    if any(p.is_partial() for p in placements):
        r = distribute_tensor(full, mesh, [Replicate()] * mesh.ndim)
        return r.redistribute(mesh, placements)
    return distribute_tensor(full, mesh, placements)


def _expected_block(full: torch.Tensor, mesh: DeviceMesh, placements) -> torch.Tensor:
    shape, offset = local_block(full.shape, mesh.shape, placements, mesh.get_coordinate())
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


def _check(y: DTensor, full: torch.Tensor, mesh: DeviceMesh, context) -> None:
    assert y.shape == full.shape and y.dtype == full.dtype, context
    if any(p.is_partial() for p in y.placements):
        assert torch.allclose(y.full_tensor(), full, atol=1e-6), context
    else:
        # Every rank checks its own block against the single-device slice,
        # which together pins down the full value.
        local = y.to_local()
        expected = _expected_block(full, mesh, y.placements)
        assert local.shape == expected.shape, (context, local.shape, expected.shape)
        assert torch.allclose(local, expected, atol=1e-6), context


WORLDS = [pytest.param(n, marks=pytest.mark.world_size(n), id=f"w{n}") for n in (1, 2, 4)]


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_transition_keeps_the_value(n: int, shape, world) -> None:
    torch.manual_seed(0)
    full = torch.randn(shape, dtype=torch.float64)
    for mesh in _meshes(n, len(shape)):
        pls = _all_placements(mesh.ndim, len(shape))
        for src in pls:
            x = _make(full, mesh, src)
            _check(x, full, mesh, (mesh, src))
            for dst in pls:
                y = x.redistribute(mesh, dst)
                _check(y, full, mesh, (mesh, src, dst))
                # A round trip back to the source gives the original blocks.
                if not any(p.is_partial() for p in dst + src):
                    back = y.redistribute(mesh, src)
                    assert torch.equal(back.to_local(), x.to_local()), (mesh, src, dst)


@pytest.mark.world_size(4)
def test_nested_uneven_sharding_keeps_every_row(world) -> None:
    # Upstream 194457: [S(0), S(0)] of 5 rows on 2x2 lost a row on S->R.
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    full = torch.arange(10.0).reshape(5, 2)
    x = distribute_tensor(full, mesh, [Shard(0), Shard(0)])
    assert torch.equal(x.full_tensor(), full)
    assert torch.equal(x.redistribute(mesh, [Replicate(), Shard(0)]).full_tensor(), full)


@pytest.mark.world_size(4)
def test_bool_int_and_bfloat16_values_survive(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    for full in (
        torch.tensor([[True, False, True]] * 3),
        torch.arange(15).reshape(3, 5),
        torch.randn(3, 5).to(torch.bfloat16),
    ):
        for pls in ([Shard(0), Shard(1)], [Shard(1), Shard(1)], [Replicate(), Shard(0)]):
            x = distribute_tensor(full, mesh, pls)
            assert torch.equal(x.full_tensor(), full), (full.dtype, pls)
        if full.dtype != torch.bool:
            p = distribute_tensor(full, mesh, [Replicate(), Replicate()])
            p = p.redistribute(mesh, [Partial("max"), Partial("sum")])
            assert torch.equal(p.full_tensor(), full), full.dtype


@pytest.mark.world_size(2)
def test_local_transitions_issue_no_collectives(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    x = distribute_tensor(torch.randn(6, 4), mesh, [Replicate()])
    with CommCounter() as c:
        s = x.redistribute(mesh, [Shard(1)])  # R -> S: a local slice
        same = s.redistribute(mesh, [Shard(1)])  # S(i) -> S(i): no-op
        noop = x.redistribute(mesh, [Replicate()])
        p = x.redistribute(mesh, [Partial()])  # R -> P: local zeroing
    assert c.total == 0, c.counts
    assert same is s and noop is x
    with CommCounter() as c:
        s.full_tensor()
        p.full_tensor()
    assert c.counts == {"all_gather": 1, "all_reduce": 1}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_partial_to_shard_is_one_reduce_scatter(world, op) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    base = torch.arange(15.0).reshape(3, 5)  # 3 and 5 rows: uneven on 2 ranks
    scale = {"sum": 3.0, "avg": 1.5, "max": 2.0}[op]  # ranks hold 1x and 2x base
    for dim in (0, 1):
        local = (base * (mesh.get_coordinate()[0] + 1)).requires_grad_()
        p = DTensor.from_local(local, mesh, [Partial(op)])
        with CommCounter() as c:
            y = p.redistribute(mesh, [Shard(dim)])
        # One reduce-scatter of the padded buffer (4x5 or 3x6 float32), no all-reduce.
        assert c.counts == {"reduce_scatter": 1}, (op, dim, c.counts)
        assert c.bytes == {"reduce_scatter": 4 * (20 if dim == 0 else 18)}, c.bytes
        _check(y, base * scale, mesh, (op, dim))
        if op == "max":
            continue  # no backward through Partial(max)
        # The dual, all-gather of the shard's gradient, reaches every rank whole.
        y.to_local().sum().backward()
        grad = torch.full_like(base, 1.0 / (2 if op == "avg" else 1))
        assert torch.equal(local.grad, grad), (op, dim, local.grad)


@pytest.mark.world_size(4)
def test_nested_partials_reduce_scatter_outer_axis_first(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    full = torch.arange(35.0).reshape(7, 5)  # 7 rows on 2x2: pieces 2, 2, 2, 1
    r = distribute_tensor(full, mesh, [Replicate(), Replicate()])
    p = r.redistribute(mesh, [Partial(), Partial()])
    cases = [
        ([Shard(0), Shard(0)], {"reduce_scatter": 2}),
        ([Shard(1), Shard(0)], {"reduce_scatter": 2}),
        ([Replicate(), Shard(1)], {"all_reduce": 1, "reduce_scatter": 1}),
    ]
    for dst, counts in cases:
        with CommCounter() as c:
            y = p.redistribute(mesh, dst)
        assert c.counts == counts, (dst, c.counts)
        _check(y, full, mesh, dst)


@pytest.mark.world_size(4)
def test_outsiders_get_empty_blocks_and_stay_silent(world) -> None:
    mesh = DeviceMesh("cpu", [1, 3])
    full = torch.arange(12.0).reshape(4, 3)
    with CommCounter() as c:
        # The default source (index 0 of each mesh axis) is global rank 1 here.
        x = distribute_tensor(full, mesh, [Shard(0)])
        y = x.redistribute(mesh, [Replicate()])
        z = (y * 2).sum()
    if mesh.get_coordinate() is None:
        assert c.total == 0
        for t in (x, y):
            assert t.to_local().numel() == 0 and t.to_local().dtype == full.dtype
        assert z.to_local().numel() == 0
        assert y.full_tensor().numel() == 0
    else:
        assert torch.equal(y.to_local(), full)
        assert z.full_tensor().item() == full.sum().item() * 2


@pytest.mark.world_size(2)
def test_distribute_uses_src_data_rank(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    mine = torch.full((4,), float(world.rank))
    x = distribute_tensor(mine, mesh, [Shard(0)], src_data_rank=1)
    assert torch.equal(x.full_tensor(), torch.ones(4))
    own = distribute_tensor(mine, mesh, [Replicate()], src_data_rank=None)
    assert torch.equal(own.to_local(), mine)


@pytest.mark.world_size(4)
def test_src_data_rank_counts_within_each_mesh_axis(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    mine = torch.full((2, 2), float(world.rank))
    # Index 1 on both axes is the member at coordinate (1, 1): global rank 3.
    x = distribute_tensor(mine, mesh, [Shard(0), Shard(1)], src_data_rank=1)
    assert torch.equal(x.full_tensor(), torch.full((2, 2), 3.0))
    # Default: coordinate (0, 0), also for every replica on a 2-D mesh.
    r = distribute_tensor(mine, mesh, [Replicate(), Replicate()])
    assert torch.equal(r.to_local(), torch.zeros(2, 2)), f"rank {world.rank}"
    sub = DeviceMesh("cpu", [2, 3])
    y = distribute_tensor(mine[0], sub, [Replicate()])  # default: global rank 2's copy
    if sub.get_coordinate() is not None:
        assert torch.equal(y.to_local(), torch.full((2,), 2.0))
    with pytest.raises(MeshError, match=r"src_data_rank=2 .* \[0, 2\)"):
        distribute_tensor(mine, mesh, [Replicate(), Replicate()], src_data_rank=2)


WIRE_DTYPES = [torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.bool,
               torch.float8_e4m3fn, torch.complex64]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("dtype", WIRE_DTYPES, ids=str)
def test_dtypes_gloo_rejects_still_move_and_reduce(world, dtype) -> None:
    # Gloo raises "Invalid scalar type" for these; _comm carries them in a
    # dtype it accepts, bit-exactly for moves and exactly for sums.
    mesh = DeviceMesh("cpu", [0, 1])
    full = torch.arange(6).reshape(3, 2).to(dtype)
    x = distribute_tensor(full, mesh, [Shard(0)])
    assert x.to_local().dtype == dtype
    assert torch.equal(x.full_tensor().view(torch.uint8), full.view(torch.uint8))
    if dtype in (torch.bool, torch.float8_e4m3fn):
        return  # no exact sum to compare with: float8/bool add is not closed
    p = DTensor.from_local(full, mesh, [Partial("sum")])
    assert torch.equal(p.full_tensor(), (full.long() * 2).to(dtype))
    s = p.redistribute(mesh, [Shard(0)])  # a reduce-scatter, same carrier
    assert s.to_local().dtype == dtype
    assert torch.equal(s.full_tensor(), (full.long() * 2).to(dtype))
    if dtype == torch.uint64:
        with pytest.raises(RuntimeError, match=r"all_reduce.max. of torch.uint64"):
            DTensor.from_local(full, mesh, [Partial("max")]).full_tensor()
