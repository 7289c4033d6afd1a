"""Covers: dtensor/dispatch/shared.py (plans shared by the ranks of a simulated world)
and its place in dtensor/dispatch/general.py and dtensor/dispatch/cache.py.

The n rank threads of a simulated world each miss the call table once per
new call (a spec's mesh carries its rank); a plan made by one rank is
re-bound to the others' meshes, so a rule runs once per call, not n times.
Every rank must still get exactly what it gets on its own: its own block
(uneven shards: blocks of different sizes), its own groups in a rule's
``local`` function, and, outside a sub-mesh, an empty result.
"""

from __future__ import annotations

import collections
import os
import threading

import pytest
import torch

import dtensor
from dtensor import (
    DeviceMesh,
    Replicate,
    Shard,
    Sharding,
    distribute_tensor,
    register_rule,
)
from dtensor.dispatch import cache, general
from launch.sim.threaded import entered
from launch.sim.world import SimWorld

pytestmark = pytest.mark.skipif(
    "RANK" in os.environ, reason="a simulated world swaps this process's c10d world; "
    "not inside a rank of a real world")

N = 8
ROWS = 2 * N + 3  # uneven: the last ranks hold smaller blocks (or none)

_lib = torch.library.Library("dtensor_shared_test", "DEF")
_lib.define("twice(Tensor x) -> Tensor")
_lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
TWICE = torch.ops.dtensor_shared_test.twice.default
_rule_calls: collections.Counter = collections.Counter()
_lock = threading.Lock()


@register_rule(TWICE)
def _twice_rule(call):
    (spec,) = call.specs
    with _lock:
        _rule_calls[spec.placements] += 1
    return Sharding(inputs=(None,), outputs=(spec.placements,))


def _in_world(n: int, body):
    """``body(rank)`` on each rank of a fresh n-rank world: its values by rank."""
    from dtensor._rank_state import enter_rank

    w = SimWorld(n, enter_rank)
    try:
        with entered():
            outs = w.run(body, 120.0)
    finally:
        with entered():
            w.close()
    errors = {o.rank: repr(o.error) for o in outs if o.error is not None}
    assert not errors, errors
    return [o.value for o in outs]


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, 5, generator=g), torch.randn(5, 3, generator=g)


def _ops(x, w):
    """Ops with fast forms, redistributions, and rules' ``local`` functions
    that read the rank's coordinate (view, max.dim) or groups (amax, norm)."""
    y = x * 2 + 1
    return {
        "affine mm": y @ w,
        "sum": y.sum(0),
        "mean": y.mean(),
        "amax": y.amax(),
        "max.dim": y.max(0).values,
        "argmax": y.argmax(0),
        "view": y.view(ROWS, 5, 1),  # Shard(0) kept: each rank's own block size
        "flat view": y.view(ROWS * 5),  # gathered first
        "norm": torch.linalg.vector_norm(y, 3.0),
        "twice": TWICE(y),
    }


def test_each_call_is_planned_once_for_all_ranks_and_each_rank_gets_its_own_result(
        monkeypatch) -> None:
    x, w = _inputs()
    want = _ops(x, w)
    planned = collections.Counter()
    real = general.propagate

    def counting(call, info):
        with _lock:
            planned[str(call.func)] += 1
        return real(call, info)

    def body(rank: int):
        mesh = DeviceMesh("cpu", torch.arange(N))
        dx = distribute_tensor(x, mesh, [Shard(0)])
        dw = distribute_tensor(w, mesh, [Replicate()])
        got = _ops(dx, dw)
        blocks = {k: tuple(v.to_local().shape) for k, v in got.items()}
        return {k: v.full_tensor() for k, v in got.items()}, blocks

    # A rank that holds the turn longer than the scheduler's safety net
    # (launch/sim/turn.py: the first time torch meets these ops in the
    # process, lazy imports) lets the next rank run beside it, and both plan.
    # A first world warms the process; a new world plans every call anew.
    _in_world(N, body)
    monkeypatch.setattr(general, "propagate", counting)
    _rule_calls.clear()
    values = _in_world(N, body)
    for rank, (got, _) in enumerate(values):
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, msg=lambda m, k=k, r=rank: f"{k} rank {r}: {m}")
    # Uneven blocks: the ranks' local shapes differ, yet one plan served them all.
    assert len({b["view"] for _, b in values}) > 1, [b for _, b in values]
    assert _rule_calls == {(Shard(0),): 1}, _rule_calls
    assert planned and max(planned.values()) < N, planned
    once = sum(planned.values())
    # The same calls on twice as few ranks plan as often: once per call, not per rank.
    planned.clear()
    _in_world(N // 2, _half_body(x, w))
    assert sum(planned.values()) == once, (planned, once)


def _half_body(x, w):
    def body(rank: int):
        mesh = DeviceMesh("cpu", torch.arange(N // 2))
        _ops(distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(w, mesh, [Replicate()]))

    return body


def test_ranks_outside_a_sub_mesh_get_empty_results_and_members_the_full_ones() -> None:
    x, w = _inputs()
    want = _ops(x, w)
    _rule_calls.clear()
    inside = list(range(1, N, 2))  # every other rank

    def body(rank: int):
        sub = DeviceMesh("cpu", inside)
        dx = distribute_tensor(x, sub, [Shard(0)])
        dw = distribute_tensor(w, sub, [Replicate()])
        got = _ops(dx, dw)
        if sub.get_coordinate() is None:
            return {k: v.to_local().numel() for k, v in got.items()}
        return {k: v.full_tensor() for k, v in got.items()}

    values = _in_world(N, body)
    for rank, got in enumerate(values):
        if rank not in inside:
            assert set(got.values()) == {0}, (rank, got)
            continue
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, msg=lambda m, k=k, r=rank: f"{k} rank {r}: {m}")
    assert _rule_calls == {(Shard(0),): 1}, _rule_calls


def test_an_output_its_rule_settles_is_settled_on_every_rank() -> None:
    # Pieces of an average differ by rank (twice the value on even ranks,
    # zero on odd ones); a sum of them is returned whole (Sharding.settled),
    # also on the ranks that reuse another rank's plan.
    x, _ = _inputs()

    def body(rank: int):
        mesh = DeviceMesh("cpu", torch.arange(N))
        piece = x * (2.0 if rank % 2 == 0 else 0.0)
        s = dtensor.DTensor.from_local(piece, mesh, [dtensor.Partial("avg")]).sum(0)
        return s.placements, s.to_local()

    for rank, (placements, local) in enumerate(_in_world(N, body)):
        assert placements == (Replicate(),), (rank, placements)
        torch.testing.assert_close(local, x.sum(0), msg=lambda m, r=rank: f"rank {r}: {m}")


def test_forgetting_drops_the_shared_plans_with_the_call_table() -> None:
    x, _ = _inputs()
    _rule_calls.clear()

    def body(rank: int):
        mesh = DeviceMesh("cpu", torch.arange(N))
        dx = distribute_tensor(x, mesh, [Shard(0)])
        TWICE(dx)
        ours = [k for k in cache.SHARED if k[0] == TWICE._op]
        return len(ours), len(cache.SHARED) <= cache.CACHE_LIMIT

    assert all(v == (1, True) for v in _in_world(N, body))
    assert not cache.SHARED  # the world ended: dtensor.dispatch.forget()
    _rule_calls.clear()

    def again(rank: int):
        mesh = DeviceMesh("cpu", torch.arange(N))
        dx = distribute_tensor(x, mesh, [Shard(0)])
        TWICE(dx)
        if rank == 0:  # a rule registered again drops the op's plans, shared ones too
            before = [k for k in cache.SHARED if k[0] == TWICE._op]
            register_rule(TWICE)(_twice_rule)
            after = [k for k in cache.SHARED if k[0] == TWICE._op]
            return len(before), len(after)
        return None

    assert _in_world(N, again)[0] == (1, 0)
    assert dtensor.dispatch.forget() is None and not cache.SHARED
