"""Covers: dtensor/checkpoint.py (DCP save/load with resharding) on Gloo worlds.

Every test saves and loads inside one world (a shared directory made by the
test's first rank and sent to the others), so it runs the same under plain
``pytest`` and under ``torchrun -m pytest``. Loads on fewer ranks use a
sub-mesh: the other ranks do not take part.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dtensor.checkpoint as ckpt
from dtensor import (
    DeviceMesh,
    Partial,
    PlacementError,
    Replicate,
    Shard,
    distribute_tensor,
)

# Even, uneven in one dim, uneven in both, 1-D with an empty trailing shard.
SHAPES = {"even": (8, 6), "uneven": (7, 5), "odd2d": (5, 3), "vec": (3,)}


def _reference() -> dict[str, torch.Tensor]:
    # Distinct values everywhere, so a misplaced block cannot compare equal.
    return {
        k: torch.arange(1, 1 + torch.Size(s).numel(), dtype=torch.float32).reshape(s)
        * (i + 1)
        for i, (k, s) in enumerate(SHAPES.items())
    }


def _blank(mesh: DeviceMesh, placements_for) -> dict:
    return {
        k: distribute_tensor(torch.full(s, -1.0), mesh, placements_for(len(s)))
        for k, s in SHAPES.items()
    }


def _check_every_element(sd: dict, ref: dict) -> None:
    for k, want in ref.items():
        got = sd[k]
        if got.device_mesh.get_coordinate() is None:
            continue
        assert torch.equal(got.full_tensor(), want), k


def _save_4_shard0(path: str) -> dict:
    ref = _reference()
    mesh4 = DeviceMesh("cpu", [0, 1, 2, 3])
    sd = {k: distribute_tensor(v, mesh4, [Shard(0)]) for k, v in ref.items()}
    sd["step"] = 7
    ckpt.save(sd, path)
    return ref


@pytest.mark.world_size(4)
def test_save_4_ranks_shard0_load_2_ranks_replicated(world, shared_dir) -> None:
    with shared_dir() as path, ckpt.object_collectives_without_numpy():
        ref = _save_4_shard0(path)
        mesh2 = DeviceMesh("cpu", [0, 1])
        sd = _blank(mesh2, lambda nd: [Replicate()])
        sd["step"] = 0
        ckpt.load(sd, path)  # ranks 2 and 3 return at once
        if world.rank in (0, 1):
            _check_every_element(sd, ref)
            assert sd["step"] == 7
            for k in SHAPES:  # every element is on this rank, not just gathered
                assert torch.equal(sd[k].to_local(), ref[k])


@pytest.mark.world_size(4)
def test_save_4_ranks_shard0_load_2x2_mesh_shard0_shard1(world, shared_dir) -> None:
    with shared_dir() as path, ckpt.object_collectives_without_numpy():
        ref = _save_4_shard0(path)
        mesh22 = DeviceMesh("cpu", [[0, 1], [2, 3]])
        sd = _blank(mesh22, lambda nd: [Shard(0), Shard(1)] if nd == 2 else [Shard(0), Shard(0)])
        ckpt.load(sd, path)
        _check_every_element(sd, ref)
        for k in SHAPES:  # this rank's block is its own piece of the reference
            size, offset = sd[k]._spec.local_block(mesh22.get_coordinate())
            want = ref[k]
            for d, (o, n) in enumerate(zip(offset, size, strict=True)):
                want = want.narrow(d, o, n)
            assert torch.equal(sd[k].to_local(), want), k


@pytest.mark.world_size(4)
def test_plain_dcp_over_the_world_with_a_sub_mesh_and_an_outsider(world, shared_dir) -> None:
    # dcp.save/load called by every rank of the world; rank 0 is outside the
    # mesh and writes and reads nothing for it.
    ref = _reference()
    with shared_dir() as path, ckpt.object_collectives_without_numpy():
        mesh3 = DeviceMesh("cpu", [1, 2, 3])
        sd = {k: distribute_tensor(v, mesh3, [Shard(0)]) for k, v in ref.items()}
        dcp.save(sd, checkpoint_id=path, process_group=world.group)
        mesh4 = DeviceMesh("cpu", [3, 2, 1, 0])
        back = _blank(mesh4, lambda nd: [Shard(nd - 1)])
        dcp.load(back, checkpoint_id=path, process_group=world.group)
        _check_every_element(back, ref)


@pytest.mark.world_size(4)
def test_sub_mesh_checkpoint_needs_only_its_ranks(world, shared_dir) -> None:
    # Saved by ranks 2, 3 only, loaded by ranks 0, 1 only: ckpt.save/load
    # run DCP over the meshes' ranks, so each pair runs alone.
    ref = _reference()
    with shared_dir() as path, ckpt.object_collectives_without_numpy():
        if world.rank in (2, 3):
            mesh = DeviceMesh("cpu", [2, 3])
            ckpt.save({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in ref.items()}, path)
        dist.barrier(group=world.group)
        if world.rank in (0, 1):
            mesh = DeviceMesh("cpu", [1, 0])
            sd = _blank(mesh, lambda nd: [Shard(nd - 1)])
            ckpt.load(sd, path)
            _check_every_element(sd, ref)


@pytest.mark.world_size(2)
def test_module_state_dict_round_trip_resumes_parameters(world, shared_dir) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    torch.manual_seed(0)
    src = torch.nn.Linear(5, 3)
    with torch.no_grad():
        src.weight.copy_(torch.arange(15.0).reshape(3, 5))
    dst = torch.nn.Linear(5, 3)
    for mod, pl in ((src, [Shard(0)]), (dst, [Shard(1)])):
        for name, p in list(mod.named_parameters()):
            layout = pl if p.ndim == 2 else [Replicate()]
            setattr(mod, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, layout)))
    with shared_dir() as path, ckpt.object_collectives_without_numpy():
        ckpt.save(src.state_dict(), path)
        ckpt.load(dst.state_dict(), path)  # in place: the parameters change
    assert torch.equal(dst.weight.full_tensor(), src.weight.full_tensor())
    assert torch.equal(dst.bias.full_tensor(), src.bias.full_tensor())
    assert dst.weight.placements == (Shard(1),)


@pytest.mark.world_size(2)
def test_partial_is_refused_on_every_rank_as_a_value_error(world, shared_dir) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    p = distribute_tensor(torch.ones(4), mesh, [Partial()])
    with shared_dir() as path, ckpt.object_collectives_without_numpy():
        with pytest.raises(ValueError, match="Partial"):
            ckpt.save({"p": p}, path)
        with pytest.raises(PlacementError, match="reduce it first"):
            ckpt.load({"p": p}, path)


@pytest.mark.world_size(2)
def test_a_failure_on_one_rank_fails_every_rank_instead_of_blocking(world, shared_dir) -> None:
    # Rank 1's state dict holds a Partial: before, rank 1 raised and rank 0
    # waited in DCP's first collective until killed.
    mesh = DeviceMesh("cpu", [0, 1])
    placements = [Partial()] if world.rank == 1 else [Replicate()]
    sd = {"p": distribute_tensor(torch.ones(4), mesh, placements)}
    with shared_dir() as path, ckpt.object_collectives_without_numpy():
        for call in (ckpt.save, ckpt.load):
            if world.rank == 1:
                with pytest.raises(PlacementError, match="reduce it first"):
                    call(sd, path)
            else:
                with pytest.raises(ckpt.CheckpointError, match="rank 1 failed before") as e:
                    call(sd, path)
                assert isinstance(e.value, RuntimeError)


def test_numpy_is_declared_for_torchs_dcp() -> None:
    # torch's DCP decodes its object collectives with numpy, which torch does
    # not declare: README's install must bring it.
    import pathlib

    import tomllib

    pyproject = pathlib.Path(__file__).parents[1] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in deps), deps


@pytest.mark.world_size(2)
def test_shape_mismatch_on_load_fails_on_every_rank(world, shared_dir) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    with shared_dir() as path, ckpt.object_collectives_without_numpy():
        ckpt.save({"w": distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])}, path)
        wrong = {"w": distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])}
        with pytest.raises(dcp.api.CheckpointException, match="Size mismatch"):
            ckpt.load(wrong, path)


def _model(mesh: DeviceMesh, weight_layout) -> torch.nn.Linear:
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 5)
    with torch.no_grad():
        lin.weight.copy_(torch.arange(15.0).reshape(5, 3) / 10)
    lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, weight_layout))
    lin.bias = torch.nn.Parameter(distribute_tensor(lin.bias.detach(), mesh, [Replicate()]))
    return lin


@pytest.mark.world_size(4)
def test_adam_state_resumes_on_fewer_ranks_with_another_layout(world, shared_dir) -> None:
    # torch's get_state_dict/set_state_dict give FQN-keyed optimizer state;
    # its DTensor moments reshard like the parameters.
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def step(model, opt, mesh):
        x = distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Replicate()])
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    mesh4 = DeviceMesh("cpu", [0, 1, 2, 3])
    a = _model(mesh4, [Shard(0)])  # 5 rows on 4 ranks: uneven
    opt_a = torch.optim.Adam(a.parameters(), lr=0.1)
    step(a, opt_a, mesh4)
    with shared_dir() as path, ckpt.object_collectives_without_numpy():
        msd, osd = get_state_dict(a, opt_a)
        ckpt.save({"model": msd, "optim": osd}, path)
        step(a, opt_a, mesh4)  # the uninterrupted run's second step
        want = {  # gathered by all 4 ranks
            (name, k): (getattr(a, name) if k is None else opt_a.state[getattr(a, name)][k])
            .full_tensor()
            for name in ("weight", "bias")
            for k in (None, "exp_avg", "exp_avg_sq")
        }
        if world.rank in (0, 1):  # ranks 2 and 3 take no part from here
            mesh2 = DeviceMesh("cpu", [0, 1])
            b = _model(mesh2, [Replicate()])
            opt_b = torch.optim.Adam(b.parameters(), lr=0.1)
            msd_b, osd_b = get_state_dict(b, opt_b)
            sd = {"model": msd_b, "optim": osd_b}
            ckpt.load(sd, path)
            set_state_dict(b, opt_b, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            step(b, opt_b, mesh2)  # the resumed run's second step
            for (name, k), value in want.items():
                p = getattr(b, name)
                got = p if k is None else opt_b.state[p][k]
                torch.testing.assert_close(got.full_tensor(), value, msg=f"{name} {k}")
                assert float(opt_b.state[p]["step"]) == 2.0


@pytest.mark.world_size(4)
def test_replicas_are_written_once_and_load_on_a_one_rank_sub_mesh(world, shared_dir) -> None:
    ref = _reference()
    with shared_dir() as path, ckpt.object_collectives_without_numpy():
        mesh22 = DeviceMesh("cpu", [[0, 1], [2, 3]])
        sd = {k: distribute_tensor(v, mesh22, [Replicate(), Shard(v.ndim - 1)])
              for k, v in ref.items()}
        ckpt.save(sd, path)
        md = dcp.FileSystemReader(path).read_metadata()
        for k, v in ref.items():
            chunks = md.state_dict_metadata[k].chunks
            # one chunk per distinct block (replicas deduplicated), covering it all
            assert sum(math.prod(c.sizes) for c in chunks) == v.numel(), k
        one = DeviceMesh("cpu", [3])
        back = _blank(one, lambda nd: [Replicate()])
        ckpt.load(back, path)  # only rank 3 reads
        _check_every_element(back, ref)
