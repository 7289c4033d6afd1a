"""Covers: dtensor/rules/norms.py on Gloo worlds: vector norms of sharded
tensors (p = 2, 1, 3, 0, -1, inf, -inf; all dims or some, uneven and empty
shards, NaN on one shard) equal the single-device norms and never gather;
``_foreach_norm`` keeps per-rank norm pieces (``Partial("norm<p>")``) so
that ``clip_grad_norm_`` sends one scalar, from the fast path
(dtensor/dispatch/form.py) on repeated calls."""

from __future__ import annotations

import math

import pytest
import torch

from dtensor import DeviceMesh, Partial, Replicate, Shard, distribute_tensor
from dtensor.placement import norm_partial
from dtensor.debug import CommCounter

WORLDS = pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.world_size(n), id=f"w{n}") for n in (2, 4)]
)
ORDS = [2, 1, 3.0, 0, -1.0, math.inf, -math.inf]
TOL = {"atol": 1e-5, "rtol": 1e-5}


@WORLDS
@pytest.mark.parametrize("shape", [(64, 32), (3, 5)], ids=["even", "uneven"])
def test_vector_norm_of_shards_equals_single_device_without_gathering(line_mesh, world, n, shape) -> None:
    mesh = line_mesh(n)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    x[0, 0] = 0.0  # the 0-norm counts non-zeros
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        d = distribute_tensor(x, mesh, placements)
        for p in ORDS:
            for dim, keepdim in ((None, False), (0, False), (1, True), ((0, 1), False)):
                want = torch.linalg.vector_norm(x, p, dim, keepdim)
                with CommCounter() as c:
                    got = torch.linalg.vector_norm(d, p, dim, keepdim)
                where = f"{placements} p={p} dim={dim}"
                assert c["all_gather"] == 0, f"{where}: {c.counts}"
                assert c.total <= 1, f"{where}: {c.counts}"
                torch.testing.assert_close(got.full_tensor(), want, **TOL,
                                           msg=lambda m, where=where: f"{where}: {m}")
    # torch.norm and Tensor.norm reach the same rule
    d = distribute_tensor(x, mesh, [Shard(0)])
    torch.testing.assert_close(d.norm(1).full_tensor(), x.norm(1), **TOL)
    torch.testing.assert_close(torch.norm(d, dim=1).full_tensor(), torch.norm(x, dim=1), **TOL)


@pytest.mark.world_size(4)
def test_vector_norm_on_a_2d_mesh_and_of_partial_values(line_mesh, world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    d = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    for p in (2, math.inf, -math.inf, 0):
        torch.testing.assert_close(torch.linalg.vector_norm(d, p).full_tensor(),
                                   torch.linalg.vector_norm(x, p), **TOL)
    got = torch.linalg.vector_norm(d, 2, dim=1)  # dim 0 stays sharded on axis 0
    assert got.placements == (Shard(0), norm_partial(2.0))  # axis 1: pieces, nothing sent
    torch.testing.assert_close(got.full_tensor(), torch.linalg.vector_norm(x, 2, dim=1), **TOL)
    part = distribute_tensor(x, line_mesh(4), [Partial()])  # rank 0 holds x, the others 0
    torch.testing.assert_close(torch.linalg.vector_norm(part, 2).full_tensor(),
                               torch.linalg.vector_norm(x, 2), **TOL)


@WORLDS
def test_inf_norm_keeps_a_nan_held_by_one_shard(line_mesh, world, n) -> None:
    x = torch.ones(4 * n)
    x[-1] = math.nan  # on the last rank only
    d = distribute_tensor(x, line_mesh(n), [Shard(0)])
    for p in (math.inf, -math.inf, 2):
        with CommCounter() as c:
            got = torch.linalg.vector_norm(d, p).full_tensor()
        assert torch.isnan(got), p
        # one float32's worth per norm on the wire (at the norm, or at its
        # first use for norm pieces), the NaN included
        assert c.bytes == {"all_reduce": 4}, (p, c.bytes)
    y = torch.arange(4.0 * n) + 1
    y[-1] = math.inf  # a real inf is not a NaN
    e = distribute_tensor(y, line_mesh(n), [Shard(0)])
    assert torch.linalg.vector_norm(e, math.inf).full_tensor() == math.inf
    assert torch.linalg.vector_norm(e, -math.inf).full_tensor() == 1.0


@WORLDS
def test_foreach_norm_keeps_norm_pieces_and_reduces_negative_orders_once(line_mesh, world, n) -> None:
    """Orders >= 0 and inf: each rank's norms of its pieces are the results'
    pieces (``Partial("norm<p>")``), nothing sent; -inf (no partial form):
    one all-reduce for the whole list. Either way the full values are the
    single-device norms."""
    mesh = line_mesh(n)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(8, 6, generator=g), torch.randn(7, generator=g),
          torch.randn(5, 4, generator=g), torch.randn(3, generator=g), torch.randn(2, 9, generator=g)]
    layouts = [[Shard(0)], [Shard(0)], [Shard(1)], [Replicate()], [Shard(1)]]
    ds = [distribute_tensor(x, mesh, pl) for x, pl in zip(xs, layouts, strict=True)]
    for p in (2.0, 1.0, 3.0, math.inf, 0.0, -math.inf):
        want = torch._foreach_norm(xs, p)
        with CommCounter() as c:
            got = torch._foreach_norm(ds, p)
        lazy = p >= 0
        assert c.counts == ({} if lazy else {"all_reduce": 1}), (p, c.counts)
        for i, (a, b, pl) in enumerate(zip(got, want, layouts, strict=True)):
            piece = norm_partial(p) if lazy and pl[0] != Replicate() else Replicate()
            assert a.placements == (piece,), (p, i, a.placements)
            torch.testing.assert_close(a.full_tensor(), b, **TOL, msg=lambda m, i=i, p=p: f"{p} #{i}: {m}")


@WORLDS
@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, math.inf])
def test_total_norm_of_norm_pieces_reduces_one_scalar_at_first_use(line_mesh, world, n, p) -> None:
    """clip_grad_norm_'s shape: per-tensor norms, ``stack`` (a replicated
    norm among sharded ones), ``vector_norm`` of the same order: all local;
    the first pointwise use of the total sends one all-reduce of one scalar."""
    mesh = line_mesh(n)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(9, 4, generator=g), torch.randn(4, generator=g), torch.randn(3, 10, generator=g)]
    ds = [distribute_tensor(x, mesh, pl)
          for x, pl in zip(xs, [[Shard(0)], [Replicate()], [Shard(1)]], strict=True)]
    want = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(xs, p)), p)
    with CommCounter() as c:
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ds, p)), p)
    assert c.counts == {} and total.placements == (norm_partial(p),), (c.counts, total.placements)
    with CommCounter() as c:
        coef = 1.0 / (total + 1e-6)
    assert c.counts == {"all_reduce": 1} and c.bytes == {"all_reduce": 4}, (c.counts, c.bytes)
    assert coef.placements == (Replicate(),)
    torch.testing.assert_close(coef.to_local(), 1.0 / (want + 1e-6), **TOL)
    torch.testing.assert_close(total.full_tensor(), want, **TOL)


@WORLDS
def test_clip_grad_norm_over_mixed_placements_equals_single_device(line_mesh, world, n) -> None:
    """Norm types 2, 1, inf over Shard(0) / Shard(1) / Replicate gradients:
    clipped gradients and the returned total equal single device, and the
    clip sends one all-reduce of one scalar."""
    mesh = line_mesh(n)
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(10, 6, generator=g), torch.randn(10, generator=g),
             torch.randn(4, 10, generator=g), torch.randn(4, generator=g)]
    layouts = [[Shard(0)], [Shard(0)], [Shard(1)], [Replicate()]]
    for norm_type in (2.0, 1.0, math.inf):
        ref = [torch.nn.Parameter(torch.zeros_like(x)) for x in grads]
        ours = [torch.nn.Parameter(distribute_tensor(torch.zeros_like(x), mesh, pl))
                for x, pl in zip(grads, layouts, strict=True)]
        for a, b, x, pl in zip(ref, ours, grads, layouts, strict=True):
            a.grad = x.clone()
            b.grad = distribute_tensor(x, mesh, pl)
        want = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type=norm_type)
        with CommCounter() as c:
            got = torch.nn.utils.clip_grad_norm_(ours, 0.5, norm_type=norm_type)
        assert c.counts == {"all_reduce": 1} and c.bytes == {"all_reduce": 4}, (norm_type, c.counts, c.bytes)
        torch.testing.assert_close(got.full_tensor(), want, **TOL)
        for a, b, pl in zip(ref, ours, layouts, strict=True):
            assert b.grad.placements == tuple(pl)
            torch.testing.assert_close(b.grad.full_tensor(), a.grad, **TOL)


@pytest.mark.world_size(2)
def test_repeated_foreach_norm_of_shards_runs_from_the_fast_path(line_mesh, world, monkeypatch) -> None:
    """The second ``_foreach_norm`` with the same key (every clipping step)
    skips the general path: its plan's fast form runs the rule's ``local`` on
    the list's pieces, with the same result and nothing sent; a new order is
    a new plan (the order is in the call key: it decides the placements)."""
    from dtensor.dispatch import general
    from dtensor.dispatch.cache import TABLE
    from dtensor.dispatch.form import FAST_LOCAL

    mesh = line_mesh(2)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, 6, generator=g), torch.randn(4, generator=g), torch.randn(3, 4, generator=g)]
    ds = [distribute_tensor(x, mesh, pl)
          for x, pl in zip(xs, [[Shard(0)], [Replicate()], [Shard(1)]], strict=True)]
    want = torch._foreach_norm(xs, 2.0)
    first = torch._foreach_norm(ds, 2.0)
    forms = [p.fast for k, p in TABLE.items() if k[0] == torch.ops.aten._foreach_norm.Scalar._op]
    assert any(f is not None and f.kind == FAST_LOCAL for f in forms), forms
    runs = []
    real = general.run
    monkeypatch.setattr(general, "run", lambda *a: runs.append(1) or real(*a))
    with CommCounter() as c:
        again = torch._foreach_norm(ds, 2.0)
    assert runs == [] and c.counts == {}, (runs, c.counts)
    for a, b, w, pl in zip(first, again, want, [[Shard(0)], [Replicate()], [Shard(1)]], strict=True):
        piece = Replicate() if pl[0] == Replicate() else norm_partial(2.0)
        assert a.placements == b.placements == (piece,)
        torch.testing.assert_close(b.full_tensor(), w, **TOL)
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=0, atol=0)
    inf = torch._foreach_norm(ds, math.inf)  # same key but the order's value
    assert runs == [1] and inf[0].placements == (norm_partial(math.inf),), (runs, inf[0].placements)
    torch.testing.assert_close(inf[2].full_tensor(), torch._foreach_norm(xs, math.inf)[2], **TOL)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("piece", [norm_partial(2.0), Partial("sum"), Partial("max")], ids=str)
def test_an_op_that_reduces_its_partial_operand_runs_from_the_fast_path(line_mesh, 
        world, monkeypatch, piece) -> None:
    """``clip_grad_norm_``'s ``total_norm + 1e-6`` every step: a plan whose
    only move is a reduction of top-level operands gets a fast form (MOVE)
    that reduces, runs and wraps without the general path: one all-reduce
    per call, the general path's value and spec, the first operand's spec
    object where the result is laid out like it."""
    from dtensor import DTensor
    from dtensor.dispatch import general
    from dtensor.dispatch.cache import TABLE, forget
    from dtensor.dispatch.form import FAST_MOVE

    forget()  # plans of earlier parameters stay in the table otherwise
    mesh = line_mesh(2)
    rank = mesh.get_coordinate()[0]
    local = torch.tensor([3.0, 4.0]) + rank
    p = DTensor.from_local(local, mesh, [piece], run_check=False)
    r = distribute_tensor(torch.tensor([1.0, -2.0]), mesh, [Replicate()])
    first = p + 1e-6
    first_r = torch.atan2(r, p)  # no placement of p survives atan2: reduced
    forms = [plan.fast for k, plan in TABLE.items() if k[0] in (
        torch.ops.aten.add.Tensor._op, torch.ops.aten.atan2.default._op)]
    assert sum(f is not None and f.kind == FAST_MOVE for f in forms) == 2, forms
    runs = []
    real = general.run
    monkeypatch.setattr(general, "run", lambda *a: runs.append(1) or real(*a))
    with CommCounter() as c:
        again = p + 1e-6
        again_r = torch.atan2(r, p)
    assert runs == [] and c.counts == {"all_reduce": 2}, (runs, c.counts)
    want = p.full_tensor()  # the general redistribution
    for a, b in ((first, again), (first_r, again_r)):
        assert a._spec == b._spec and b.placements == (Replicate(),)
        torch.testing.assert_close(a.to_local(), b.to_local(), rtol=0, atol=0)
    torch.testing.assert_close(again.to_local(), want + 1e-6)
    torch.testing.assert_close(again_r.to_local(), torch.atan2(torch.tensor([1.0, -2.0]), want))
    assert again_r._spec is r._spec  # laid out like the first operand: its spec object
    local.fill_(-1.0)  # a new value in the same layout: the fast form reads it
    torch.testing.assert_close((p + 0.0).full_tensor(), p.full_tensor())
