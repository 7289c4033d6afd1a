"""Tensor-parallel training steps: dtensor vs torch.distributed.tensor, time and bytes.

The same tiny Llama-style model (``bench/_model.py``) and plan, parallelized
once with ``dtensor.parallel`` and once with
``torch.distributed.tensor.parallel``, train side by side in the same Gloo
world (2 and 4 ranks): forward, ``loss_parallel`` cross-entropy, backward,
AdamW. Measured per implementation:

- median step time, eager (steps alternate between implementations, the
  order flipping every round, so load from other processes hits both alike);
- first-step time (cold sharding caches; local kernels are warmed first by a
  step of the plain model, so both pay only for their own first-seen work);
- compiled (``torch.compile``, inductor, CPU): first-call time (compile) and
  median step time; inductor's caches go to a fresh directory per launch and
  the FX/AOT caches are off, so neither implementation reuses the other's work.
  ``--compile block`` (default) compiles each transformer block as torchtitan
  does (embedding, final norm, output and loss stay eager); ``--compile model``
  compiles the whole model (torch's plan fails there, see the report);
- bytes per step per collective kind (``bench/_comm_bytes.py``, the same
  dispatch-mode counter for both) against the plan's lower bound.

Each world size is launched twice with the implementations' order swapped
(``--quick``: once, 2 ranks only, fewer steps). Ratios are ours/torch from
the same run; absolute times on a shared 2-core machine are noise.

    python bench/train_step.py                # full: ~25 min here (compiles in every launch)
    python bench/train_step.py --quick        # ~2 min
    python bench/train_step.py --plan tp      # plain Megatron plan (default: sp)
    python bench/train_step.py --no-compile   # eager only
    python bench/train_step.py --compile model  # whole-model compile

Training steps as users write them (gradient clipping every step, AdamW with
default flags, a compute-heavier MLP beside this Llama, setup time and the
forward/backward/clip/optimizer split): ``python bench/train_phases.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _train_report import IMPLS, report  # noqa: E402 - after the path


def compile_blocks(model):
    """Compile each transformer block the way torchtitan does, in place."""
    import torch
    from torch import nn
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    class SyncInput(nn.Module):
        # torch's vocabulary-parallel embedding hands the first block an
        # AsyncCollectiveTensor (its to_local() of an async redistribute).
        # torch 2.13 compiles such an input without requires_grad, drops its
        # gradient and then fails in the embedding's backward ("'Tensor'
        # object has no attribute '_local_tensor'"; upstream PR 191113). A
        # differentiable eager copy keeps the gradient; ours never makes one.
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            if isinstance(x, AsyncCollectiveTensor):
                x = x.clone()
            return self.block(x)

    for key, block in model.layers.items():
        model.layers[key] = SyncInput(torch.compile(block, backend="inductor"))
    return model


# Worker (one rank) ----------------------------------------------------------------
def _worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch._dynamo.config.cache_size_limit = 64
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()

    import torch.distributed.tensor as tdt
    import torch.distributed.tensor.parallel as tpar
    from _comm_bytes import CommBytes
    from _model import Config, Llama, plan
    from torch.distributed._tools.mod_tracker import ModTracker

    import dtensor

    tdt.parallel = tpar  # plan() reads lib.parallel
    libs = {"ours": dtensor, "torch": tdt}
    cfg = Config()
    torch.manual_seed(0)
    base = Llama(cfg)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
    labels = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
    order = list(IMPLS) if args.order == 0 else list(reversed(IMPLS))

    import copy

    def build(name):
        lib = libs[name]
        mesh = lib.DeviceMesh("cpu", list(range(n)))
        model = lib.parallel.parallelize_module(copy.deepcopy(base), mesh, plan(lib, args.plan))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, opt

    def make_step(name, model, opt):
        loss_ctx = libs[name].parallel.loss_parallel

        def step():
            opt.zero_grad(set_to_none=True)
            logits = model(tokens)
            with loss_ctx():
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
                loss.backward()
            opt.step()
            return loss

        return step

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out

    result = {"n": n, "order": order, "plan": args.plan}

    # Warm the local kernels with the plain model (not measured).
    plain = copy.deepcopy(base)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    for _ in range(2):
        popt.zero_grad()
        F.cross_entropy(plain(tokens).flatten(0, 1), labels.flatten()).backward()
        popt.step()

    models = {}
    steps = {}
    first = {}
    losses = {k: [] for k in IMPLS}
    setup = {}
    for name in order:
        t0 = time.perf_counter()
        models[name] = build(name)
        setup[name] = time.perf_counter() - t0
        steps[name] = make_step(name, *models[name])
    for name in order:
        first[name], loss = timed(steps[name])
        losses[name].append(_scalar(loss))
    result["setup_s"] = setup
    result["first_s"] = first

    # Bytes, one eager step each, labelled by phase and innermost module.
    bytes_ = {}
    for name in IMPLS:
        tracker = ModTracker()

        def label(tracker=tracker):
            mods = [m for m in tracker.parents if m != "Global"]
            where = max(mods, key=len) if mods else "-"
            return ("bwd" if tracker.is_bw else "fwd") + ":" + where

        cb = CommBytes(label=label)
        model, opt = models[name]
        with tracker:
            with cb:
                model_out = model(tokens)
                with libs[name].parallel.loss_parallel():
                    loss = F.cross_entropy(model_out.flatten(0, 1), labels.flatten())
                    loss.backward()
        cb.label = None
        cb.phase = "opt:AdamW"
        with cb:
            opt.step()
        opt.zero_grad(set_to_none=True)
        bytes_[name] = [(r.phase, r.kind, r.buffer, r.n) for r in cb.records]
    result["records"] = bytes_

    # Eager steady state, interleaved rounds, order flipping each round.
    times = {k: [] for k in IMPLS}
    for _ in range(3):  # warm-up
        for name in IMPLS:
            steps[name]()
    for i in range(args.steps):
        for name in (order if i % 2 == 0 else order[::-1]):
            dt, loss = timed(steps[name])
            times[name].append(dt)
            losses[name].append(_scalar(loss))
    result["eager_s"] = times
    result["losses"] = losses

    if args.compile != "none":
        # Warm the compiler with the plain model (not measured), as the local
        # kernels above: otherwise whichever implementation compiles first
        # pays for inductor's lazy set-up (measured: 2.4x vs 0.33x by order).
        warm = copy.deepcopy(base)
        warm = compile_blocks(warm) if args.compile == "block" else torch.compile(warm)
        F.cross_entropy(warm(tokens).flatten(0, 1), labels.flatten()).backward()
        ctimes = {k: [] for k in IMPLS}
        closses = {k: [] for k in IMPLS}
        cfirst = {}
        cerr = {}
        csteps = {}
        for name in order:
            # A fresh copy: torch's vocabulary-parallel embedding keeps state from
            # eager steps in its placement (MaskPartial's mask buffer), and
            # compiling a whole model that ran eagerly fails there ("Mixing
            # fake modes NYI"); fresh models are also the fair comparison.
            model, opt = build(name)
            if args.compile == "block":
                compiled = compile_blocks(model)
            else:
                compiled = torch.compile(model, backend="inductor")
            csteps[name] = make_step(name, compiled, opt)
            try:
                cfirst[name], loss = timed(csteps[name])
                closses[name].append(_scalar(loss))
            except Exception as e:
                msg = " ".join(str(e).split())
                cerr[name] = f"{type(e).__name__}: {msg[:300]}"
                if rank == 0:
                    import traceback

                    traceback.print_exc()
        # torch's plan can also fail on a recompile (a later call), so warm-up
        # failures drop that implementation from the compiled timings too.
        for _ in range(2):
            for name in [k for k in order if k not in cerr]:
                try:
                    closses[name].append(_scalar(csteps[name]()))
                except Exception as e:
                    msg = " ".join(str(e).split())
                    cerr[name] = f"(on a later call) {type(e).__name__}: {msg[:300]}"
        ok = [k for k in order if k not in cerr]
        for i in range(args.steps):
            for name in (ok if i % 2 == 0 else ok[::-1]):
                dt, loss = timed(csteps[name])
                ctimes[name].append(dt)
                closses[name].append(_scalar(loss))
        result["compile_mode"] = args.compile
        result["compile_first_s"] = cfirst
        result["compiled_losses"] = closses
        result["compiled_s"] = ctimes
        result["compile_errors"] = cerr

    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def _scalar(loss) -> float:
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


# Driver ------------------------------------------------------------------------------
def _launch(n: int, order: int, args, out: str) -> dict:
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ind-")
    env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    env["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
        "--master_port=0", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0",
        os.path.abspath(__file__), "--worker", "--out", out, "--order", str(order),
        "--steps", str(args.steps), "--plan", args.plan,
        "--compile", args.compile,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=2400)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"world of {n} failed (rc {proc.returncode})")
    with open(out) as f:
        res = json.load(f)
    res["launch_s"] = time.perf_counter() - t0
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 ranks, one launch, fewer steps")
    ap.add_argument("--compile", default="block", choices=("block", "model", "none"),
                    help="compile each transformer block (default), the whole model, or nothing")
    ap.add_argument("--no-compile", dest="compile", action="store_const", const="none")
    ap.add_argument("--plan", default="sp", choices=("sp", "tp"))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--worlds", default=None, help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--order", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 6 if args.quick else 10
    if args.worker:
        _worker(args)
        return 0
    worlds = [int(x) for x in (args.worlds or ("2" if args.quick else "2,4")).split(",")]
    orders = (0,) if args.quick else (0, 1)
    runs: dict[int, list[dict]] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for n in worlds:
            for order in orders:
                out = os.path.join(tmp, f"r{n}-{order}.json")
                runs.setdefault(n, []).append(_launch(n, order, args, out))
                print(f"# world {n}, order {order}: {runs[n][-1]['launch_s']:.0f} s",
                      file=sys.stderr, flush=True)
    print(report(runs, args))
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
