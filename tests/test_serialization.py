"""Covers: dtensor/checkpoint.py (torch.save / torch.load of DTensors) on Gloo worlds."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from dtensor import (
    DeviceMesh,
    Partial,
    Replicate,
    Shard,
    ShardingError,
    distribute_tensor,
)
from dtensor.checkpoint import rebuild_dtensor


def _round_trip(obj, **load_kwargs):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, **load_kwargs)


def _same(a, b) -> None:
    assert type(b) is type(a)
    assert b._spec == a._spec and b.placements == a.placements
    assert b.device_mesh == a.device_mesh
    assert torch.equal(b.to_local(), a.to_local())
    assert b.requires_grad == a.requires_grad


def test_weights_only_load_in_one_process() -> None:
    mesh = DeviceMesh("cpu", [0], mesh_dim_names=("dp",))
    x = distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Shard(1)])
    y = x.clone().requires_grad_()
    back = _round_trip({"x": x, "y": y, "n": 3}, weights_only=True)
    _same(x, back["x"])
    _same(y, back["y"])
    assert back["y"].is_leaf and back["n"] == 3


def test_rebuild_refuses_an_unknown_placement_code() -> None:
    with pytest.raises(ShardingError, match="unknown placement code"):
        rebuild_dtensor(torch.ones(2), "cpu", (0,), (1,), None, (("X", 1),), (2,), (1,), False)


@pytest.mark.world_size(2)
def test_each_rank_saves_and_loads_its_block_weights_only(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("dp", "tp"))
    full = torch.arange(35.0).reshape(7, 5)  # uneven over 2 ranks
    for placements in ([Replicate(), Shard(0)], [Replicate(), Shard(1)], [Replicate(), Partial()]):
        x = distribute_tensor(full, mesh, placements)
        back = _round_trip(x, weights_only=True)
        _same(x, back)
        assert torch.equal(back.full_tensor(), full)


@pytest.mark.world_size(2)
def test_module_state_dict_round_trip(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    for mod, pl in ((model[0], [Shard(0)]), (model[2], [Shard(1)])):
        for name, p in list(mod.named_parameters()):
            layout = pl if p.ndim == 2 else [Replicate()]
            setattr(mod, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, layout)))
    sd = _round_trip(model.state_dict(), weights_only=True)
    assert list(sd) == list(ref)
    for k, v in model.state_dict().items():
        _same(v, sd[k])
        assert torch.equal(sd[k].full_tensor(), ref[k])
    # The loaded state dict goes back into a model with DTensor parameters.
    model.load_state_dict(sd)
    assert torch.equal(model[0].weight.full_tensor(), ref["0.weight"])


@pytest.mark.world_size(2)
def test_rank_outside_the_mesh_saves_and_loads_an_empty_block(world) -> None:
    mesh = DeviceMesh("cpu", [1])
    x = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    back = _round_trip(x, weights_only=True)
    _same(x, back)
    if world.rank == 0:
        assert back.to_local().numel() == 0
    else:
        assert torch.equal(back.to_local(), torch.arange(4.0))


@pytest.mark.world_size(2)
def test_pickle_round_trip_keeps_the_mesh(world) -> None:
    mesh = DeviceMesh("cpu", [1, 0])
    x = distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])
    _same(x, pickle.loads(pickle.dumps(x)))


@pytest.mark.slow  # a fresh process (~15 s on 2 cores): the full run
def test_weights_only_load_in_a_fresh_process_needs_import_dtensor(tmp_path) -> None:
    # As with PyTorch's DTensor (which needs `import torch.distributed.tensor`),
    # a weights_only load needs our package imported first: importing it
    # allowlists the one rebuild function; nothing else is ever allowlisted.
    import subprocess
    import sys

    mesh = DeviceMesh("cpu", [0])
    path = tmp_path / "x.pt"
    x = distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Shard(0)])
    torch.save({"x": x}, path)  # under torchrun, ranks other than 0 save an empty block
    script = (
        "import sys, torch\n"
        f"path = {str(path)!r}\n"
        "try:\n"
        "    torch.load(path, weights_only=True)\n"
        "    print('loaded without import')\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, 'dtensor.tensor.rebuild_dtensor' in str(e))\n"
        "assert 'dtensor' not in sys.modules\n"
        "import dtensor\n"
        "x = torch.load(path, weights_only=True)['x']\n"
        "print(type(x).__name__, x.placements, x.to_local().tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [
        "UnpicklingError True",
        f"DTensor (Shard(dim=0),) {x.to_local().tolist()}",
    ]
