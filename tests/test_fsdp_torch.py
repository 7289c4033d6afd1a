"""Covers: dtensor/fsdp/ against ``torch.distributed.fsdp.fully_shard`` on
PyTorch's DTensor: the same model, mesh, seed and data, sharded per block then
at the root by each runtime (FSDP on 2 ranks, HSDP on 2x2, FSDP over tensor
parallelism on 2x2 with colwise/rowwise plans), trained with AdamW: losses,
every step's gradients and the final parameters agree."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dtensor import DeviceMesh, DTensor

STEPS = 3


def _model() -> nn.Sequential:
    """Two blocks (6 -> 10 -> 6): 5-row TP blocks cut 3 + 2 by FSDP on 2."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 6))
                           for _ in range(2)))


def _shard(model, fully_shard, dp_mesh, tp_mesh=None, parallelize=None):
    if tp_mesh is not None:
        styles = parallelize
        plan = {f"{i}.0": styles.ColwiseParallel() for i in range(2)}
        plan |= {f"{i}.2": styles.RowwiseParallel() for i in range(2)}
        styles.parallelize_module(model, tp_mesh, plan)
    for block in model:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model, rank: int, size: int):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    data = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for _ in range(STEPS):
        x = torch.randn(8, 6, generator=data).chunk(size)[rank]
        loss = model(x).pow(2).mean()
        loss.backward()
        losses.append(float(loss))
        grads.append({n: _full(p.grad).clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    final = {n: _full(p.detach()) for n, p in model.named_parameters()}
    return losses, grads, final


def _compare(ours, theirs, dp_rank: int, dp_size: int) -> None:
    got, want = _train(ours, dp_rank, dp_size), _train(theirs, dp_rank, dp_size)
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    for step, (g, w) in enumerate(zip(got[1], want[1], strict=True)):
        assert g.keys() == w.keys()
        for k in w:
            torch.testing.assert_close(g[k], w[k], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, step=step: f"grad {k} {step}: {m}")
    for k in want[2]:
        torch.testing.assert_close(got[2][k], want[2][k], rtol=1e-5, atol=1e-6)


@pytest.mark.world_size(2)
def test_fsdp_matches_pytorch_fully_shard(world) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from dtensor.fsdp import fully_shard

    ref = _model()
    ours = _shard(copy.deepcopy(ref), fully_shard, DeviceMesh("cpu", [0, 1]))
    theirs = _shard(copy.deepcopy(ref), torch_fully_shard, init_device_mesh("cpu", (2,)))
    assert isinstance(ours[0][0].weight, DTensor)
    _compare(ours, theirs, world.rank, 2)


@pytest.mark.world_size(4)
def test_hsdp_matches_pytorch_fully_shard(world) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from dtensor.fsdp import fully_shard

    names = ("replicate", "shard")
    ref = _model()
    ours = _shard(copy.deepcopy(ref), fully_shard,
                  DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=names))
    theirs = _shard(copy.deepcopy(ref), torch_fully_shard,
                    init_device_mesh("cpu", (2, 2), mesh_dim_names=names))
    _compare(ours, theirs, world.rank, 4)


@pytest.mark.world_size(4)
def test_fsdp_over_tensor_parallel_matches_pytorch(world) -> None:
    import torch.distributed.tensor.parallel as torch_tp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import dtensor.parallel as our_tp
    from dtensor.fsdp import fully_shard

    names = ("dp", "tp")
    ref = _model()
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=names)
    tmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    ours = _shard(copy.deepcopy(ref), fully_shard, mesh["dp"], mesh["tp"], our_tp)
    theirs = _shard(copy.deepcopy(ref), torch_fully_shard, tmesh["dp"], tmesh["tp"], torch_tp)
    dp_rank = mesh.get_coordinate()[0]
    _compare(ours, theirs, dp_rank, 2)
