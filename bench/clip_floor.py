"""How close ``clip_grad_norm_`` on our DTensor is to the least any tensor
subclass can cost: dtensor vs torch.distributed.tensor vs a bare wrapper
subclass vs plain local tensors, one Gloo world, one run.

The bare subclass (``Bare``) does nothing but unwrap its operands, run the op
on the local tensors and wrap the results, plus the one all-reduce the clip
needs (at the first use of the total norm, where ours runs it): the cost of
PyTorch's subclass machinery (``__torch_dispatch__``, boxing a 12-tensor list
in and out, a wrapper per result) for the same 8 dispatches, with no layout
logic at all. Its numbers are not a norm of anything global; only its time
matters. "plain" is the same call on the local gradients (no collective).

Gradients come from the 3-block MLP of ``bench/train_phases.py`` (2 ranks,
Colwise/Rowwise), recomputed every round; each call starts after a barrier,
the four variants interleaved (order flipped every round), medians of
``--steps`` rounds on rank 0 (the last to reach the all-reduce here).

    python bench/clip_floor.py                  # 2 ranks, 40 rounds
    python bench/clip_floor.py --world 4 --steps 60
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VARIANTS = ("ours", "torch", "bare subclass", "plain")


def _worker(args) -> None:
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import torch.utils._foreach_utils as foreach_utils
    from torch import nn

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    import torch.distributed.tensor as tdt
    import torch.distributed.tensor.parallel as tpar
    from train_phases import _mlp

    import dtensor
    import dtensor.parallel

    torch.manual_seed(0)
    base = _mlp(torch, nn)
    x, target = torch.randn(64, 128), torch.randn(64, 128)

    def build(lib, par):
        mesh = lib.DeviceMesh("cpu", list(range(n)))
        plan = {f"{i}.up": par.ColwiseParallel() for i in range(3)}
        plan |= {f"{i}.down": par.RowwiseParallel() for i in range(3)}
        model = par.parallelize_module(copy.deepcopy(base), mesh, plan)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    built = {"ours": build(dtensor, dtensor.parallel), "torch": build(tdt, tpar)}

    class Bare(torch.Tensor):
        @staticmethod
        def __new__(cls, t, pending=False):
            r = torch.Tensor._make_wrapper_subclass(cls, t.shape, t.stride(), dtype=t.dtype,
                                                    device=t.device)
            r.t, r.pending = t, pending
            return r

        __torch_function__ = torch._C._disabled_torch_function_impl

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            def local(a):
                if type(a) is Bare:
                    if a.pending:  # the total norm's one all-reduce
                        w = a.t.pow(2.0)
                        dist.all_reduce(w)
                        return w.pow(0.5)
                    return a.t
                if type(a) in (list, tuple):
                    return type(a)(local(y) for y in a)
                return a

            out = func(*map(local, args), **{k: local(v) for k, v in (kwargs or {}).items()})
            if isinstance(out, torch.Tensor):
                return Bare(out, func is torch.ops.aten.linalg_vector_norm.default)
            if isinstance(out, (list, tuple)):
                return type(out)(Bare(o) for o in out)
            return out

    foreach_utils._foreach_supported_types.append(Bare)  # as both DTensors are

    class Param:  # what clip_grad_norm_ reads of a parameter
        def __init__(self, grad):
            self.grad = grad

    def backward(name):
        model, opt = built[name]
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), target).backward()

    times = {v: [] for v in VARIANTS}
    for i in range(args.steps + 5):
        backward("ours")
        grads = [p.grad._local_tensor for p in built["ours"][0].parameters()]
        bare = [Param(Bare(g.clone())) for g in grads]
        plain = [Param(g.clone()) for g in grads]
        backward("torch")
        calls = {
            "ours": lambda: torch.nn.utils.clip_grad_norm_(built["ours"][0].parameters(), 1.0),
            "torch": lambda: torch.nn.utils.clip_grad_norm_(built["torch"][0].parameters(), 1.0),
            "bare subclass": lambda b=bare: torch.nn.utils.clip_grad_norm_(b, 1.0),
            "plain": lambda p=plain: torch.nn.utils.clip_grad_norm_(p, 1.0),
        }
        for name in (VARIANTS if i % 2 else VARIANTS[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            calls[name]()
            if i >= 5:  # warm-up rounds
                times[name].append(time.perf_counter() - t0)
        for _, opt in built.values():
            opt.step()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"times": times, "loadavg": os.getloadavg()}, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.world < 1 or args.steps < 1:
        ap.error(f"--world and --steps must be >= 1, got {args.world} and {args.steps}")
    if args.worker:
        _worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "clip.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.world}",
               "--master_port=0", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0",
               os.path.abspath(__file__), "--worker", "--out", out, "--steps", str(args.steps)]
        proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"),
                              capture_output=True, text=True, timeout=1800)
        if not os.path.exists(out):
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise SystemExit(f"the world of {args.world} failed (rc {proc.returncode})")
        with open(out) as f:
            res = json.load(f)
    med = {k: statistics.median(v) * 1e6 for k, v in res["times"].items()}
    print(f"### clip_grad_norm_(params, 1.0), MLP, {args.world} ranks "
          f"(load average after: {res['loadavg'][0]:.1f})\n")
    print("| variant | µs (median) | / torch | / bare subclass |")
    print("|---|---:|---:|---:|")
    for k in VARIANTS:
        print(f"| {k} | {med[k]:.0f} | {med[k] / med['torch']:.2f} | "
              f"{med[k] / med['bare subclass']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
