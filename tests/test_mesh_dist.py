"""Covers: dtensor/mesh.py on Gloo worlds (and single-process geometry)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from dtensor import (
    DeviceMesh,
    MeshError,
    Replicate,
    Shard,
    current_mesh,
    distribute_tensor,
    init_device_mesh,
)


def _geometry_mesh(grid, names=None) -> DeviceMesh:
    # _init_backend=False: pure geometry, whatever world this process is in.
    return DeviceMesh("cpu", grid, mesh_dim_names=names, _init_backend=False)


def test_mesh_geometry() -> None:
    mesh = _geometry_mesh([[0, 1], [2, 3]], ("dp", "tp"))
    assert mesh.shape == (2, 2) and mesh.ndim == 2 and mesh.size() == 4
    assert mesh.size("tp") == 2
    r = mesh.get_rank()
    assert mesh.get_coordinate() == ((r // 2, r % 2) if r < 4 else None)
    if r == 0:
        assert mesh["tp"].mesh.tolist() == [0, 1] and mesh["dp"].mesh.tolist() == [0, 2]
        assert mesh["tp", "dp"].mesh.tolist() == [[0, 2], [1, 3]]
    assert hash(mesh) == hash(_geometry_mesh([[0, 1], [2, 3]], ("dp", "tp")))
    assert repr(mesh) == "DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))"


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("cpu", [0, 0]), {}, "each rank may appear once"),
        (("cpu", []), {}, "empty"),
        (("cpu", [[0]]), {"mesh_dim_names": ("a",)}, "expected 2 unique mesh_dim_names"),
        ((0, [0]), {}, "device_type must be a str"),
    ],
)
def test_bad_meshes_raise(args, kwargs, match) -> None:
    with pytest.raises(MeshError, match=match):
        DeviceMesh(*args, **kwargs)


def test_bad_axis_names_raise() -> None:
    mesh = _geometry_mesh([[0, 1]], ("dp", "tp"))
    with pytest.raises(MeshError, match="no axis named 'pp'"):
        mesh["pp"]
    with pytest.raises(MeshError, match="out of range"):
        mesh.size(2)


def test_with_mesh_nests_and_restores_on_error() -> None:
    a, b = _geometry_mesh([0]), _geometry_mesh([[0]])
    assert current_mesh() is None
    with a:
        with pytest.raises(ValueError), b:
            assert current_mesh() is b
            raise ValueError
        assert current_mesh() is a
    assert current_mesh() is None


@pytest.mark.world_size(4)
def test_mesh_coordinates_groups_and_submeshes(world) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    r = world.rank
    assert mesh.get_coordinate() == (r // 2, r % 2)
    assert mesh.get_local_rank("tp") == r % 2 and mesh.get_local_rank("dp") == r // 2
    tp = mesh["tp"]
    assert tp.mesh.tolist() == [r // 2 * 2, r // 2 * 2 + 1]
    # The tp group reduces over this rank's row only.
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=mesh.get_group("tp"))
    assert t.item() == sum(tp.mesh.tolist())
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=mesh.get_group("dp"))
    assert t.item() == sum(mesh["dp"].mesh.tolist())


@pytest.mark.world_size(4)
def test_submesh_of_some_ranks_built_by_members_only(world) -> None:
    # Ranks with different group histories (rank 0 and 1 build an extra mesh)
    # must still agree on the next group; outsiders never take part.
    if world.rank in (0, 1):
        DeviceMesh("cpu", [0, 1])
    if world.rank in (0, 2):
        mesh = DeviceMesh("cpu", [0, 2])
        t = torch.tensor([1.0])
        dist.all_reduce(t, group=mesh.get_group())
        assert t.item() == 2.0
    outside = DeviceMesh("cpu", [1, 3])
    if world.rank in (0, 2):
        assert outside.get_coordinate() is None and outside.get_group() is None
        with pytest.raises(MeshError, match="not in"):
            outside.get_local_rank()


@pytest.mark.world_size(2)
def test_init_device_mesh_larger_than_the_world_raises(world) -> None:
    n = torch.distributed.get_world_size()
    with pytest.raises(MeshError, match=f"holds {n + 1} ranks but the world has only {n}"):
        init_device_mesh("cpu", (n + 1,))


@pytest.mark.world_size(4)
def test_init_device_mesh_smaller_than_the_world_takes_its_first_ranks(world) -> None:
    # As PyTorch's: ranks 0 .. prod(shape) - 1; the others are outsiders.
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    assert mesh.ranks == (0, 1)
    assert mesh.get_coordinate() == ((0, world.rank) if world.rank < 2 else None)
    x = distribute_tensor(torch.arange(4.0), mesh, [Replicate(), Shard(0)])
    full = x.full_tensor()
    if world.rank < 2:
        assert torch.equal(full, torch.arange(4.0))
    else:
        assert full.numel() == 0
    assert init_device_mesh("cpu", (2, 2)).ranks == (0, 1, 2, 3)


def test_flatten_geometry_names_resolve_on_the_root() -> None:
    mesh = _geometry_mesh(torch.arange(8).reshape(2, 2, 2), ("dp", "cp", "tp"))
    coord = mesh.get_coordinate() or (0, 0, 0)
    dp_cp = mesh["dp", "cp"]._flatten()
    assert dp_cp.mesh_dim_names == ("dp_cp",) and dp_cp.ndim == 1
    assert dp_cp.ranks == tuple(mesh["dp", "cp"].mesh.flatten().tolist())
    assert dp_cp.ranks == tuple(4 * i + 2 * j + coord[2] for i in (0, 1) for j in (0, 1))
    assert mesh["dp_cp"] == dp_cp and dp_cp._get_root_mesh() is mesh
    assert mesh["tp", "dp_cp"].shape == (2, 4)
    assert mesh["dp_cp", "tp"].mesh_dim_names == ("dp_cp", "tp")
    # Reordered axes flatten in the asked order; the public alias is the same.
    cd = mesh["cp", "dp"].flatten("cd")
    assert cd.ranks == tuple(4 * i + 2 * j + coord[2] for j in (0, 1) for i in (0, 1))
    assert mesh["cd"] == cd
    assert mesh["dp"].flatten("dp") is mesh["dp"] or mesh["dp"].flatten("dp") == mesh["dp"]


def test_flatten_bad_names_raise() -> None:
    mesh = _geometry_mesh(torch.arange(8).reshape(2, 2, 2), ("dp", "cp", "tp"))
    mesh["dp", "cp"].flatten("dp_cp")
    with pytest.raises(MeshError, match="'tp' already names an axis"):
        mesh["dp", "cp"].flatten("tp")
    with pytest.raises(MeshError, match=r"'dp_cp' already names the flattened axes \('dp', 'cp'\)"):
        mesh["cp", "tp"].flatten("dp_cp")
    with pytest.raises(MeshError, match="each axis at most once"):
        mesh["dp", "dp_cp"]
    with pytest.raises(KeyError, match="no axis named 'dp_tp'"):
        mesh["dp_tp"]
    with pytest.raises(MeshError, match="has no mesh_dim_names; pass a name"):
        _geometry_mesh([[0, 1], [2, 3]]).flatten()


@pytest.mark.world_size(4)
def test_flattened_mesh_has_groups_and_carries_dtensors(world) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flat = mesh["dp", "tp"]._flatten("dp_tp")
    assert flat.ranks == (0, 1, 2, 3) and flat.get_coordinate() == (world.rank,)
    x = distribute_tensor(torch.arange(8.0), flat, [Shard(0)])
    assert x.to_local().tolist() == [2.0 * world.rank, 2.0 * world.rank + 1]
    assert torch.equal(x.full_tensor(), torch.arange(8.0))
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=mesh["dp_tp"].get_group())
    assert t.item() == 4.0
    # A 2x1 sub-grid flattened: outsiders get the mesh at coordinate 0 and no groups.
    sub = DeviceMesh("cpu", [[0], [1]], mesh_dim_names=("a", "b"))._flatten("ab")
    assert sub.ranks == (0, 1)
    assert (sub.get_coordinate() is None) == (world.rank >= 2)
    assert sub.get_all_groups() == ([None] if world.rank >= 2 else [sub.get_group()])


@pytest.mark.world_size(4)
def test_from_group_uses_the_callers_groups(world) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    groups = mesh.get_all_groups()
    assert len(groups) == 2 and all(g is not None for g in groups)
    again = DeviceMesh.from_group(groups, "cpu", mesh=[[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    assert again == mesh and again.get_all_groups() == groups
    whole = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    assert whole.ranks == (0, 1, 2, 3) and whole.get_group() is dist.group.WORLD
    x = distribute_tensor(torch.arange(4.0), whole, [Shard(0)])
    assert torch.equal(x.full_tensor(), torch.arange(4.0))
    with pytest.raises(MeshError, match=r"group 0 has ranks \[\d, \d\], but this rank's line"):
        DeviceMesh.from_group(groups[::-1], "cpu", mesh=[[0, 1], [2, 3]])
    with pytest.raises(MeshError, match="2 groups need mesh="):
        DeviceMesh.from_group(groups, "cpu")
    with pytest.raises(MeshError, match="got 1 groups for a 2-D mesh"):
        DeviceMesh.from_group([groups[0]], "cpu", mesh=[[0, 1], [2, 3]])
    # Outsiders of a group: an error without mesh=, an outsider mesh with it.
    pair = DeviceMesh("cpu", [0, 1])
    if world.rank >= 2:
        with pytest.raises(MeshError, match="is not in the group; pass mesh="):
            DeviceMesh.from_group(pair.get_group(), "cpu")
        out = DeviceMesh.from_group(pair.get_group(), "cpu", mesh=[0, 1])
        assert out.get_coordinate() is None and out.get_all_groups() == [None]
    else:
        assert DeviceMesh.from_group(pair.get_group(), "cpu").get_group() is pair.get_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.world_size(2)
def test_cuda_mesh_on_a_cpu_only_machine_is_our_error_on_every_rank(world) -> None:
    for build in (
        lambda: DeviceMesh("cuda", [0, 1]),
        lambda: init_device_mesh("cuda", (2,)),
    ):
        with pytest.raises(MeshError, match=r"no cuda device .*use 'cpu'") as e:
            build()
        assert isinstance(e.value, RuntimeError)
    with pytest.raises(MeshError, match="a type, no index"):
        DeviceMesh("cuda:0", [0, 1])
    with pytest.raises(MeshError, match="unknown device_type 'tpu'"):
        DeviceMesh("tpu", [0, 1])


def _rebuilt_2x2(world, before, after: str):
    """The 2x2 ("dp", "tp") mesh built again; it must reuse the groups in
    ``before``. The ranks vote before any collective on it, so a failure on
    some ranks fails every rank instead of hanging the others."""
    again, problem = None, None
    try:
        again = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        same = [a is b for a, b in zip(again.get_all_groups(), before, strict=True)]
        problem = None if all(same) else f"groups per axis reused: {same}"
    except Exception as e:  # any error: every rank must reach the vote below
        problem = repr(e)
    votes = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(votes, torch.tensor([float(problem is not None)]))
    bad = [r for r, v in enumerate(votes) if v.item()]
    assert not bad, (f"rebuilding the 2x2 mesh after ranks 0-1 {after} failed on ranks "
                     f"{bad}; here (rank {world.rank}): {problem}")
    return again


@pytest.mark.world_size(4)
@pytest.mark.dist_timeout(120)
def test_destroying_one_group_keeps_the_worlds_other_groups(world) -> None:
    # Ranks 0-1 destroy the group of a mesh only they use. They must keep the
    # world's other groups: forgetting them made the rebuilt 2x2 mesh below
    # re-create its groups by their (still registered) names on ranks 0-1
    # (c10d: "group name has already been created") while ranks 2-3, who kept
    # theirs, went on into the next collective and waited there for good: the
    # shape of the torchrun hang of the flatten property.
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    before = mesh.get_all_groups()
    if world.rank in (0, 1):
        pair = DeviceMesh("cpu", [1, 0])  # a group no other mesh here uses
        dist.destroy_process_group(pair.get_group())
    again = _rebuilt_2x2(world, before, "destroyed their pair group")
    x = distribute_tensor(torch.arange(8.0), again["dp", "tp"]._flatten("dp_tp"), [Shard(0)])
    assert torch.equal(x.full_tensor(), torch.arange(8.0))
    if world.rank in (0, 1):
        # The destroyed group's ranks get a new, working group (a fresh name:
        # Gloo would otherwise meet the old group's addresses in the store).
        pair = DeviceMesh("cpu", [1, 0])
        t = torch.tensor([float(world.rank + 1)])
        dist.all_reduce(t, group=pair.get_group())
        assert t.item() == 3.0


@pytest.mark.world_size(4)
def test_a_sub_world_swapped_in_and_out_leaves_the_worlds_groups_alone(world) -> None:
    # Under torchrun the test service runs 2-rank tests on ranks 0-1 by
    # swapping a 2-rank sub-world into c10d (launch/rank/subworld.py) and back.
    # Ranks 0-1 must come back to the 4-rank world's groups as they left them:
    # a hook that took the swapped-out world for a destroyed one dropped them
    # there only, and the flatten property hung (ranks 0-1 failed re-creating
    # groups by their registered names, ranks 2-3 waited in a broadcast).
    from launch.rank.subworld import create

    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    before = mesh.get_all_groups()
    stamp = torch.tensor([time.time_ns()])  # store keys of this run's sub-world only
    dist.broadcast(stamp, 0)
    if world.rank in (0, 1):
        sub = create(2, f"test_mesh_dist/{stamp.item()}/")
        with sub.entered():
            inner = DeviceMesh("cpu", [1, 0])
            t = torch.tensor([1.0])
            dist.all_reduce(t, group=inner.get_group())
            assert t.item() == 2.0
    again = _rebuilt_2x2(world, before, "visited a sub-world")
    flat = again["tp", "dp"]._flatten("tp_dp")
    x = distribute_tensor(torch.arange(8.0), flat, [Shard(0)])
    assert torch.equal(x.full_tensor(), torch.arange(8.0))


def test_unravel_is_row_major_and_refuses_indices_outside_the_mesh() -> None:
    """dtensor.mesh.unravel: integer math (torch.unravel_index imported
    sympy), equal to torch's on every index of several shapes; an index
    outside the mesh names the shape and the valid range."""
    import math

    from dtensor.mesh import unravel

    for shape in [(1,), (4,), (2, 3), (2, 2, 2), (3, 1, 4), (2, 3, 4, 2)]:
        for flat in range(math.prod(shape)):
            want = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape))
            assert unravel(flat, shape) == want, (flat, shape)
    for bad in (-1, 6):
        with pytest.raises(MeshError, match=r"outside a mesh of shape \(2, 3\).*0 <= index < 6"):
            unravel(bad, (2, 3))
