"""Covers: ``Partial("norm<p>")`` (dtensor/placement.py ``norm_partial``,
dtensor/_norm_wire.py, the norm cases of dtensor/_comm.py all_reduce and
reduce_scatter, dtensor/redistribute.py ``_to_partial``, the stack/cat join
in dtensor/rules/view.py, dtensor/interop.py) on Gloo worlds: pieces that are
each rank's p-norm of its share redistribute to the single-device norm, to
Shard (uneven too) and on 2-D meshes; Replicate -> norm pieces round-trips,
refuses negative values on every rank alike; PyTorch's ``_NormPartial``
converts both ways."""

from __future__ import annotations

import math

import pytest
import torch

from dtensor import DeviceMesh, DTensor, Partial, PlacementError, Replicate, Shard, distribute_tensor
from dtensor.debug import CommCounter
from dtensor.placement import norm_partial

ORDERS = [2.0, 1.0, 3.0, 0.0, math.inf]
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _pieces(x: torch.Tensor, mesh: DeviceMesh, p: float, axis: int = 0) -> DTensor:
    """Column p-norms of ``x`` as norm pieces: rank r holds the norms of its
    ``torch.chunk`` of rows along mesh ``axis`` (uneven and empty chunks too)."""
    coord = mesh.get_coordinate()[axis]
    rows = x.chunk(mesh.shape[axis], dim=0)
    mine = rows[coord] if coord < len(rows) else x[:0]
    local = torch.linalg.vector_norm(mine, p, dim=0) if mine.numel() else torch.zeros(x.shape[1])
    placements = [Replicate()] * mesh.ndim
    placements[axis] = norm_partial(p)
    return DTensor.from_local(local, mesh, placements, run_check=False)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("p", ORDERS, ids=str)
@pytest.mark.parametrize("rows", [12, 5, 2], ids=["even", "uneven", "empty-shards"])
def test_norm_pieces_redistribute_to_the_single_device_norm(world, p, rows) -> None:
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    x = torch.randn(rows, 7, generator=torch.Generator().manual_seed(rows))
    want = torch.linalg.vector_norm(x, p, dim=0)
    d = _pieces(x, mesh, p)
    with CommCounter() as c:
        r = d.redistribute(mesh, [Replicate()])
    assert c.counts == {"all_reduce": 1}, c.counts
    torch.testing.assert_close(r.to_local(), want, **TOL)
    s = d.redistribute(mesh, [Shard(0)])  # 7 columns over 4 ranks: uneven
    torch.testing.assert_close(s.full_tensor(), want, **TOL)
    assert s.to_local().shape[0] == len(want.chunk(4)[mesh.get_coordinate()[0]]) \
        if mesh.get_coordinate()[0] < len(want.chunk(4)) else s.to_local().numel() == 0
    back = r.redistribute(mesh, [norm_partial(p)])  # Replicate -> pieces
    if p != math.inf and mesh.get_coordinate()[0] != 0:
        assert torch.equal(back.to_local(), torch.zeros_like(want))
    torch.testing.assert_close(back.full_tensor(), want, **TOL)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("p", [2.0, math.inf], ids=str)
def test_norm_pieces_on_a_2d_mesh(world, p) -> None:
    """Pieces on both axes of a 2x2 mesh reduce in either order to the norm;
    pieces kept on one axis while the other reduces stay pieces."""
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(4))
    want = torch.linalg.vector_norm(x, p, dim=0)
    a, b = mesh.get_coordinate()
    quarter = x.chunk(4, dim=0)[2 * a + b]
    local = torch.linalg.vector_norm(quarter, p, dim=0)
    d = DTensor.from_local(local, mesh, [norm_partial(p), norm_partial(p)], run_check=False)
    torch.testing.assert_close(d.full_tensor(), want, **TOL)
    half = d.redistribute(mesh, [norm_partial(p), Replicate()])
    assert half.placements == (norm_partial(p), Replicate())
    torch.testing.assert_close(half.full_tensor(), want, **TOL)
    torch.testing.assert_close(d.redistribute(mesh, [Shard(0), Replicate()]).full_tensor(), want, **TOL)


@pytest.mark.world_size(4)
def test_nan_in_one_inf_norm_piece_wins(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    local = torch.tensor([1.0, 2.0]) if world.rank != 2 else torch.tensor([math.nan, 5.0])
    d = DTensor.from_local(local, mesh, [norm_partial(math.inf)], run_check=False)
    full = d.full_tensor()
    assert math.isnan(full[0]) and full[1] == 5.0, full


@pytest.mark.world_size(4)
def test_negative_values_refuse_to_become_norm_pieces_on_every_rank(world) -> None:
    """A replicated -1 on coordinate 0 with zeros elsewhere would combine to
    |-1|: every rank raises (none waits in a collective), in redistribute and
    in a stack that joins a replicated operand to norm pieces, the second
    time too (the cached plan's fast form)."""
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    neg = distribute_tensor(torch.tensor([-1.0, 2.0]), mesh, [Replicate()])
    with pytest.raises(PlacementError, match="negative entries"):
        neg.redistribute(mesh, [norm_partial(2.0)])
    pieces = DTensor.from_local(torch.tensor(1.0), mesh, [norm_partial(2.0)], run_check=False)
    ok = distribute_tensor(torch.tensor(3.0), mesh, [Replicate()])
    for _ in range(2):
        s = torch.stack([pieces, ok])
        assert s.placements == (norm_partial(2.0),)
        torch.testing.assert_close(s.full_tensor(), torch.tensor([2.0, 3.0]))
    bad = distribute_tensor(torch.tensor(-3.0), mesh, [Replicate()])
    for _ in range(2):
        with pytest.raises(PlacementError, match="negative entries"):
            torch.stack([pieces, bad])
    torch.testing.assert_close(torch.stack([pieces.redistribute(mesh, [Replicate()]), bad]).full_tensor(),
                               torch.tensor([2.0, -3.0]))  # reduced first: the user's way out


@pytest.mark.world_size(4)
def test_replicated_norms_join_pieces_and_refuse_once_written_negative(world) -> None:
    """``_foreach_norm``'s replicated results join norm pieces in a stack
    (clip_grad_norm_ does this every step; a 0-dim value is checked by one
    read, not two ops). Written negative in place afterwards (through the
    DTensor, a view of it and a detached alias), every rank raises, in the
    stack and in redistribute."""
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    sharded = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    for write in (lambda n: n.neg_(), lambda n: n.view(1).mul_(-1),
                  lambda n: n.detach().sub_(100.0)):
        rep = distribute_tensor(torch.tensor([3.0, 4.0]), mesh, [Replicate()])
        piece, norm = torch._foreach_norm([sharded, rep], 2.0)
        assert piece.placements == (norm_partial(2.0),) and norm.placements == (Replicate(),)
        total = torch.linalg.vector_norm(torch.stack([piece, norm]), 2.0)
        torch.testing.assert_close(total.full_tensor(), torch.tensor(140.0 + 25.0).sqrt())
        write(norm)
        with pytest.raises(PlacementError, match="negative entries"):
            torch.stack([piece, norm])
        with pytest.raises(PlacementError, match="negative entries"):
            norm.redistribute(mesh, [norm_partial(2.0)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("p", [2.0, 3.0, math.inf, 0.0], ids=str)
def test_norm_pieces_convert_to_and_from_pytorch(world, p) -> None:
    from torch.distributed.tensor import Partial as TPartial

    from dtensor.interop import from_torch, to_torch

    mesh = DeviceMesh("cpu", [0, 1])
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(9))
    d = _pieces(x, mesh, p)
    t = to_torch(d)
    assert isinstance(t.placements[0], TPartial)
    torch.testing.assert_close(t.full_tensor(), torch.linalg.vector_norm(x, p, dim=0), **TOL)
    back = from_torch(t)
    if p not in (0.0, math.inf):  # PyTorch's own partial-norm placement maps back
        assert back.placements == (norm_partial(p),)
    torch.testing.assert_close(back.full_tensor(), torch.linalg.vector_norm(x, p, dim=0), **TOL)


def test_norm_partial_names_and_errors() -> None:
    assert norm_partial(2) == Partial("norm2") == Partial("NORM2.0")
    assert str(norm_partial(math.inf)) == "P(norminf)" and norm_partial(0.5).norm_order == 0.5
    assert norm_partial(2.0).identity() == 0 and not norm_partial(2.0).is_linear
    assert norm_partial(math.inf).is_idempotent and norm_partial(math.inf).identity() is None
    assert Partial("sum").norm_order is None
    for bad in (-1.0, -math.inf, math.nan):
        with pytest.raises(PlacementError, match="p >= 0 or inf"):
            norm_partial(bad)
    with pytest.raises(PlacementError, match="norm<p>"):
        Partial("norm-2")


@pytest.mark.world_size(2)
def test_norm_pieces_need_a_floating_dtype(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    with pytest.raises(PlacementError, match="needs a floating dtype"):
        DTensor.from_local(torch.tensor([3, 4]), mesh, [norm_partial(2.0)], run_check=False)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, 0.0, math.inf, -math.inf], ids=str)
@pytest.mark.parametrize("rows", [8, 5, 2], ids=["even", "uneven", "empty-shards"])
def test_dist_of_alike_sharded_operands_is_norm_pieces(world, p, rows) -> None:
    """``torch.dist`` of two tensors sharded alike sends nothing; reading it
    reduces one scalar; orders without pieces (-inf) and a different cut
    still give the single-device value."""
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    g = torch.Generator().manual_seed(rows)
    x, y = torch.randn(rows, 3, generator=g), torch.randn(rows, 3, generator=g)
    want = torch.dist(x, y, p)
    dx, dy = (distribute_tensor(t, mesh, [Shard(0)]) for t in (x, y))
    with CommCounter() as c:
        got = torch.dist(dx, dy, p)
    if p >= 0:
        assert c.counts == {} and got.placements == (norm_partial(p),), (c.counts, got.placements)
        with CommCounter() as c:
            full = got.full_tensor()
        assert c.counts == {"all_reduce": 1} and c.bytes == {"all_reduce": 4}, (c.counts, c.bytes)
    else:
        full = got.full_tensor()
    torch.testing.assert_close(full, want, **TOL)
    other = distribute_tensor(y, mesh, [Shard(1)])  # cut another way: lined up first
    torch.testing.assert_close(torch.dist(dx, other, p).full_tensor(), want, **TOL)


@pytest.mark.world_size(4)
def test_factories_and_random_ops_refuse_to_write_possibly_negative_norm_pieces(world) -> None:
    """A constant or a draw written straight into norm pieces would come back
    as its absolute value (coordinate 0 keeps v, the others 0): refused on
    every rank, outsiders of a sub-mesh included; non-negative constants are
    fine."""
    import dtensor

    mesh = DeviceMesh("cpu", [0, 1])  # ranks 2 and 3 are outsiders
    pieces = [norm_partial(2.0)]
    with pytest.raises(PlacementError, match="a negative value cannot be written"):
        dtensor.full((3,), -1.5, device_mesh=mesh, placements=pieces)
    with pytest.raises(PlacementError, match="values that may be negative"):
        dtensor.randn(3, device_mesh=mesh, placements=pieces)
    x = distribute_tensor(torch.zeros(3), mesh, [Replicate()]).redistribute(mesh, pieces)
    with pytest.raises(PlacementError, match="values that may be negative"):
        x.normal_()
    ok = dtensor.full((3,), 2.0, device_mesh=mesh, placements=pieces)
    full = ok.full_tensor()
    if mesh.get_coordinate() is not None:
        assert torch.equal(full, torch.full((3,), 2.0))
    assert torch.equal(dtensor.ones(2, device_mesh=mesh, placements=pieces).full_tensor()
                       if mesh.get_coordinate() is not None else torch.ones(2), torch.ones(2))
