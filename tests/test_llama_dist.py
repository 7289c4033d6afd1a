"""Covers: examples/llama_tp.py with dtensor/parallel/: a torchtitan-style Llama
(vocab-parallel embedding, RMSNorm, rotary attention, SwiGLU MLP, output
projection, loss_parallel) trained 20 AdamW steps with tensor parallelism on 2
and 4 ranks, with and without sequence parallelism and dropout, and 2-D
(dp x tp) on 4: losses and gradients equal single-device training."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

import dtensor
from dtensor import DeviceMesh, DTensor, Shard

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "llama_tp.py"
_spec = importlib.util.spec_from_file_location("llama_tp", _PATH)
llama = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("llama_tp", llama)  # dataclasses look their module up
_spec.loader.exec_module(llama)

STEPS = 20


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _recorder(store: list):
    def hook(model):
        store.append({n: _full(p.grad).clone() for n, p in model.named_parameters()})
    return hook


def _run(args, tp_mesh, dp_mesh, sequence_parallel):
    data = llama.batches(args, STEPS, batch=2)
    ref_grads, grads = [], []
    dtensor.random.manual_seed(0)
    ref = llama.build_reference(args)
    ref_losses = llama.train(ref, data, grad_hook=_recorder(ref_grads))
    dtensor.random.manual_seed(0)
    model = llama.build_parallel(args, tp_mesh, sequence_parallel)
    losses = llama.train(model, data, dp_mesh=dp_mesh, grad_hook=_recorder(grads))
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    for step, (got, want) in enumerate(zip(grads, ref_grads, strict=True)):
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=2e-5, rtol=1e-4,
                                       msg=lambda m, k=k, step=step: f"grad {k} step {step}: {m}")
    return model, ref


CASES = [
    pytest.param(2, True, 0.1, marks=pytest.mark.world_size(2), id="w2-sp-dropout"),
    pytest.param(2, False, 0.1, marks=pytest.mark.world_size(2), id="w2-tp-dropout"),
    pytest.param(4, True, 0.0, marks=pytest.mark.world_size(4), id="w4-sp"),
    pytest.param(4, False, 0.1, marks=pytest.mark.world_size(4), id="w4-tp-dropout"),
]


@pytest.mark.dist_timeout(600)
@pytest.mark.parametrize(("n", "sp", "dropout"), CASES)
def test_llama_tensor_parallel_trains_like_single_device(world, n, sp, dropout) -> None:
    args = llama.ModelArgs(dropout=dropout)
    model, ref = _run(args, DeviceMesh("cpu", list(range(n))), None, sp)
    assert model.output.weight.placements == (Shard(0),)
    assert model.tok_embeddings.weight.placements == (Shard(0),)  # vocab-parallel
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(_full(p.detach()), q.detach(), atol=1e-4, rtol=1e-4,
                                   msg=lambda m, name=name: f"param {name}: {m}")


@pytest.mark.dist_timeout(600)
@pytest.mark.world_size(4)
def test_llama_2d_data_and_tensor_parallel_trains_like_single_device(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    _run(llama.ModelArgs(), mesh["tp"], mesh["dp"], True)


@pytest.mark.world_size(2)
def test_meta_init_gives_the_single_device_parameters_bit_for_bit(world) -> None:
    args = llama.ModelArgs()
    dtensor.random.manual_seed(3)
    ref = llama.build_reference(args)
    dtensor.random.manual_seed(3)
    model = llama.build_parallel(args, DeviceMesh("cpu", [0, 1]), True)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert isinstance(p, DTensor) and not p.is_meta, name
        assert torch.equal(p.full_tensor(), q), name
    assert torch.equal(model.freqs_cis, ref.freqs_cis)


@pytest.mark.dist_timeout(600)
@pytest.mark.world_size(4)
def test_checkpoint_on_4_ranks_resumes_on_2_with_another_plan(world, shared_dir) -> None:
    """Save model and AdamW state mid-training on 4 ranks (sequence parallel),
    resume on ranks 0-1 with the plain tensor-parallel plan: the resumed run's
    losses are the uninterrupted run's."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import dtensor.checkpoint as ckpt

    args = llama.ModelArgs()
    data = llama.batches(args, 6, batch=2)
    dtensor.random.manual_seed(0)
    mesh4 = DeviceMesh("cpu", [0, 1, 2, 3])
    a = llama.build_parallel(args, mesh4, True)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    first = llama.train(a, data[:3], optimizer=opt_a)
    with shared_dir("dtensor-llama-") as path:
        msd, osd = get_state_dict(a, opt_a)
        ckpt.save({"model": msd, "optim": osd}, path)
        uninterrupted = llama.train(a, data[3:], optimizer=opt_a)
        if world.rank in (0, 1):
            mesh2 = DeviceMesh("cpu", [0, 1])
            dtensor.random.manual_seed(1)  # other initial values: the checkpoint must win
            b = llama.build_parallel(args, mesh2, False)
            opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
            msd_b, osd_b = get_state_dict(b, opt_b)
            sd = {"model": msd_b, "optim": osd_b}
            ckpt.load(sd, path)
            set_state_dict(b, opt_b, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            assert b.layers["0"].attention_norm.weight.device_mesh == mesh2
            resumed = llama.train(b, data[3:], optimizer=opt_b)
            assert resumed == pytest.approx(uninterrupted, rel=1e-5, abs=1e-5)
            assert resumed != pytest.approx(first, rel=1e-3)  # it really trained on
