"""Covers: dtensor/fsdp/ with examples/llama_fsdp_tp.py: the torchtitan-style
Llama built on the meta device, sharded per block then at the root, trained with
AdamW: FSDP on 2 and 4 ranks, HSDP (2 x 2) and FSDP over tensor parallelism
(2 x 2, sequence parallel plan) give the single-device losses and gradients at
every step; FSDP, HSDP and FSDP over TP give the losses and gradients of the
same example files run on PyTorch's DTensor, ``parallelize_module`` and
``fully_shard`` (only their imports swapped)."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys

import pytest
import torch

import dtensor
from dtensor import DeviceMesh, Replicate, Shard

_DIR = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return sys.modules[name]


llama = _load("llama_tp")
example = _load("llama_fsdp_tp")

# The same two example files on PyTorch's DTensor: only their imports change
# (the project's drop-in claim), so PyTorch's parallelize_module, styles,
# loss_parallel and fully_shard run the very model and training loop.
_TORCH_IMPORTS = {
    "from dtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, init_device_mesh":
        "from torch.distributed.tensor import DTensor, Partial, Replicate, Shard\n"
        "from torch.distributed.device_mesh import DeviceMesh, init_device_mesh",
    "from dtensor.parallel import (":
        "from torch.distributed.tensor.parallel import (",
    "from dtensor import DeviceMesh, DTensor, init_device_mesh":
        "from torch.distributed.tensor import DTensor\n"
        "from torch.distributed.device_mesh import DeviceMesh, init_device_mesh",
    "from dtensor.fsdp import fully_shard": "from torch.distributed.fsdp import fully_shard",
    "from dtensor.parallel import loss_parallel":
        "from torch.distributed.tensor.parallel import loss_parallel",
    "import llama_tp as llama": "import torch_llama_tp as llama",
}


def _load_on_torch(name: str):
    text = (_DIR / f"{name}.py").read_text()
    for ours, theirs in _TORCH_IMPORTS.items():
        text = text.replace(ours, theirs)
    mod = type(sys)(f"torch_{name}")
    mod.__file__ = str(_DIR / f"{name}.py")
    sys.modules[mod.__name__] = mod
    exec(compile(text, mod.__file__, "exec"), mod.__dict__)
    return mod
STEPS = 5


def _recorder(store: list):
    def hook(model):
        # PyTorch's DTensor too (the comparison with its fully_shard)
        store.append({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                      for n, p in model.named_parameters()})
    return hook


def _check(mesh, dp_mesh, tp: bool, dropout: float = 0.0, **kw):
    args = llama.ModelArgs(dropout=dropout)
    data = llama.batches(args, STEPS, batch=4)
    ref_grads, grads = [], []
    dtensor.random.manual_seed(0)
    ref = llama.build_reference(args)
    ref_losses = example.train(ref, data, None, grad_hook=_recorder(ref_grads), clip=1.0)
    dtensor.random.manual_seed(0)
    model = example.build(args, mesh, tp, **kw)
    losses = example.train(model, data, dp_mesh, grad_hook=_recorder(grads), clip=1.0)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    _same_grads(grads, ref_grads)
    return model


def _same_grads(grads, want_grads) -> None:
    for step, (got, want) in enumerate(zip(grads, want_grads, strict=True)):
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=2e-5, rtol=1e-4,
                                       msg=lambda m, k=k, step=step: f"grad {k} step {step}: {m}")


@pytest.mark.dist_timeout(600)
@pytest.mark.parametrize("n", [
    pytest.param(2, marks=pytest.mark.world_size(2), id="w2"),
    pytest.param(4, marks=[pytest.mark.world_size(4), pytest.mark.slow], id="w4"),
])
def test_llama_fsdp_trains_like_single_device(world, n) -> None:
    mesh = DeviceMesh("cpu", list(range(n)), mesh_dim_names=("dp",))
    model = _check(mesh, mesh, False)
    assert model.layers["0"].attention.wq.weight.placements == (Shard(0),)


@pytest.mark.slow  # 4 ranks on 2 cores: the three tests of this file took 50 s together
@pytest.mark.dist_timeout(600)
@pytest.mark.world_size(4)
def test_llama_fsdp_over_tensor_parallel_trains_like_single_device(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    model = _check(mesh, mesh["dp"], True)
    wq = model.layers["0"].attention.wq.weight  # colwise: TP and FSDP both cut rows
    assert wq.device_mesh.mesh_dim_names == ("tp", "dp")
    assert wq.placements == (Shard(0), Shard(0))
    assert model.layers["0"].attention.wo.weight.placements == (Shard(1), Shard(0))
    assert model.norm.weight.placements == (Replicate(), Shard(0))


@pytest.mark.dist_timeout(600)
@pytest.mark.world_size(2)
def test_llama_fsdp_with_dropout_trains_like_single_device(world) -> None:
    # each rank's masks are its rows of the whole batch's single-device masks
    mesh = DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp",))
    _check(mesh, mesh, False, dropout=0.1)


@pytest.mark.slow
@pytest.mark.dist_timeout(600)
@pytest.mark.world_size(4)
def test_llama_fsdp_over_tensor_parallel_with_dropout_trains_like_single_device(world) -> None:
    # sequence-parallel dropout draws on DTensors of the tp axis: their blocks
    # move down by the rows of the data-parallel ranks before this one
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    _check(mesh, mesh["dp"], True, dropout=0.1)


@pytest.mark.slow
@pytest.mark.dist_timeout(600)
@pytest.mark.world_size(4)
def test_llama_hsdp_trains_like_single_device(world) -> None:
    # HSDP: parameters sharded over "shard", replicated over "replicate";
    # each of the 4 ranks trains on its quarter of the batch (replica-major).
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("replicate", "shard"))
    model = _check(mesh, mesh, False)
    wq = model.layers["0"].attention.wq.weight
    assert wq.device_mesh.mesh_dim_names == ("replicate", "shard")
    assert wq.placements == (Replicate(), Shard(0))


@pytest.mark.dist_timeout(600)
@pytest.mark.parametrize("shape", [
    pytest.param((2,), marks=pytest.mark.world_size(2), id="fsdp2"),
    pytest.param((2, 2), marks=[pytest.mark.world_size(4), pytest.mark.slow], id="hsdp2x2"),
])
def test_llama_fsdp_matches_pytorch_fully_shard(world, shape) -> None:
    # The same Llama, seed and batches under PyTorch's fully_shard on its own
    # DTensor (FSDP, and HSDP on a 2-D mesh): losses and every step's
    # gradients agree with ours.
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    args = llama.ModelArgs()
    data = llama.batches(args, STEPS, batch=4)
    names = ("replicate", "dp")[-len(shape):]
    mesh = DeviceMesh("cpu", torch.arange(math.prod(shape)).view(shape).tolist(),
                      mesh_dim_names=names)
    dtensor.random.manual_seed(0)
    theirs = copy.deepcopy(llama.build_reference(args))
    tmesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for layer in theirs.layers.values():
        torch_fully_shard(layer, mesh=tmesh)
    torch_fully_shard(theirs, mesh=tmesh)
    their_grads, grads = [], []
    want = example.train(theirs, data, mesh, grad_hook=_recorder(their_grads), clip=1.0)
    dtensor.random.manual_seed(0)
    ours = example.build(args, mesh, False)
    got = example.train(ours, data, mesh, grad_hook=_recorder(grads), clip=1.0)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    _same_grads(grads, their_grads)


@pytest.mark.slow
@pytest.mark.dist_timeout(600)
@pytest.mark.world_size(4)
def test_llama_fsdp_over_tensor_parallel_matches_pytorch(world) -> None:
    # FSDP + TP (2 x 2, sequence parallel plan) of the example, ours against the
    # same files run on PyTorch's DTensor, parallelize_module and fully_shard:
    # losses and every step's gradients agree.
    from torch.distributed.device_mesh import init_device_mesh

    their_llama = _load_on_torch("llama_tp")
    their_example = _load_on_torch("llama_fsdp_tp")
    args = llama.ModelArgs()
    data = llama.batches(args, STEPS, batch=4)
    dtensor.random.manual_seed(0)
    ref = llama.build_reference(args)
    tmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    theirs = their_llama.Transformer(args)
    theirs.load_state_dict(ref.state_dict())
    their_llama.parallelize(theirs, tmesh["tp"], True)
    for layer in theirs.layers.values():
        their_example.fully_shard(layer, mesh=tmesh["dp"])
    their_example.fully_shard(theirs, mesh=tmesh["dp"])
    their_grads, grads = [], []
    want = their_example.train(theirs, data, tmesh["dp"], grad_hook=_recorder(their_grads),
                               clip=1.0)
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    dtensor.random.manual_seed(0)
    ours = example.build(args, mesh, True)
    got = example.train(ours, data, mesh["dp"], grad_hook=_recorder(grads), clip=1.0)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    _same_grads(grads, their_grads)
