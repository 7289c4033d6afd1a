"""FSDP training steps: ``dtensor.fsdp.fully_shard`` vs ``torch.distributed.fsdp.fully_shard``.

The Llama of ``examples/llama_tp.py`` (a larger size, below) is copied twice
from one initialisation; one copy is sharded with ours (every block, then the
root), the other with PyTorch's FSDP2 on a mesh of the same ranks, and both
train side by side in one Gloo world: forward, cross-entropy, backward,
AdamW (foreach). Steps alternate between the two (the order flips every
round, so load from other processes hits both alike). Reported per
implementation (rank 0 prints):

- the first step's time (cold caches of each runtime; local kernels are
  warmed first by a step of the unsharded model);
- the median time of the later steps (the steps counted or profiled below
  are not timed);
- bytes per step by collective kind (``bench/_comm_bytes.py``: one dispatch
  mode counts both runtimes' collectives the same way);
- peak memory of a step per rank: the most bytes of tensors allocated at
  once during the step above what was allocated when it began (CPU
  allocator events of ``torch.profiler``), the least of three profiled
  steps, the largest over ranks. Sharded parameters, gradients and
  optimizer states are the same in both and live before the step; the peak
  is what each runtime adds: unsharded parameters, communication buffers,
  unsharded gradients, activations. The least of three: Gloo's work
  objects hold a collective's input and output until its worker thread
  drops them, which on a loaded machine can come much later, so one
  step's peak depends on thread scheduling;
- the losses, which must agree (rel 1e-5).

Run (2 and 4 ranks; ratios are ours/torch from one run):

    torchrun --nproc_per_node=2 bench/fsdp.py
    torchrun --nproc_per_node=4 bench/fsdp.py
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent / "examples"))

import llama_tp as llama  # noqa: E402
from _comm_bytes import CommBytes  # noqa: E402

import dtensor  # noqa: E402
from dtensor.fsdp import fully_shard as our_fully_shard  # noqa: E402


def _shard(model, fully_shard, mesh):
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step(model, opt, tokens):
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(0, 1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


_PROFILED = (2, 3, 4)  # steps under the memory profiler


def _timed(model, opt, tokens):
    dist.barrier()
    t0 = time.perf_counter()
    loss = _step(model, opt, tokens)
    dist.barrier()
    return time.perf_counter() - t0, loss


def _peak_bytes(prof) -> int:
    """The most bytes allocated at once above the start, from allocator events."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _counted(model, opt, tokens):
    """One step under the byte counter (not timed)."""
    dist.barrier()
    with CommBytes() as cb:
        loss = _step(model, opt, tokens)
    return {kind: v["buffer"] for kind, v in cb.by_kind().items()}, loss


def _profiled(model, opt, tokens):
    """One step under the memory profiler (not timed): its peak on this rank."""
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = _step(model, opt, tokens)
    return _peak_bytes(prof), loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    args = llama.ModelArgs(dim=a.dim, n_layers=a.layers, n_heads=4, vocab_size=512,
                           hidden_dim=2 * a.dim, max_seq_len=32)
    dtensor.random.manual_seed(0)
    ref = llama.build_reference(args)
    data = [t.chunk(n)[rank] for t in llama.batches(args, a.steps + 2, batch=4 * n)]
    warm = copy.deepcopy(ref)
    _step(warm, torch.optim.AdamW(warm.parameters(), lr=1e-3, foreach=True), data[0])

    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    models = {
        "dtensor": _shard(copy.deepcopy(ref), our_fully_shard, dtensor.DeviceMesh("cpu", list(range(n)))),
        "torch": _shard(copy.deepcopy(ref), torch_fully_shard, torch_mesh("cpu", (n,))),
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True) for k, m in models.items()}
    times = {k: [] for k in models}
    losses = {k: [] for k in models}
    nbytes, peaks = {}, {}
    for i, tokens in enumerate(data[1:]):
        order = list(models) if i % 2 == 0 else list(models)[::-1]
        for k in order:
            if i == 1:  # caches and optimizer states exist from the second step on
                nbytes[k], loss = _counted(models[k], opts[k], tokens)
            elif i in _PROFILED:
                peak, loss = _profiled(models[k], opts[k], tokens)
                peaks[k] = min(peaks.get(k, peak), peak)
            else:
                t, loss = _timed(models[k], opts[k], tokens)
                times[k].append(t)
            losses[k].append(loss)
    for k in models:
        worst = torch.tensor([peaks[k]], dtype=torch.int64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        peaks[k] = int(worst)
    if rank == 0:
        print(f"world {n}, Llama dim {a.dim} x {a.layers} layers, {a.steps + 1} steps each "
              f"({len(times['torch'])} timed)")
        for k in models:
            med = statistics.median(times[k][1:])
            print(f"{k:8s} first {times[k][0] * 1e3:8.1f} ms  median {med * 1e3:8.1f} ms  "
                  f"peak {peaks[k] / 2**20:6.2f} MiB  bytes/step {nbytes[k]}")
        first = times["dtensor"][0] / times["torch"][0]
        med = statistics.median(times["dtensor"][1:]) / statistics.median(times["torch"][1:])
        print(f"ratio ours/torch: first step {first:.2f}, median step {med:.2f}, peak "
              f"memory {peaks['dtensor'] / peaks['torch']:.2f}; bytes "
              f"{sum(nbytes['dtensor'].values()) / sum(nbytes['torch'].values()):.3f}")
        worst = max(abs(x - y) / abs(y) for x, y in zip(losses["dtensor"], losses["torch"],
                                                          strict=True))
        print(f"losses agree to {worst:.2e} (relative)")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
