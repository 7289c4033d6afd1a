"""The OpInfo sweep's summaries (``bench/opinfo_sweep.py``): verdict counts
per runtime with the ops each gets wrong or errs on, and the fallback bytes
audit's table of ops where ours moves more than PyTorch's DTensor."""

from __future__ import annotations

import datetime

__all__ = ["summarise", "summarise_bytes"]


def summarise(records, seconds: float, args) -> str:
    tested = [r for r in records if "skip" not in r]
    skipped = [r for r in records if "skip" in r]
    layouts = (
        f"every tensor input its own Replicate or Shard(d) (samples with two or more "
        f"tensors; layouts differing between inputs, at most {args.max_layouts} per sample)"
        if args.mixed else "inputs Replicate and Shard(d) for every dim")
    lines = [
        "# OpInfo sweep" + (" with mixed layouts" if args.mixed else "")
        + ": dtensor vs torch.distributed.tensor",
        "",
        f"`python bench/opinfo_sweep.py{' --mixed' if args.mixed else ''} "
        f"--max-samples {args.max_samples}`: "
        f"{len(records)} OpInfo entries, float32 CPU samples (at most "
        f"{args.max_samples} per op), 2-rank Gloo world, {layouts}; full results "
        "compared with the plain op "
        f"(atol=rtol=1e-4). Took {seconds / 60:.1f} min on 2 cores.",
        "",
        "| | pass | wrong | error |",
        "|---|---|---|---|",
    ]
    for impl in ("ours", "torch"):
        c = {k: sum(1 for r in tested if r.get(impl) == k) for k in ("pass", "wrong", "error")}
        pct = 100.0 * c["pass"] / max(1, len(tested))
        label = "dtensor (ours)" if impl == "ours" else "torch.distributed.tensor"
        lines.append(f"| {label} | {c['pass']} ({pct:.1f}%) | {c['wrong']} | {c['error']} |")
    lines += ["", f"Tested ops: {len(tested)}; skipped: {len(skipped)} "
              + "(" + ", ".join(
                  f"{k}: {sum(1 for r in skipped if r['skip'] == k)}"
                  for k in sorted({r['skip'] for r in skipped})) + ")", ""]
    for impl in ("ours", "torch"):
        for kind in ("wrong", "error"):
            bad = [r for r in tested if r.get(impl) == kind]
            if not bad:
                continue
            lines.append(f"## {impl}: {kind} ({len(bad)})")
            lines.append("")
            for r in bad:
                lines.append(f"- `{r['op']}`: {r.get(impl + '_detail', '')}")
            lines.append("")
    return "\n".join(lines) + "\n"


def summarise_bytes(records, seconds: float, args) -> str:
    measured = [r for r in records if r.get("bytes", {}).get("cases")]
    more = sorted((r for r in measured if r["bytes"]["ours"] > r["bytes"]["torch"]),
                  key=lambda r: r["bytes"]["torch"] - r["bytes"]["ours"])
    less = [r for r in measured if r["bytes"]["ours"] < r["bytes"]["torch"]]
    lines = [
        "# Fallback bytes audit: dtensor vs torch.distributed.tensor",
        "",
        f"`python bench/opinfo_sweep.py --bytes --max-samples {args.max_samples}`"
        f" ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{seconds / 60:.1f} min on 2 cores): {len(records)} OpInfo entries, float32 "
        "CPU samples, 2-rank Gloo world, every tensor input Shard(d) for each dim d "
        "it has (Replicate where it has fewer dims). Wire bytes one rank receives "
        "to run the op and make its result a full tensor (`bench/_comm_bytes.py`, the "
        "same counter for both; a result left Partial or sharded pays there; "
        "distributing the inputs is not counted), summed "
        "over the layouts both runtimes get right.",
        "",
        f"Ops measured: {len(measured)}; ours moves more: {len(more)}; fewer: "
        f"{len(less)}; the same: {len(measured) - len(more) - len(less)}.",
        "",
    ]
    if more:
        lines += ["## Ops where ours moves more", "",
                  "| op | layouts | ours wire B | torch wire B | cases (ours vs torch) |",
                  "|---|---:|---:|---:|---|"]
        for r in more:
            b = r["bytes"]
            lines.append(f"| `{r['op']}` | {b['cases']} | {b['ours']:.0f} | {b['torch']:.0f} | "
                         + "; ".join(b["more"]) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"

