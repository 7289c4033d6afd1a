"""Covers: dtensor/_compile.py (torch.compile of DTensor programs) on a 2-rank
Gloo world: compiled results equal eager ones for local ops, the ways in and
out (``from_local``, ``redistribute``, ``to_local``, ``full_tensor``), a
training step, a tensor-parallel block (its styles' hooks traced into one
graph) and random ops, with ``fullgraph=True``; recompiles happen exactly when
a mesh or placements change.

Compiles are slow on two cores: shapes are tiny and each compiled function is
built once and called several times.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import dtensor
from dtensor import (
    DeviceMesh,
    DTensor,
    MeshError,
    Partial,
    PlacementError,
    Replicate,
    Shard,
    distribute_tensor,
)
from dtensor import random as rng

from _compile_checks import assert_same, fresh_compiler  # noqa: F401 - autouse

BACKENDS = ["aot_eager", "inductor"]


def _data(rank: int):
    g = torch.Generator().manual_seed(7)
    a, b, c = torch.randn(4, 4, generator=g), torch.randn(4, 3, generator=g), torch.randn(4, 4, generator=g)
    return a, b, c, torch.full((2, 3), float(rank + 1))


# Local ops and the ways in and out ---------------------------------------------------
def _local_ops(a, b, c):
    """a: S(0) [4,4], b: R [4,3], c: S(1) [4,4]."""
    return (
        torch.relu(a * 2 + 1).exp(),     # pointwise
        a @ b,                           # matmul, S(0) x R -> S(0)
        c @ a,                           # matmul, S(1) x S(0) -> P(sum)
        a.sum(0), a.mean(), b.amax(1),   # reductions
        a.view(2, 8), a.t(), c.reshape(16),  # views
    )


def _ways_in_and_out(local, mesh):
    x = DTensor.from_local(local, mesh, [Shard(0)])         # [4, 3] from [2, 3] blocks
    y = (x * 3).redistribute(mesh, [Replicate()])
    z = y.redistribute(mesh, [Shard(1)])
    p = DTensor.from_local(local, mesh, [Partial()]).redistribute(mesh, [Shard(0)])
    return y.to_local() + 1, z, p.full_tensor(), x.full_tensor()


def _program(a, b, c, local, mesh):
    return _local_ops(a, b, c), _ways_in_and_out(local, mesh)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ops_and_ways_in_and_out_compile_fullgraph(line_mesh, world, backend) -> None:
    mesh = line_mesh(2)
    a, b, c, local = _data(world.rank)
    args = (
        distribute_tensor(a, mesh, [Shard(0)]),
        distribute_tensor(b, mesh, [Replicate()]),
        distribute_tensor(c, mesh, [Shard(1)]),
    )
    cnt = CompileCounterWithBackend(backend)
    compiled = torch.compile(_program, backend=cnt, fullgraph=True)
    for step in range(2):  # new data, same layouts: no recompile
        scaled = (*(t * (step + 1) for t in args), local * (step + 1), mesh)
        assert_same(compiled(*scaled), _program(*scaled))
    assert cnt.frame_count == 1


@pytest.mark.world_size(2)
def test_from_local_redistribute_to_local_are_calls_with_constant_layouts(
    line_mesh, world
) -> None:
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    mesh = line_mesh(2)
    out = torch.compile(_ways_in_and_out, backend=record, fullgraph=True)(torch.ones(2, 3), mesh)
    assert_same(out, _ways_in_and_out(torch.ones(2, 3), mesh))
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    names = {getattr(n.target, "__name__", n.target) for n in calls}
    assert {"from_local", "redistribute", "to_local", "full_tensor"} <= names
    # The only graph input is the local tensor: mesh and placements are constants.
    assert len([n for n in gm.graph.nodes if n.op == "placeholder"]) == 1
    from_local = next(n for n in calls if getattr(n.target, "__name__", "") == "from_local")
    assert from_local.args[1] == mesh and tuple(from_local.args[2]) == (Shard(0),)
    assert "dtensor_mesh(" in gm.code and "dtensor_Shard(dim=0)" in gm.code


# Guards --------------------------------------------------------------------------------
@pytest.mark.world_size(2)
def test_recompiles_on_mesh_or_placements_not_on_data(line_mesh, world) -> None:
    mesh, same_mesh, other_mesh = line_mesh(2), line_mesh(2), DeviceMesh("cpu", [1, 0])
    cnt = CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda x: (x * 2).sum(0), backend=cnt, fullgraph=True)

    def calls(t, m, placements):
        f(distribute_tensor(t, m, placements))
        return cnt.frame_count

    assert calls(torch.ones(4, 2), mesh, [Shard(0)]) == 1
    assert calls(torch.randn(4, 2), mesh, [Shard(0)]) == 1        # data only
    assert calls(torch.randn(4, 2), same_mesh, [Shard(0)]) == 1   # an equal mesh
    assert calls(torch.ones(4, 2), mesh, [Replicate()]) == 2      # placements
    assert calls(torch.ones(4, 2), other_mesh, [Shard(0)]) == 3   # mesh

    cnt2 = CompileCounterWithBackend("aot_eager")
    g = torch.compile(
        lambda t, m, pl: DTensor.from_local(t, m, pl).redistribute(m, [Replicate()]).to_local(),
        backend=cnt2, fullgraph=True,
    )
    t = torch.full((2, 2), float(world.rank))
    for data, m, pl, frames in [
        (t, mesh, [Shard(0)], 1), (t + 5, mesh, [Shard(0)], 1), (t, same_mesh, [Shard(0)], 1),
        (t, mesh, [Shard(1)], 2), (t, other_mesh, [Shard(0)], 3),
    ]:
        out = g(data, m, pl)
        torch.testing.assert_close(out, DTensor.from_local(data, m, pl).full_tensor())
        assert cnt2.frame_count == frames


# Backward: a training step -------------------------------------------------------------
def _mlp(p, x, y):
    h = torch.relu(F.linear(x, p["w1"], p["b1"]))
    return F.cross_entropy(F.linear(h, p["w2"], p["b2"]), y)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_mlp_training_step_matches_eager(line_mesh, world, backend) -> None:
    mesh = line_mesh(2)
    g = torch.Generator().manual_seed(0)
    init = {
        "w1": torch.randn(16, 8, generator=g) * 0.3, "b1": torch.randn(16, generator=g) * 0.1,
        "w2": torch.randn(5, 16, generator=g) * 0.3, "b2": torch.randn(5, generator=g) * 0.1,
    }
    layout = {"w1": [Shard(0)], "b1": [Shard(0)], "w2": [Shard(1)], "b2": [Replicate()]}
    batches = [
        (distribute_tensor(torch.randn(6, 8, generator=g), mesh, [Shard(0)]),
         distribute_tensor(torch.randint(0, 5, (6,), generator=g), mesh, [Shard(0)]))
        for _ in range(2)
    ]

    def params():
        return {k: distribute_tensor(v.clone(), mesh, layout[k]).requires_grad_() for k, v in init.items()}

    cnt = CompileCounterWithBackend(backend)
    step = torch.compile(_mlp, backend=cnt, fullgraph=True)
    eager_p, compiled_p = params(), params()
    for x, y in batches:
        losses = []
        for fn, p in ((_mlp, eager_p), (step, compiled_p)):
            loss = fn(p, x, y)
            loss.backward()
            losses.append(loss)
        assert_same(losses[1], losses[0])
        for k in init:
            assert_same(compiled_p[k].grad, eager_p[k].grad)
        with torch.no_grad():
            for p in (*eager_p.values(), *compiled_p.values()):
                p.sub_(0.1 * p.grad)
                p.grad = None
    assert cnt.frame_count == 1


@pytest.mark.world_size(2)
def test_gradient_in_another_layout_reaches_the_compiled_backward(
    line_mesh, world
) -> None:
    mesh = line_mesh(2)
    w = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    grad = distribute_tensor(torch.arange(8.0).reshape(4, 2) / 8, mesh, [Replicate()])
    f = torch.compile(lambda w: torch.tanh(w * 0.1) * 3, backend="aot_eager", fullgraph=True)
    grads = []
    for fn in (lambda w: torch.tanh(w * 0.1) * 3, f):
        leaf = w.detach().requires_grad_()
        out = fn(leaf)
        assert out.placements == (Shard(0),)
        out.backward(grad)  # Replicate, not the Shard(0) the backward was traced with
        grads.append(leaf.grad)
    assert_same(grads[1], grads[0])


# Random ops ----------------------------------------------------------------------------
def _random(x):
    return F.dropout(x, 0.5) + torch.rand_like(x), torch.empty_like(x).normal_(1.0, 2.0)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("backend", BACKENDS)
def test_random_ops_compiled_equal_eager_for_every_layout(
    line_mesh, world, backend
) -> None:
    mesh = line_mesh(2)
    f = torch.compile(_random, backend=backend, fullgraph=True)
    results = {}
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        x = distribute_tensor(torch.ones(4, 6), mesh, placements)
        for name, fn in (("compiled", f), ("eager", _random)):
            dtensor.manual_seed(3)
            outs = [fn(x) for _ in range(2)]  # the generator advances per call
            results[name, str(placements)] = [o.full_tensor() for pair in outs for o in pair]
            results[name, "state", str(placements)] = rng.get_rng_state()
    want = results["eager", str([Replicate()])]
    for key, got in results.items():
        if "state" in key:
            assert got == rng.RNGState(3, 6), key
        else:
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w), key
    assert not torch.equal(want[0], want[2])  # a second call draws new numbers


# Limits and regressions ------------------------------------------------------------------
@pytest.mark.world_size(2)
def test_unsupported_under_compile_raise_clear_errors(line_mesh, world) -> None:
    mesh = line_mesh(2)
    with pytest.raises(Exception, match=r"run_check=True is not supported under torch\.compile"):
        torch.compile(
            lambda t: DTensor.from_local(t, mesh, [Shard(0)], run_check=True),
            backend="aot_eager", fullgraph=True,
        )(torch.ones(2))
    with mesh, pytest.raises(Exception, match=r"pass device_mesh=\.\.\. explicitly"):
        torch.compile(
            lambda t: DTensor.from_local(t, placements=[Shard(0)]), backend="aot_eager",
        )(torch.ones(2))
    assert issubclass(MeshError, RuntimeError) and issubclass(PlacementError, RuntimeError)


@pytest.mark.world_size(2)
def test_factories_graph_break_and_run_eagerly(line_mesh, world) -> None:
    mesh = line_mesh(2)
    x = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])

    def f(d):
        z = dtensor.zeros(4, 2, device_mesh=mesh, placements=[Shard(0)])
        return dtensor.rand(4, 2, device_mesh=mesh, placements=[Shard(0)]) + z + d

    results = []
    for fn in (f, torch.compile(f, backend="aot_eager")):
        dtensor.manual_seed(5)
        results.append(([fn(x) for _ in range(2)], rng.get_rng_state()))
    assert_same(results[1][0], results[0][0])
    assert results[1][1] == results[0][1] == rng.RNGState(5, 2)
    torch._dynamo.reset()  # else the partial graphs above are reused
    with pytest.raises(Exception, match="marked as skipped"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(x)


@pytest.mark.world_size(2)
def test_constant_factories_compile_fullgraph(line_mesh, world) -> None:
    mesh = line_mesh(2)
    x = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])

    def f(d):
        z = dtensor.zeros(4, 2, device_mesh=mesh, placements=[Shard(0)])
        o = dtensor.full((4, 2), 2.0, device_mesh=mesh, placements=[Shard(0)])
        return d * o + z + dtensor.ones(4, 2, device_mesh=mesh, placements=[Shard(0)])

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    assert_same(compiled(x), f(x))
    assert_same(compiled(x * 3), f(x * 3))
    assert counter.frame_count == 1


@pytest.mark.world_size(2)
def test_layouts_live_across_a_graph_break(line_mesh, world) -> None:
    mesh = line_mesh(2)
    x = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])

    def f(d):
        placements, m = [Replicate()], d.device_mesh
        torch._dynamo.graph_break()
        return d.redistribute(m, placements) * m.ndim

    assert_same(torch.compile(f, backend="aot_eager")(x), f(x))


@pytest.mark.world_size(2)
def test_meshes_and_placements_pickle_and_copy_for_compile_caches(
    line_mesh, world
) -> None:
    import copy

    mesh = line_mesh(2)
    assert pickle.loads(pickle.dumps(mesh)) == mesh and copy.deepcopy(mesh) is mesh
    for p in (Shard(1), Replicate(), Partial("avg")):
        assert pickle.loads(pickle.dumps(p)) == p
    # A compiled program depends on this rank's coordinate: cache keys differ by rank.
    key = distribute_tensor(torch.ones(2, 2), mesh, [Shard(0)])._stable_hash_for_caching()
    mine = torch.tensor([int(key[:15], 16)])
    keys = [torch.zeros_like(mine) for _ in range(2)]
    torch.distributed.all_gather(keys, mine, group=world.group)
    assert keys[0] != keys[1]


pytestmark = pytest.mark.slow  # starts several worlds or compiles: the full run, not the quick tier
