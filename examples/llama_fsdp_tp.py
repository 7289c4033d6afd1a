"""The Llama of ``llama_tp.py`` trained with FSDP (``dtensor.fsdp.fully_shard``),
alone or over tensor parallelism (torchtitan's 2-D layout).

    torchrun --nproc_per_node=4 examples/llama_fsdp_tp.py          # dp 2 x tp 2
    torchrun --nproc_per_node=4 examples/llama_fsdp_tp.py --no-tp  # FSDP on 4
    torchrun --nproc_per_node=2 examples/llama_fsdp_tp.py --no-tp  # FSDP on 2
    torchrun --nproc_per_node=4 examples/llama_fsdp_tp.py --dropout 0.1
    torchrun --nproc_per_node=4 examples/llama_fsdp_tp.py --hsdp   # replicate 2 x dp 2

The model is built on the meta device; with TP it is first parallelized on
``mesh["tp"]`` (sequence parallel plan), then every transformer block and
the root get ``fully_shard(..., mesh=mesh["dp"])``; ``to_empty`` and
``init_weights`` give the single-device initial values. Each data-parallel
rank trains on its share of the batch (dropout masks are its rows of the
whole batch's); the script prints the losses beside a single-device run's.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import llama_tp as llama  # the model and the TP plan

from dtensor import DeviceMesh, DTensor, init_device_mesh
from dtensor.fsdp import fully_shard
from dtensor.parallel import loss_parallel


def build(args: llama.ModelArgs, mesh: DeviceMesh, tp: bool, *,
          sequence_parallel: bool = True, reshard_after_forward: bool = True):
    """Meta build, TP plan (``tp``), ``fully_shard`` per block then the root,
    materialise, initialise. ``mesh``: 2-D ``(dp, tp)`` with ``tp``, else 1-D."""
    with torch.device("meta"):
        model = llama.Transformer(args)
    dp_mesh = mesh["dp"] if tp else mesh
    if tp:
        llama.parallelize(model, mesh["tp"], sequence_parallel)
    for layer in model.layers.values():
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def train(model, data, dp_mesh: DeviceMesh | None, *, lr=1e-2, grad_hook=None, optimizer=None,
          clip: float | None = None):
    """AdamW steps on this data-parallel rank's share of each batch; returns
    every step's loss averaged over data parallel (FSDP reduces the gradients)."""
    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, foreach=True)
    rank, size = _dp_rank(dp_mesh), (dp_mesh.size() if dp_mesh is not None else 1)
    losses = []
    for tokens in data:
        tokens = tokens.chunk(size)[rank]
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        with loss_parallel():
            loss = llama.loss_fn(model(inputs), labels)
            loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if grad_hook is not None:
            grad_hook(model)
        opt.step()
        opt.zero_grad()
        local = loss.full_tensor() if isinstance(loss, DTensor) else loss
        losses.append(float(llama.dp_mean(local.detach(), dp_mesh)))
    return losses


def _dp_rank(dp_mesh: DeviceMesh | None) -> int:
    """This rank's share of the batch: its position on the data-parallel mesh,
    replica-major on a 2-D HSDP mesh (the order FSDP's gradients average in)."""
    if dp_mesh is None:
        return 0
    pos = 0
    for axis, c in enumerate(dp_mesh.get_coordinate()):
        pos = pos * dp_mesh.size(axis) + c
    return pos


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-tp", action="store_true", help="FSDP over every rank, no TP")
    ap.add_argument("--hsdp", action="store_true",
                    help="HSDP, no TP: replicas of 2-rank FSDP groups")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="dropout in every block (masks equal to single device's)")
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = not a.no_tp and not a.hsdp and world % 2 == 0 and world > 2
    if tp:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"]
    elif a.hsdp and world % 2 == 0 and world > 2:
        mesh = dp_mesh = init_device_mesh("cpu", (world // 2, 2),
                                          mesh_dim_names=("replicate", "dp"))
    else:
        mesh = dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    args = llama.ModelArgs(dropout=a.dropout)
    data = llama.batches(args, a.steps, batch=4)
    llama.dtensor.random.manual_seed(0)
    ref = llama.build_reference(args)
    ref_losses = train(ref, data, None)
    llama.dtensor.random.manual_seed(0)
    model = build(args, mesh, tp)
    losses = train(model, data, dp_mesh)
    if mesh.get_rank() == 0:
        print(f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))}, "
              f"{'FSDP + TP (sequence parallel)' if tp else 'HSDP' if mesh.ndim == 2 else 'FSDP'}"
              f", dropout {args.dropout}")
        for step, (x, y) in enumerate(zip(losses, ref_losses, strict=True)):
            print(f"step {step:2d}  loss {x:.6f}  single-device {y:.6f}")
    worst = max(abs(x - y) / max(abs(y), 1e-6) for x, y in zip(losses, ref_losses, strict=True))
    assert worst < 1e-5 and math.isfinite(worst), f"losses differ by {worst} (relative)"


if __name__ == "__main__":
    main()
