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
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

IMPLS = ("ours", "torch")


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


# Lower bound ------------------------------------------------------------------
def lower_bound(cfg, n: int, kind: str) -> list[tuple[str, str, str, int, int]]:
    """What the plan's placements force: (phase, where, collective, count, buffer bytes).

    Activations are ``batch * seq * dim`` float32 (B bytes). ``sp``: every
    Shard(1) -> Replicate boundary is one all-gather forward and one
    reduce-scatter backward, every rowwise output Partial -> Shard(1) one
    reduce-scatter forward and one all-gather backward; the replicated norm
    weights' gradients are one all-reduce of all of them together (the
    bytes of one each; the count is what a bucket saves). ``tp``: one all-reduce per
    rowwise layer forward and one per replicated input of a colwise group
    backward (wq/wk/wv share theirs, so do w1/w3). The loss needs each
    token's per-rank log-sum-exp (an all-gather of N floats; past 4 ranks a
    max and a sum all-reduce of N move less) and one scalar.
    """
    B = cfg.batch * cfg.seq * cfg.dim * 4
    L = cfg.n_layers
    N = cfg.batch * cfg.seq
    terms = []
    if kind == "sp":
        terms += [
            ("fwd", "tok_embeddings P->S(1)", "reduce_scatter", 1, B),
            ("fwd", "attention/feed_forward input S(1)->R", "all_gather", 2 * L, B),
            ("fwd", "wo/w2 output P->S(1)", "reduce_scatter", 2 * L, B),
            ("fwd", "output input S(1)->R", "all_gather", 1, B),
            ("bwd", "output input grad P->S(1)", "reduce_scatter", 1, B),
            ("bwd", "wo/w2 output grad S(1)->R", "all_gather", 2 * L, B),
            ("bwd", "attention/feed_forward input grad P->S(1)", "reduce_scatter", 2 * L, B),
            ("bwd", "tok_embeddings output grad S(1)->R", "all_gather", 1, B),
            ("bwd", "norm weight grads P->R, one bucket", "all_reduce", 1, (2 * L + 1) * cfg.dim * 4),
        ]
    else:
        terms += [
            ("fwd", "wo/w2 output P->R", "all_reduce", 2 * L, B),
            ("bwd", "attention/feed_forward/output input grad P->R", "all_reduce", 2 * L + 1, B),
        ]
    # Ring model: a gather of the per-rank log-sum-exps receives (n-1)*N floats;
    # a max then a sum all-reduce 4(n-1)/n*N: the gather is no worse up to 4 ranks.
    if n <= 4:
        terms.append(("fwd", "loss: per-token log-sum-exp", "all_gather", 1, n * N * 4))
    else:
        terms.append(("fwd", "loss: per-token max, sum of exps", "all_reduce", 2, N * 4))
    terms.append(("fwd", "loss: sum of target logits", "all_reduce", 1, 4))
    return terms


def bound_by_kind(terms, n: int) -> dict[str, dict[str, float]]:
    from _comm_bytes import wire_bytes

    out: dict[str, dict[str, float]] = {}
    for _phase, _where, k, count, buf in terms:
        row = out.setdefault(k, {"count": 0, "buffer": 0, "wire": 0.0})
        row["count"] += count
        row["buffer"] += count * buf
        row["wire"] += count * wire_bytes(k, buf, n)
    return out


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


def _med(xs) -> float:
    return statistics.median(xs) if xs else math.nan


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a == a and b == b and b > 0 else "n/a"


def _report(runs: dict[int, list[dict]], args) -> str:
    from _comm_bytes import wire_bytes
    from _model import Config

    cfg = Config()
    lines = []
    p = lines.append
    p(f"config: {cfg}, plan={args.plan}, steps/impl/launch={args.steps}")
    p("")
    p("| ranks | measure | ours (ms) | torch (ms) | ours/torch | goal |")
    p("|---|---|---:|---:|---:|---|")
    for n, rs in runs.items():
        def pooled(key, impl, rs=rs):
            return [x for r in rs for x in r.get(key, {}).get(impl, [])]

        e = {k: _med(pooled("eager_s", k)) * 1e3 for k in IMPLS}
        p(f"| {n} | eager step (median) | {e['ours']:.1f} | {e['torch']:.1f} | "
          f"{_ratio(e['ours'], e['torch'])} | <= 0.8 |")
        # first-step ratio per launch, then the mean over the two orders
        fr = [r["first_s"]["ours"] / r["first_s"]["torch"] for r in rs]
        f = {k: _med([r["first_s"][k] for r in rs]) * 1e3 for k in IMPLS}
        p(f"| {n} | first step (cold) | {f['ours']:.1f} | {f['torch']:.1f} | "
          f"{statistics.mean(fr):.2f} (per order: {', '.join(f'{x:.2f}' for x in fr)}) | <= 0.3 |")
        s = {k: _med([r["setup_s"][k] for r in rs]) * 1e3 for k in IMPLS}
        p(f"| {n} | parallelize_module + AdamW setup | {s['ours']:.1f} | {s['torch']:.1f} | "
          f"{_ratio(s['ours'], s['torch'])} | - |")
        cr = [r for r in rs if "compiled_s" in r]
        if cr:
            errs = {k: v for r in cr for k, v in r["compile_errors"].items()}
            c = {k: _med(pooled("compiled_s", k, cr)) * 1e3 for k in IMPLS}
            cf = {k: _med([r["compile_first_s"][k] for r in cr if k in r["compile_first_s"]])
                  for k in IMPLS}
            mode = cr[0].get("compile_mode", "model")
            p(f"| {n} | compiled step ({mode}, median) | {c['ours']:.1f} | {c['torch']:.1f} | "
              f"{_ratio(c['ours'], c['torch'])} | <= 1.0 |")
            # per launch, then the mean over both orders (as the first step)
            cfr = [r["compile_first_s"]["ours"] / r["compile_first_s"]["torch"]
                   for r in cr if len(r["compile_first_s"]) == 2]
            per = ", ".join(f"{x:.2f}" for x in cfr)
            p(f"| {n} | compile (first compiled step, s) | {cf['ours']:.1f} s | "
              f"{cf['torch']:.1f} s | {statistics.mean(cfr) if cfr else math.nan:.2f} "
              f"(per order: {per}) | <= 1.0 |")
            for k, v in errs.items():
                p(f"| {n} | compile error ({k}) | {v} | | | |")
            # the same steps only: an implementation that failed has fewer
            cl = [(a, b) for r in cr if not r["compile_errors"]
                  for a, b in zip(r["compiled_losses"]["ours"], r["compiled_losses"]["torch"],
                                  strict=True)]
            if cl:
                cd = max(abs(a - b) for a, b in cl)
                p(f"| {n} | max loss difference, compiled steps | {cd:.2e} | | | |")
        ld = max(abs(a - b) for r in rs for a, b in zip(r["losses"]["ours"], r["losses"]["torch"], strict=True))
        p(f"| {n} | max loss difference ours vs torch, same steps | {ld:.2e} | | | |")
    p("")
    # Bytes: per kind, per step, vs the bound.
    for n, rs in runs.items():
        r = rs[0]
        bound = bound_by_kind(lower_bound(cfg, n, args.plan), n)
        kinds = sorted({k for impl in IMPLS for _, k, _, _ in r["records"][impl]} | set(bound))
        p(f"Bytes per training step, {n} ranks, per rank (wire = ring model; "
          "buffer = full collective buffer):")
        p("")
        p("| collective | ours count | ours buffer B | ours wire B | torch count | torch buffer B "
          "| torch wire B | bound count | bound wire B |")
        p("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        tot = {"ours": 0.0, "torch": 0.0, "bound": 0.0}
        for k in kinds:
            cells = []
            for impl in IMPLS:
                recs = [x for x in r["records"][impl] if x[1] == k]
                w = sum(wire_bytes(k, b, m) for _, _, b, m in recs)
                tot[impl] += w
                cells += [str(len(recs)), str(sum(b for _, _, b, _ in recs)), f"{w:.0f}"]
            b = bound.get(k, {"count": 0, "wire": 0.0})
            tot["bound"] += b["wire"]
            p(f"| {k} | " + " | ".join(cells) + f" | {b['count']} | {b['wire']:.0f} |")
        p(f"| **total** | | | {tot['ours']:.0f} | | | {tot['torch']:.0f} | | {tot['bound']:.0f} |")
        p("")
        p(f"Where the bytes go, {n} ranks (wire bytes per phase:module, collective):")
        p("")
        p("| where | collective | ours count | ours wire B | torch count | torch wire B |")
        p("|---|---|---:|---:|---:|---:|")
        keys = []
        for impl in IMPLS:
            for ph, k, _, _ in r["records"][impl]:
                if (ph, k) not in keys:
                    keys.append((ph, k))
        for ph, k in keys:
            cells = []
            for impl in IMPLS:
                recs = [x for x in r["records"][impl] if x[0] == ph and x[1] == k]
                cells += [str(len(recs)), f"{sum(wire_bytes(k, b, m) for _, _, b, m in recs):.0f}"]
            p(f"| {ph.replace('Llama.', '')} | {k} | " + " | ".join(cells) + " |")
        p("")
    return "\n".join(lines)


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
    print(_report(runs, args))
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
