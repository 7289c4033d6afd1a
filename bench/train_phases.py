"""Training steps as users write them, per phase: dtensor vs torch.distributed.tensor.

Each step is what a torchtitan-style loop does: ``zero_grad``, forward, loss,
backward, ``clip_grad_norm_(params, 1.0)`` (every step, default flags) and
``AdamW(params, lr=1e-3)`` with default flags. Two models:

- ``mlp``: 3 blocks of Linear(128, 512) colwise -> ReLU -> Linear(512, 128)
  rowwise, batch 64 (compute-heavier per op than the tiny Llama);
- ``llama``: the tiny Llama of ``bench/_model.py`` under torchtitan's
  sequence-parallel plan, with ``loss_parallel``.

Measured per implementation in the same Gloo world (steps alternate, the
order flipping every round): setup (``parallelize_module`` of a fresh copy +
optimizer construction; median of several), the first step (cold caches,
local kernels warmed by the plain model), the median step and the median of
each phase (forward+loss / backward / clip / optimizer step), losses (ours vs
torch vs single device), and the bytes of one step by phase
(``bench/_comm_bytes.py``, the same counter for both). Phases of a step
are timed without barriers, so a phase that starts with a collective (clip's
all-reduce) also holds the wait for the slowest rank's backward; "clip
alone" and "optimizer step alone" start after a barrier.

    python bench/train_phases.py                 # 2 and 4 ranks, both models
    python bench/train_phases.py --worlds 2 --models mlp --steps 10
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
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

IMPLS = ("ours", "torch")
PHASES = ("fwd", "bwd", "clip", "opt")


def _mlp(torch, nn, d=128, hidden=512, blocks=3):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(d, hidden)
            self.down = nn.Linear(hidden, d)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    return nn.Sequential(*[Block() for _ in range(blocks)])


def _worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()

    import torch.distributed.tensor as tdt
    import torch.distributed.tensor.parallel as tpar
    from _comm_bytes import CommBytes
    from _model import Config, Llama, plan

    import dtensor

    tdt.parallel = tpar
    libs = {"ours": dtensor, "torch": tdt}
    order = list(IMPLS) if args.order == 0 else list(reversed(IMPLS))
    out = {"n": n, "order": order, "models": {}}
    for model_name in args.models.split(","):
        torch.manual_seed(0)
        if model_name == "mlp":
            base = _mlp(torch, nn)
            x = torch.randn(64, 128)
            target = torch.randn(64, 128)

            def make_plan(lib):
                return {f"{i}.up": lib.parallel.ColwiseParallel() for i in range(3)} | {
                    f"{i}.down": lib.parallel.RowwiseParallel() for i in range(3)}

            def loss_of(lib, model):
                return F.mse_loss(model(x), target)
        else:
            cfg = Config()
            base = Llama(cfg)
            tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
            labels = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))

            def make_plan(lib):
                return plan(lib, "sp")

            def loss_of(lib, model):
                logits = model(tokens)
                if lib is None:
                    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
                with lib.parallel.loss_parallel():
                    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

        def build(name):
            lib = libs[name]
            model = copy.deepcopy(base)
            t0 = time.perf_counter()
            mesh = lib.DeviceMesh("cpu", list(range(n)))
            model = lib.parallel.parallelize_module(model, mesh, make_plan(lib))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            return model, opt, time.perf_counter() - t0

        def step(name, model, opt, phases=None):
            lib = libs.get(name)
            opt.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            if model_name == "llama" and lib is not None:
                with lib.parallel.loss_parallel():
                    loss = loss_of(None, model)
                    t1 = time.perf_counter()
                    loss.backward()
            else:
                loss = loss_of(lib, model)
                t1 = time.perf_counter()
                loss.backward()
            t2 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            t3 = time.perf_counter()
            opt.step()
            t4 = time.perf_counter()
            if phases is not None:
                for k, v in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    phases[k].append(v)
            v = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            return t4 - t0, float(v)

        # Single-device reference and kernel warm-up (not measured).
        plain = copy.deepcopy(base)
        popt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
        ref_losses = [step("plain", plain, popt)[1] for _ in range(args.steps + 4)]
        res = {"setup_s": {k: [] for k in IMPLS}, "first_s": {}, "step_s": {k: [] for k in IMPLS},
               "phase_s": {k: {p: [] for p in PHASES} for k in IMPLS},
               "losses": {k: [] for k in IMPLS}, "ref_losses": ref_losses}
        built = {}
        for name in order:
            model, opt, dt = build(name)
            built[name] = (model, opt)
            res["setup_s"][name].append(dt)
        for name in order:
            dt, loss = step(name, *built[name])
            res["first_s"][name] = dt
            res["losses"][name].append(loss)
        for _ in range(3):  # more setups, warm (what a second model costs)
            for name in order:
                res["setup_s"][name].append(build(name)[2])
        # Bytes of one step by phase (step 2 of each model).
        res["bytes"] = {}
        for name in IMPLS:
            model, opt = built[name]
            lib = libs[name]
            opt.zero_grad(set_to_none=True)
            cb = CommBytes()
            with cb:
                cb.phase = "fwd"
                if model_name == "llama":
                    with lib.parallel.loss_parallel():
                        loss = loss_of(None, model)
                        cb.phase = "bwd"
                        loss.backward()
                else:
                    loss = loss_of(lib, model)
                    cb.phase = "bwd"
                    loss.backward()
                cb.phase = "clip"
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                cb.phase = "opt"
                opt.step()
            v = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            res["losses"][name].append(float(v))
            res["bytes"][name] = [(r.phase, r.kind, r.buffer, r.n) for r in cb.records]
        for _ in range(2):
            for name in order:
                res["losses"][name].append(step(name, *built[name])[1])
        for i in range(args.steps):
            for name in (order if i % 2 == 0 else order[::-1]):
                dt, loss = step(name, *built[name], res["phase_s"][name])
                res["step_s"][name].append(dt)
                res["losses"][name].append(loss)
        # Clip and optimizer step alone: every rank starts them together (a
        # barrier after backward), so no rank's wait for a slower backward
        # lands in them.
        res["alone_s"] = {k: {"clip": [], "opt": []} for k in IMPLS}
        for i in range(args.steps):
            for name in (order if i % 2 == 0 else order[::-1]):
                model, opt = built[name]
                lib = libs[name]
                opt.zero_grad(set_to_none=True)
                if model_name == "llama":
                    with lib.parallel.loss_parallel():
                        loss_of(None, model).backward()
                else:
                    loss_of(lib, model).backward()
                for what, fn in (("clip", lambda m=model: torch.nn.utils.clip_grad_norm_(
                        m.parameters(), 1.0)), ("opt", opt.step)):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    res["alone_s"][name][what].append(time.perf_counter() - t0)
        out["models"][model_name] = res
    out["loadavg"] = os.getloadavg()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def _launch(n: int, order: int, args, out: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
           "--master_port=0", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0",
           os.path.abspath(__file__), "--worker", "--out", out, "--order", str(order),
           "--steps", str(args.steps), "--models", args.models]
    load = os.getloadavg()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    # NOTE: a rank can abort in Gloo's teardown after rank 0 wrote the results
    # ("terminate called without an active exception"): keep what was written.
    if proc.returncode != 0 and not os.path.exists(out):
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"world of {n} failed (rc {proc.returncode})")
    with open(out) as f:
        res = json.load(f)
    res["loadavg_before"] = load
    return res


def _med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(runs: dict[int, list[dict]]) -> str:
    from _comm_bytes import wire_bytes

    lines = []
    p = lines.append
    for n, rs in runs.items():
        for model in rs[0]["models"]:
            ms = [r["models"][model] for r in rs]
            loads = ", ".join(f"{r['loadavg_before'][0]:.1f}/{r['loadavg'][0]:.1f}" for r in rs)
            p(f"### {model}, {n} ranks (load average 1 min before/after each launch: {loads})")
            p("")
            p("| measure | ours (ms) | torch (ms) | ours/torch | goal |")
            p("|---|---:|---:|---:|---|")

            def row(label, key, goal, ms=ms):
                o = _med([x for m in ms for x in key(m, "ours")]) * 1e3
                t = _med([x for m in ms for x in key(m, "torch")]) * 1e3
                p(f"| {label} | {o:.2f} | {t:.2f} | {o / t:.2f} | {goal} |")

            row("step (clip + AdamW, median)", lambda m, k: m["step_s"][k], "<= 0.8")
            for ph, goal in zip(PHASES, ("-", "-", "<= 0.5", "<= 0.5"), strict=True):
                row(f"phase: {ph}", lambda m, k, ph=ph: m["phase_s"][k][ph], goal)
            row("clip alone (after a barrier)", lambda m, k: m["alone_s"][k]["clip"], "<= 0.5")
            row("optimizer step alone (after a barrier)", lambda m, k: m["alone_s"][k]["opt"],
                "<= 0.5")
            row("first step (cold)", lambda m, k: [m["first_s"][k]], "<= 0.3")
            row("setup, first model", lambda m, k: m["setup_s"][k][:1], "<= 1.0")
            row("setup, later models", lambda m, k: m["setup_s"][k][1:], "<= 1.0")
            d_ot = max(abs(a - b) for m in ms
                       for a, b in zip(m["losses"]["ours"], m["losses"]["torch"], strict=True))
            d_ref = max(abs(a - b) for m in ms
                        for a, b in zip(m["losses"]["ours"], m["ref_losses"], strict=False))
            p(f"| max loss difference: ours vs torch / ours vs single device | "
              f"{d_ot:.1e} / {d_ref:.1e} | | | |")
            p("")
            p("Bytes of one step by phase (count, wire bytes per rank):")
            p("")
            p("| phase | collective | ours count | ours wire B | torch count | torch wire B |")
            p("|---|---|---:|---:|---:|---:|")
            recs = ms[0]["bytes"]
            keys = sorted({(ph, k) for impl in IMPLS for ph, k, _, _ in recs[impl]},
                          key=lambda x: (PHASES.index(x[0]), x[1]))
            for ph, k in keys:
                cells = []
                for impl in IMPLS:
                    rr = [x for x in recs[impl] if x[0] == ph and x[1] == k]
                    cells += [str(len(rr)), f"{sum(wire_bytes(k, b, m) for _, _, b, m in rr):.0f}"]
                p(f"| {ph} | {k} | " + " | ".join(cells) + " |")
            p("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--models", default="mlp,llama")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--orders", default="0,1", help="implementation orders to launch")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--order", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return 0
    runs: dict[int, list[dict]] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.worlds.split(",")):
            for order in (int(x) for x in args.orders.split(",")):
                path = os.path.join(tmp, f"r{n}-{order}.json")
                runs.setdefault(n, []).append(_launch(n, order, args, path))
                print(f"# world {n}, order {order} done", file=sys.stderr, flush=True)
    print(report(runs))
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
