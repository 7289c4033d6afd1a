"""Covers: two drop-in calls PyTorch's DTensor computes, on 2-rank Gloo
worlds, each run with both runtimes and counted by the same dispatch mode
(``bench/_comm_bytes.py``): values equal single device, and ours sends no
more (wire bytes, then collectives) than PyTorch's DTensor.

- ``torch.vmap(F.embedding)`` over DTensors: vmap's embedding rule adds a
  plain offset tensor under PyTorch's implicit-replication flag, which
  dispatch honours (dtensor/dispatch/call.py);
- ``_foreach_*`` ops whose elements live on different meshes (a 1-D mesh
  and a 2-D one): one call per mesh (dtensor/rules/foreach.py
  ``per_mesh``): norms of every order, and the in-place ops optimizers call.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _libs(world):
    """{name: (module, 1-D mesh over the world, 2-D (n, 1) mesh over it)}."""
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh
    from torch.distributed.device_mesh import init_device_mesh

    import dtensor

    ranks = list(world.ranks)
    return {
        "ours": (dtensor, dtensor.DeviceMesh("cpu", ranks),
                 dtensor.DeviceMesh("cpu", [[r] for r in ranks])),
        "torch": (tdt, TorchMesh.from_group(world.group, "cpu"),
                  init_device_mesh("cpu", (world.size, 1))),
    }


def _counted(fn):
    """(collectives, wire bytes, result) of ``fn()`` under one counting mode."""
    from _comm_bytes import CommBytes

    with CommBytes() as cb:
        out = fn()
    return len(cb.records), cb.wire, out


def _no_more_than_torch(got: dict, what: str) -> None:
    (oc, ow, _), (tc, tw, _) = got["ours"], got["torch"]
    assert ow < tw + 1e-6, f"{what}: ours {oc} collectives / {ow:.0f} B, torch {tc} / {tw:.0f} B"
    assert ow < tw - 1e-6 or oc <= tc, f"{what}: ours {oc} collectives, torch {tc} ({ow:.0f} B)"


def _seeded(*shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _place(lib, layout: str):
    return lib.Replicate() if layout == "R" else lib.Shard(int(layout[1:]))


# vmap(F.embedding) ----------------------------------------------------------
_EMBED_LAYOUTS = [("R", "R"), ("S0", "S0"), ("S1", "R"), ("S2", "R"), ("R", "S1")]


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("wl", "il"), _EMBED_LAYOUTS, ids=["-".join(x) for x in _EMBED_LAYOUTS])
def test_vmap_of_embedding_over_dtensors(world, wl, il) -> None:
    """A batch of tables (B, vocab, dim) and a batch of index rows (B, L):
    vmap's rule flattens the tables and offsets each row's indices."""
    weight = _seeded(2, 7, 4, seed=1)
    idx = torch.tensor([[0, 6, 3, 3], [5, 1, 6, 0]])
    want = torch.vmap(F.embedding)(idx, weight)
    got = {}
    for name, (lib, mesh, _) in _libs(world).items():
        w = lib.distribute_tensor(weight, mesh, [_place(lib, wl)])
        i = lib.distribute_tensor(idx, mesh, [_place(lib, il)])
        got[name] = _counted(lambda w=w, i=i: torch.vmap(F.embedding)(i, w).full_tensor())
    torch.testing.assert_close(got["ours"][2], want, **TOL)
    _no_more_than_torch(got, f"vmap(embedding) weight {wl}, indices {il}")


@pytest.mark.world_size(2)
def test_vmap_of_embedding_leaves_no_implicit_replication_behind(world) -> None:
    """Outside vmap's rule a plain operand is still refused."""
    import dtensor

    _, mesh, _ = _libs(world)["ours"]
    w = dtensor.distribute_tensor(_seeded(2, 7, 4, seed=2), mesh, [dtensor.Replicate()])
    i = dtensor.distribute_tensor(torch.tensor([[0, 1], [2, 3]]), mesh, [dtensor.Replicate()])
    torch.vmap(F.embedding)(i, w)
    with pytest.raises(dtensor.ShardingError, match=r"plain torch\.Tensor"):
        w + torch.ones(2, 7, 4)


# foreach ops over several meshes --------------------------------------------
def _operands(lib, line, grid):
    """Three tensors: sharded on the 1-D mesh, sharded on the 2-D mesh,
    replicated on the 1-D mesh; and their plain values."""
    xs = [_seeded(6, 4, seed=3), _seeded(5, 3, seed=4), _seeded(3, seed=5)]
    return xs, [lib.distribute_tensor(xs[0], line, [lib.Shard(0)]),
                lib.distribute_tensor(xs[1], grid, [lib.Shard(0), lib.Replicate()]),
                lib.distribute_tensor(xs[2], line, [lib.Replicate()])]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("order", [2.0, 1.0, 3.0, 0.5, 0.0, math.inf, -math.inf])
def test_foreach_norm_of_tensors_on_different_meshes(world, order) -> None:
    got, want = {}, None
    for name, (lib, line, grid) in _libs(world).items():
        xs, dts = _operands(lib, line, grid)
        want = torch._foreach_norm(xs, order)
        got[name] = _counted(
            lambda dts=dts: [n.full_tensor() for n in torch._foreach_norm(dts, order)])
    for g, w in zip(got["ours"][2], want, strict=True):
        torch.testing.assert_close(g, w, **TOL)
    _no_more_than_torch(got, f"_foreach_norm ord {order}")


@pytest.mark.world_size(2)
def test_foreach_norm_results_keep_each_elements_mesh(world) -> None:
    import dtensor

    _, line, grid = _libs(world)["ours"]
    _, dts = _operands(dtensor, line, grid)
    norms = torch._foreach_norm(dts, 2.0)
    assert [n.device_mesh for n in norms] == [line, grid, line]
    assert norms[0].placements == (dtensor.Partial("norm2"),)
    assert norms[2].placements == (dtensor.Replicate(),)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("op", ["add_list_", "mul_scalar_", "lerp_scalar_", "addcmul_"])
def test_foreach_pointwise_ops_on_different_meshes(world, op) -> None:
    got, want = {}, None

    def run(xs, ys):
        if op == "add_list_":
            torch._foreach_add_(xs, ys, alpha=2.0)
        elif op == "mul_scalar_":
            torch._foreach_mul_(xs, 0.5)
        elif op == "lerp_scalar_":
            torch._foreach_lerp_(xs, ys, 0.25)
        else:
            torch._foreach_addcmul_(xs, ys, ys, value=3.0)
        return xs

    for name, (lib, line, grid) in _libs(world).items():
        xs, dts = _operands(lib, line, grid)
        ys, dys = _operands(lib, line, grid)
        ys = [y.flip(0) for y in ys]
        dys = [lib.distribute_tensor(y, d.device_mesh, d.placements) for y, d in zip(ys, dys, strict=True)]
        want = run([x.clone() for x in xs], ys)
        got[name] = _counted(lambda dts=dts, dys=dys: [t.full_tensor() for t in run(dts, dys)])
    for g, w in zip(got["ours"][2], want, strict=True):
        torch.testing.assert_close(g, w, **TOL)
    _no_more_than_torch(got, f"_foreach {op}")


@pytest.mark.world_size(2)
def test_foreach_element_split_across_meshes_is_refused(world) -> None:
    """One element's members on two meshes: no split can help; the error
    names both meshes (on every rank)."""
    import dtensor

    _, line, grid = _libs(world)["ours"]
    a = dtensor.distribute_tensor(_seeded(4, 2, seed=6), line, [dtensor.Shard(0)])
    b = dtensor.distribute_tensor(_seeded(4, 2, seed=7), grid,
                                  [dtensor.Shard(0), dtensor.Replicate()])
    with pytest.raises(dtensor.MeshError, match="different meshes"):
        torch._foreach_add([a, b], [b, a])
