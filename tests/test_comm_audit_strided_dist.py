"""Covers: views that merge a cut inner dim into the dim before it, and the
products that read the result (dtensor/rules/view.py, dtensor/rules/matmul.py,
the ``strided_aware`` hand-over in dtensor/dispatch/propagate.py).

The cases of the communication audit (bench/comm_audit.py) where ours
gathered at such a view and PyTorch's DTensor kept the block as a
``_StridedShard``, run with both runtimes on a 2-rank Gloo world as the
audit counts them (the op plus making its result a full tensor): ours must
send no more wire bytes (for equal bytes, no more collectives) and equal the
single-device value:

- ``tensordot`` of (2, 2, 2) cut on dim 2 by (2, 2, 2) cut on dim 1 over
  two dims: both reshapes keep a ``StridedShard`` of the contracted dim, the
  product of the two is ``Partial(sum)``, only the output is reduced;
- (2, 3, 3) cut on dim 1 viewed as (6, 3), then a product (as
  ``linear_cross_entropy`` does with its weight).

And on our runtime alone, against single-device values: uneven and empty
blocks kept through the view and back with no collective; a contracted dim
cut two different ways (a ``StridedShard`` against a ``Shard``, two split
factors) is moved first, never summed as if it matched; 2-D meshes with one
axis strided and the other cutting another dim; gradients through the view
and the product; interleaved rows gathered before an expand, not after.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_comm_audit_fixes_dist import TOL, _check_no_more_than_torch, _pieces

from dtensor import DeviceMesh, Partial, Replicate, Shard, StridedShard, distribute_tensor
from dtensor.debug import CommDebugMode
from dtensor.testing import assert_matches_single_device


def _sent(fn, *args):
    """``fn(*args)`` and how many collectives it sent."""
    with CommDebugMode() as comm:
        out = fn(*args)
    return out, comm.get_total_counts()


def _x(*shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)),
                       dtype=torch.float64)


@pytest.mark.world_size(2)
def test_tensordot_of_cut_inner_dims_reduces_only_the_output(world) -> None:
    a, b = _pieces((2, 2, 2), 200, 1), _pieces((2, 2, 2), 201, 1)
    # PyTorch: 1 collective / 16 B (the output's reduction)
    _check_no_more_than_torch(world, lambda x, y: torch.tensordot(x, y, dims=2),
                              [("S2", a), ("S1", b)])


@pytest.mark.world_size(2)
def test_view_of_a_cut_inner_dim_then_a_product(line_mesh, world) -> None:
    w, x = _pieces((2, 3, 3), 210, 1), _pieces((4, 3), 211, 1)
    _check_no_more_than_torch(world, lambda w, x: x @ w.view(6, 3).t(), [("S1", w), ("R", x)])
    _check_no_more_than_torch(world, lambda w, x: F.linear(x, w.reshape(6, 3)),
                              [("S1", w), ("R", x)])
    # ours sends nothing until the output is read whole: its columns stay in
    # the weight's runs (3 rows over 2 ranks: 2 and 1 of each run)
    mesh = line_mesh(2)
    dw = distribute_tensor(w[0].double(), mesh, [Shard(1)])
    dx = distribute_tensor(x[0].double(), mesh, [Replicate()])
    out, sent = _sent(lambda w, x: F.linear(x, w.view(6, 3)), dw, dx)
    assert sent == 0 and out.placements == (StridedShard(1, 2),), (sent, out.placements)
    assert_matches_single_device(out, F.linear(x[0].double(), w[0].double().view(6, 3)))


@pytest.mark.world_size(2)
@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="torch has no linear_cross_entropy")
def test_linear_cross_entropy_of_a_weight_cut_on_an_inner_dim(world) -> None:
    # the audit's linear_cross_entropy sample 2, layout (R, S(1), S(1))
    x, w = _pieces((4, 3), 220, 1), _pieces((2, 3, 3), 221, 1)
    target = [torch.randint(0, 2, (4, 3), generator=torch.Generator().manual_seed(222))]
    _check_no_more_than_torch(
        world, lambda x, w, t: F.linear_cross_entropy(x, w, t, reduction="none"),
        [("R", x), ("S1", w), ("S1", target)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("shape", [(2, 2), (2, 3), (3, 5), (2, 7), (4, 3, 1)])
def test_view_merging_a_cut_inner_dim_keeps_it_strided(line_mesh, world, shape) -> None:
    x = _x(*shape)
    d = distribute_tensor(x, line_mesh(2), [Shard(1)])
    # uneven pieces (3 or 5 or 7 rows over 2 ranks) included
    for name, fn in (("view", lambda t: t.view(-1)), ("reshape", lambda t: t.reshape(-1)),
                     ("flatten", lambda t: t.flatten())):
        y, sent = _sent(fn, d)
        assert sent == 0 and y.placements == (StridedShard(0, shape[0]),), (name, y.placements)
        assert_matches_single_device(y, x.reshape(-1), msg=name)
        back, sent = _sent(lambda t: t.view(shape), y)
        assert sent == 0 and back.placements == (Shard(1),), back.placements
        assert_matches_single_device(back, x, msg=f"{name} and back")


@pytest.mark.world_size(4)
@pytest.mark.parametrize("shape", [(2, 3), (3, 5), (2, 2, 3)])
def test_view_of_an_inner_dim_with_an_empty_block(line_mesh, world, shape) -> None:
    # 3 rows over 4 ranks: the last rank holds none of every run
    x = _x(*shape)
    d = distribute_tensor(x, line_mesh(4), [Shard(x.ndim - 1)])
    y, sent = _sent(lambda t: t.view(-1, shape[-1] * shape[-2]), d)
    assert sent == 0 and y.placements == (StridedShard(y.ndim - 1, shape[-2]),)
    assert_matches_single_device(y, x.view(-1, shape[-1] * shape[-2]))
    assert_matches_single_device(y.view(shape), x)
    z = y @ distribute_tensor(_x(y.shape[-1], 2), line_mesh(4), [Replicate()])
    torch.testing.assert_close(z.full_tensor(), x.view(y.shape) @ _x(y.shape[-1], 2), **TOL)


@pytest.mark.world_size(4)
@pytest.mark.parametrize(("sa", "sb"), [((2, 3, 5), (3, 5, 4)), ((3, 2, 3), (2, 3, 5)),
                                        ((2, 2, 2), (2, 2, 2))])
def test_tensordot_of_uneven_strided_contractions(line_mesh, world, sa, sb) -> None:
    a, b = _x(*sa), _x(*sb)
    da = distribute_tensor(a, line_mesh(4), [Shard(2)])
    db = distribute_tensor(b, line_mesh(4), [Shard(1)])
    out, sent = _sent(lambda x, y: torch.tensordot(x, y, dims=2), da, db)
    assert sent == 0 and out.placements == (Partial(),), (sent, out.placements)
    assert_matches_single_device(out, torch.tensordot(a, b, dims=2))


@pytest.mark.world_size(2)
def test_contractions_cut_two_ways_are_moved_before_the_product(line_mesh, world) -> None:
    mesh = line_mesh(2)
    a, b = _x(2, 2, 3), _x(6, 4)
    sa = distribute_tensor(a, mesh, [Shard(2)]).view(2, 6)
    assert sa.placements == (StridedShard(1, 2),)
    db = distribute_tensor(b, mesh, [Shard(0)])
    # StridedShard against Shard on the contracted dim, both orders
    assert_matches_single_device(sa @ db, a.view(2, 6) @ b)
    assert_matches_single_device(db.t() @ sa.t(), b.t() @ a.view(2, 6).t())
    # two split factors: rows 3 runs of 2 against 2 runs of 3
    c, e = _x(2, 3, 2), _x(2, 3, 4)
    sc = distribute_tensor(c, mesh, [Shard(2)]).view(2, 6)
    se = distribute_tensor(e, mesh, [Shard(1)]).view(6, 4)
    assert sc.placements == (StridedShard(1, 3),) and se.placements == (StridedShard(0, 2),)
    assert_matches_single_device(sc @ se, c.view(2, 6) @ e.view(6, 4))
    # and with a bias (addmm), the same split factor on both
    bias = distribute_tensor(_x(4), mesh, [Replicate()])
    sf = distribute_tensor(_x(3, 2, 4), mesh, [Shard(1)]).view(6, 4)
    got = torch.addmm(bias, distribute_tensor(_x(5, 6), mesh, [Replicate()]), sf)
    assert_matches_single_device(got, torch.addmm(_x(4), _x(5, 6), _x(3, 2, 4).view(6, 4)))


@pytest.mark.world_size(4)
@pytest.mark.parametrize(("pa", "pb"), [
    ((Shard(2), Shard(0)), (Shard(1), Replicate())),   # strided K beside a cut batch row
    ((Shard(0), Shard(2)), (Replicate(), Shard(1))),
    ((Shard(2), Shard(2)), (Shard(1), Shard(1))),      # both axes cut the inner dims
])
def test_strided_products_on_a_2d_mesh(world, pa, pb) -> None:
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    a, b = _x(2, 3, 5), _x(3, 5, 4)
    da, db = distribute_tensor(a, mesh, pa), distribute_tensor(b, mesh, pb)
    out, sent = _sent(lambda x, y: torch.tensordot(x, y, dims=2), da, db)
    assert sent == 0, out.placements
    assert_matches_single_device(out, torch.tensordot(a, b, dims=2))
    v = da.view(2, 15)
    assert any(isinstance(p, StridedShard) for p in v.placements), v.placements
    assert_matches_single_device(v, a.view(2, 15))
    assert_matches_single_device(v.view(2, 3, 5), a)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("shapes", [((3, 2, 5), (2, 5, 3)), ((2, 3, 3), (3, 3, 2))])
def test_gradients_through_strided_views_and_products(line_mesh, world, shapes) -> None:
    mesh = line_mesh(2)
    a, b = _x(*shapes[0]), _x(*shapes[1])
    da = distribute_tensor(a, mesh, [Shard(2)]).requires_grad_()
    db = distribute_tensor(b, mesh, [Shard(1)]).requires_grad_()
    out = torch.tensordot(da, db, dims=2)
    assert out.placements == (Partial(),)
    (out * out).sum().backward()
    ra, rb = a.clone().requires_grad_(), b.clone().requires_grad_()
    ref = torch.tensordot(ra, rb, dims=2)
    (ref * ref).sum().backward()
    assert_matches_single_device(da.grad, ra.grad)
    assert_matches_single_device(db.grad, rb.grad)
    # the gradients keep their operands' layouts (the views back split the runs)
    assert da.grad.placements == (Shard(2),) and db.grad.placements == (Shard(1),)


@pytest.mark.world_size(2)
def test_every_small_merge_and_contraction_matches_single_device(line_mesh, world) -> None:
    mesh = line_mesh(2)
    for n in (1, 2):
        for rows in (1, 2, 3):
            for inner in (1, 2, 3, 4, 5):  # 1 and 0 rows of each run on rank 1 included
                a, b = _x(n, rows, inner), _x(rows, inner, 2)
                msg = f"({n}, {rows}, {inner})"
                da = distribute_tensor(a, mesh, [Shard(2)])
                db = distribute_tensor(b, mesh, [Shard(1)])
                merged = da.reshape(n, rows * inner)
                if rows > 1 and inner > 1:
                    assert merged.placements == (StridedShard(1, rows),), (msg, merged.placements)
                assert_matches_single_device(merged, a.reshape(n, rows * inner), msg=msg)
                assert_matches_single_device(merged.view(n, rows, inner), a, msg=msg)
                assert_matches_single_device(torch.tensordot(da, db, dims=2),
                                             torch.tensordot(a, b, dims=2), msg=msg)
                assert_matches_single_device(merged @ db.reshape(rows * inner, 2),
                                             a.reshape(n, -1) @ b.reshape(-1, 2), msg=msg)


@pytest.mark.world_size(2)
def test_interleaved_rows_are_gathered_before_an_expand(line_mesh, world) -> None:
    """``repeat_interleave`` views its input flat, then expands and copies it:
    the (few) rules that read interleaved rows stop before the expand, so the
    flat input is gathered, not the doubled copy."""
    from _comm_bytes import CommBytes

    x = _x(2, 3, 4)
    d = distribute_tensor(x, line_mesh(2), [Shard(2)])
    flat, sent = _sent(lambda t: t.view(-1), d)
    assert sent == 0 and flat.placements == (StridedShard(0, 6),), flat.placements
    with CommBytes() as cb:
        y = torch.repeat_interleave(d, 2)
    assert_matches_single_device(y, torch.repeat_interleave(x, 2))
    assert [r.buffer for r in cb.records] == [x.numel() * x.element_size()], cb.records


@pytest.mark.world_size(2)
@pytest.mark.parametrize("shape", [(2, 3, 3), (3, 5, 2)])
def test_inplace_write_through_a_strided_view_reaches_every_block(line_mesh, world,
                                                                  shape) -> None:
    # distribute_tensor's uneven piece (5 rows over 2 ranks: 3 and 2) must
    # take the view as every other rank does, not as a copy of its own
    x = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    dx = distribute_tensor(x, line_mesh(2), [Shard(1)])
    v = dx.view(shape[0] * shape[1], shape[2])
    assert v.placements == (StridedShard(0, shape[0]),), v.placements
    v.mul_(2)
    assert torch.equal(dx.full_tensor(), x * 2)
