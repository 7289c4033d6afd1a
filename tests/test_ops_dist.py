"""Covers: dtensor/dispatch/ and dtensor/rules/ on Gloo worlds: every row of
the op table (dtensor/testing/op_table.py) with an example against the
single-device result, for Replicate, Shard on each dim (uneven
sizes included) and Partial inputs; zero-collective guarantees; errors."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from dtensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Replicate,
    Shard,
    ShardingError,
    UnsupportedOpError,
    distribute_tensor,
    implicit_replication,
)
from dtensor.debug import CommCounter
from dtensor.testing.op_table import TABLE, OpCase


def _layouts(t: torch.Tensor, mesh_ndim: int, partial: bool):
    """Placement tuples to try for one input on a 1-D mesh."""
    out = [(Replicate(),)]
    out += [(Shard(d),) for d in range(t.ndim)]
    if partial and t.is_floating_point():
        out.append((Partial("sum"),))
    return out


def _full(x):
    if isinstance(x, DTensor):
        return x.full_tensor()
    if isinstance(x, (list, tuple)):
        return type(x)(_full(y) for y in x)
    return x


def _close(got, want, what: str) -> None:
    if isinstance(want, (list, tuple)):
        assert len(got) == len(want), what
        for g, w in zip(got, want, strict=True):
            _close(g, w, what)
        return
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: got {type(got)}"
        assert got.dtype == want.dtype and got.shape == want.shape, (what, got, want)
        torch.testing.assert_close(got, want, equal_nan=True, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{what}: {m}")
        return
    assert got == want, (what, got, want)


def check(fn: Callable, inputs, mesh, *, partial: bool = True, combos=None) -> int:
    """Run ``fn`` on DTensors of ``inputs`` over many layouts; compare with plain."""
    want = fn(*[t.clone() for t in inputs])
    if combos is None:
        per = [_layouts(t, mesh.ndim, partial) for t in inputs]
        combos = set()
        for i, opts in enumerate(per):  # one input varied, the others replicated
            for p in opts:
                combo = [(Replicate(),) * mesh.ndim] * len(inputs)
                combo[i] = p
                combos.add(tuple(combo))
        for d in range(max(t.ndim for t in inputs)):  # all sharded on dim d
            combos.add(tuple((Shard(d),) if t.ndim > d else (Replicate(),) for t in inputs))
        combos = sorted(combos, key=str)
    for combo in combos:
        dts = [distribute_tensor(t.clone(), mesh, list(p)) for t, p in zip(inputs, combo, strict=True)]
        with implicit_replication():  # index tensors and targets in the lambdas
            got = _full(fn(*dts))
        _close(got, want, f"{fn.__name__ if hasattr(fn, '__name__') else fn} {combo}")
    return len(combos)


# The rows of the one op table (dtensor/testing/op_table.py) with fixed shapes.
OPS = [case for case in TABLE if case.example is not None]


def _rand(*shape):
    return torch.randn(*shape)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("op", OPS, ids=[o.name for o in OPS])
def test_op_matches_single_device_on_2_ranks(line_mesh, world, op: OpCase) -> None:
    inputs = [_rand(*s) for s in op.example]
    check(op.fn, inputs, line_mesh(2), partial=op.partial)


_FOUR = ["add_bcast", "sum0", "mean", "mm", "bmm", "view_merge", "view_merge_uneven",
         "cat", "softmax", "layer_norm", "max_dim", "embedding", "cross_entropy"]


@pytest.mark.world_size(4)
@pytest.mark.parametrize("op", [o for o in OPS if o.name in _FOUR], ids=_FOUR)
def test_op_matches_single_device_on_4_ranks(line_mesh, world, op: OpCase) -> None:
    inputs = [_rand(*s) for s in op.example]
    check(op.fn, inputs, line_mesh(4), partial=op.partial)


@pytest.mark.world_size(4)
def test_two_dim_mesh_nested_and_mixed_layouts(world) -> None:
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    a, b = torch.randn(5, 6), torch.randn(6, 3)
    layouts = [
        (Shard(0), Shard(0)), (Shard(0), Shard(1)), (Shard(1), Shard(0)),
        (Replicate(), Shard(1)), (Partial(), Shard(0)), (Shard(1), Partial()),
    ]
    for la, lb in itertools.product(layouts, repeat=2):
        for fn in (torch.mm, lambda x, y: (x @ y).sum(0), lambda x, y: x.sum(1) + y.mean()):
            check(fn, [a, b], mesh, combos=[(la, lb)])
    for la in layouts:
        for fn in (lambda x: x.view(-1), lambda x: x.view(5, 2, 3), lambda x: x.t().mean(1),
                   lambda x: x.softmax(1), lambda x: x.amax(0), lambda x: x.unsqueeze(0).expand(2, 5, 6)):
            check(fn, [a], mesh, combos=[(la,)])


@pytest.mark.world_size(2)
def test_uneven_and_empty_shards(line_mesh, world) -> None:
    mesh = line_mesh(2)
    x = torch.randn(1, 4)  # rank 1 holds an empty shard on dim 0
    for fn in (lambda a: a.amax(0), lambda a: a.argmax(), lambda a: a.mean(0),
               lambda a: a.max(0)[0], lambda a: a.sum(), lambda a: a * 2, lambda a: a.view(4),
               lambda a: a.squeeze(0), lambda a: a.norm(dim=0), lambda a: a.logsumexp(0)):
        check(fn, [x], mesh)
    y = torch.randn(3, 2)  # chunks 2 and 1: mean of local means would be wrong
    check(lambda a: a.mean(0), [y], mesh)
    check(lambda a: F.mse_loss(a, torch.zeros(3, 2)), [y], mesh)


@pytest.mark.world_size(2)
def test_nan_in_one_shard_survives_max(line_mesh, world) -> None:
    x = torch.randn(4, 3)
    x[3, 1] = float("nan")
    check(lambda a: a.amax(0), [x], line_mesh(2))
    check(lambda a: a.max(), [x], line_mesh(2))


# Zero-collective guarantees --------------------------------------------------------
@pytest.mark.world_size(2)
def test_no_communication_where_none_is_needed(line_mesh, world) -> None:
    mesh = line_mesh(2)
    a = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    b = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    w = distribute_tensor(torch.randn(4, 3), mesh, [Replicate()])
    c3 = distribute_tensor(torch.randn(4, 6, 8), mesh, [Shard(1)])
    with CommCounter() as c:
        y = (a + b) * a - b.exp()          # pointwise, identical placements
        z = torch.relu(a).mul_(2)
        m = torch.mm(a, w)                 # S(0) x R
        s = a.sum(1)                       # sum over a non-sharded dim
        v = c3.view(4, 6, 2, 4).transpose(0, 1).unsqueeze(0).flatten(2, 3)  # local views
        p = torch.mm(a.t(), b)             # S(1) x S(0) -> Partial
        lin = F.linear(a, w.t())
        sm = a.softmax(1)
    assert c.total == 0, c.counts
    assert m.placements == (Shard(0),) and s.placements == (Shard(0),)
    assert p.placements == (Partial("sum"),)
    assert y.placements == z.placements == sm.placements == lin.placements == (Shard(0),)
    assert v.placements == (Shard(1),)


@pytest.mark.world_size(2)
def test_metadata_ops_alias_the_spec_object(line_mesh, world) -> None:
    x = distribute_tensor(torch.randn(4, 4), line_mesh(2), [Shard(0)])
    assert x.detach()._spec is x._spec
    assert torch.ops.aten.alias(x)._spec is x._spec


# Scalars, mixing, errors, fallback -------------------------------------------------
@pytest.mark.world_size(2)
def test_equal_and_scalars_agree_on_every_rank(line_mesh, world) -> None:
    mesh = line_mesh(2)
    t = torch.randn(5, 3)
    u = t.clone()
    u[4, 2] += 1  # differs only in rank 1's shard
    a = distribute_tensor(t, mesh, [Shard(0)])
    b = distribute_tensor(u, mesh, [Shard(0)])
    assert torch.equal(a, a.clone()) is True
    assert torch.equal(a, b) is False
    assert torch.equal(a, distribute_tensor(t, mesh, [Shard(1)])) is True
    assert a.sum().item() == pytest.approx(t.sum().item(), rel=1e-5)
    assert bool((a > -100).all()) is True


@pytest.mark.world_size(4)
def test_equal_on_a_sub_mesh_uses_only_its_ranks(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    a = distribute_tensor(torch.ones(4), mesh, [Shard(0)])
    with CommCounter() as c:
        r = torch.equal(a, a + 0)
    if world.rank < 2:
        assert r is True
    else:  # outsiders: no collectives (torch turns the hook's None into False)
        assert c.total == 0 and not r


@pytest.mark.world_size(2)
def test_plain_tensors_mix_only_when_tiny_or_allowed(line_mesh, world) -> None:
    mesh = line_mesh(2)
    a = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    assert torch.equal((a + torch.tensor(2.0)).full_tensor(), torch.full((4, 2), 3.0))
    assert torch.equal((a * torch.tensor([2.0])).full_tensor(), torch.full((4, 2), 2.0))
    with pytest.raises(ShardingError, match=r"aten\.add\.Tensor.*plain torch\.Tensor.*implicit_replication"):
        a + torch.ones(4, 2)
    with implicit_replication():
        assert torch.equal((a + torch.ones(2)).full_tensor(), torch.full((4, 2), 2.0))


@pytest.mark.world_size(2)
def test_random_ops_without_a_handler_raise_clearly(line_mesh, world) -> None:
    a = distribute_tensor(torch.ones(4, 2), line_mesh(2), [Shard(0)])
    with pytest.raises(UnsupportedOpError, match=r"random ops on DTensors land with dtensor\.random"):
        torch.ops.aten.rrelu_with_noise(a, a.detach().clone(), 0.1, 0.3, True)


@pytest.mark.world_size(2)
def test_fallback_is_correct_and_logs_once(line_mesh, world, caplog) -> None:
    # A new op (no other test can have logged it) with no rule, called on
    # three shapes: each call is a new call key, so each one propagates and
    # reaches the replicate fallback; only the first may log.
    name = f"dtensor_log_once_{uuid.uuid4().hex[:8]}"
    lib = torch.library.Library(name, "DEF")
    lib.define("flip2(Tensor x) -> Tensor")
    lib.impl("flip2", lambda x: x.flip(0) * 2, "CompositeExplicitAutograd")
    op = getattr(torch.ops, name).flip2.default
    mesh = line_mesh(2)
    xs = [torch.randn(n, 3) for n in (4, 5, 6)]
    with caplog.at_level("DEBUG", logger="dtensor.dispatch"):
        outs = [op(distribute_tensor(x, mesh, [Shard(0)])) for x in xs]
    for x, out in zip(xs, outs, strict=True):
        assert out.placements == (Replicate(),)
        assert torch.equal(out.full_tensor(), x.flip(0) * 2)
    hits = [r.getMessage() for r in caplog.records if f"{name}.flip2" in r.getMessage()]
    assert len(hits) == 1, f"expected one log line for {op} over 3 calls, got {hits}"


@pytest.mark.world_size(2)
def test_register_rule_for_a_custom_op(line_mesh, world) -> None:
    from dtensor import Sharding, register_rule

    lib = torch.library.Library("dtensor_test", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
    op = torch.ops.dtensor_test.twice.default

    @register_rule(op)
    def twice_rule(call):
        (spec,) = call.specs
        return Sharding(inputs=(None,), outputs=(spec.placements,))

    a = distribute_tensor(torch.arange(6.0), line_mesh(2), [Shard(0)])
    with CommCounter() as c:
        out = op(a)
    assert c.total == 0 and out.placements == (Shard(0),)
    assert torch.equal(out.full_tensor(), torch.arange(6.0) * 2)


@pytest.mark.world_size(2)
def test_backward_through_sharded_ops(line_mesh, world) -> None:
    mesh = line_mesh(2)
    x, w = torch.randn(6, 4, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    (torch.relu(x @ w).softmax(1) * torch.arange(3.0)).mean().backward()
    for px, pw in [(Shard(0), Replicate()), (Replicate(), Shard(1)), (Shard(1), Shard(0))]:
        dx = distribute_tensor(x.detach(), mesh, [px]).requires_grad_()
        dw = distribute_tensor(w.detach(), mesh, [pw]).requires_grad_()
        with implicit_replication():
            (torch.relu(dx @ dw).softmax(1) * torch.arange(3.0)).mean().backward()
        torch.testing.assert_close(dx.grad.full_tensor(), x.grad)
        torch.testing.assert_close(dw.grad.full_tensor(), w.grad)
