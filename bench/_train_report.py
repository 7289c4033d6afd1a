"""The report of ``bench/train_step.py``: the plan's lower bound on bytes per
training step (what its placements force) and the tables of times, bytes
and where the bytes go, ours beside torch's.
"""

from __future__ import annotations

import math
import statistics

IMPLS = ("ours", "torch")


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


def _med(xs) -> float:
    return statistics.median(xs) if xs else math.nan


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a == a and b == b and b > 0 else "n/a"


def report(runs: dict[int, list[dict]], args) -> str:
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
