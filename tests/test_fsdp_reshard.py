"""Covers: dtensor/fsdp/ with dtensor/checkpoint.py: a DCP checkpoint of the
model and AdamW state saved with FSDP over tensor parallelism (2 x 2, the TP
blocks cut again by FSDP) loads into FSDP on 4 ranks, and one saved there
loads back into FSDP + TP; each resumed run continues with the uninterrupted
single-device run's gradients and parameters."""

from __future__ import annotations

import copy
import pathlib
import sys

import pytest
import torch

from dtensor import DeviceMesh, Shard
from dtensor.fsdp import fully_shard

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_fsdp_torch import _model, _shard  # the two-block model and its sharding

BATCH = 8


class _Run:
    """A sharded model, its AdamW, and the batch rows of its data-parallel rank."""

    def __init__(self, model, dp_rank: int, dp_size: int) -> None:
        self.model, self.dp_rank, self.dp_size = model, dp_rank, dp_size
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                                     foreach=True)

    def step(self, x, ref=None, ref_opt=None) -> None:
        self.model(x.chunk(self.dp_size)[self.dp_rank]).pow(2).mean().backward()
        if ref is not None:
            ref(x).pow(2).mean().backward()
            for (name, p), q in zip(self.model.named_parameters(), ref.parameters(),
                                    strict=True):
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5,
                                           atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
            ref_opt.step()
            ref_opt.zero_grad()
        self.opt.step()
        self.opt.zero_grad()

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


def _fsdp_tp(ref):
    import dtensor.parallel as tp

    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    model = _shard(copy.deepcopy(ref), fully_shard, mesh["dp"], mesh["tp"], tp)
    return _Run(model, mesh.get_coordinate()[0], 2)


def _fsdp4(ref):
    mesh = DeviceMesh("cpu", [0, 1, 2, 3], mesh_dim_names=("dp",))
    return _Run(_shard(copy.deepcopy(ref), fully_shard, mesh), mesh.get_rank(), 4)


def _resume(make, path, saved: list):
    """A fresh run from other initial values, its AdamW state created by one
    step, then filled from the checkpoint at ``path`` (``saved``: the saving
    run's full parameters)."""
    import dtensor.checkpoint as ckpt

    torch.manual_seed(5)  # other initial values: the checkpoint must win
    run = make(_model())
    run.step(torch.zeros(BATCH, 6))
    sd = run.state()
    ckpt.load(sd, path)
    run.model.load_state_dict(sd["model"])
    run.opt.load_state_dict(sd["optim"])
    for p, q in zip(run.model.parameters(), saved, strict=True):
        assert torch.equal(p.detach().full_tensor(), q)  # loaded exactly
    return run


def _full(run) -> list:
    return [p.detach().full_tensor() for p in run.model.parameters()]


@pytest.mark.world_size(4)
def test_dcp_from_fsdp_over_tp_to_fsdp_on_4_and_back(world, shared_dir) -> None:
    import dtensor.checkpoint as ckpt

    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(BATCH, 6, generator=g) for _ in range(5)]
    run = _fsdp_tp(ref)
    w = run.model[0][0].weight
    assert w.device_mesh.mesh_dim_names == ("tp", "dp") and len(w.placements) == 2
    for x in data[:2]:
        run.step(x, ref, ref_opt)
    with shared_dir() as first, shared_dir() as second:
        ckpt.save(run.state(), first)
        run4 = _resume(_fsdp4, first, _full(run))
        assert run4.model[0][0].weight.placements == (Shard(0),)
        run4.step(data[2], ref, ref_opt)
        ckpt.save(run4.state(), second)
        back = _resume(_fsdp_tp, second, _full(run4))
        for x in data[3:]:
            back.step(x, ref, ref_opt)
    for p, q in zip(back.model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), rtol=1e-5, atol=1e-6)
