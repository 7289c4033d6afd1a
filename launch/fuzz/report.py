"""The final report of a fuzzing session: Markdown, JSON and one HTML page.

``write(state, folder)`` writes ``report.md``, ``report.json`` and
``report.html`` (coverage over time, examples per second per property, as
inline SVG drawn here: no JavaScript, no dependency). Pure: it reads only
the session state.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from launch.fuzz.session import Failure, Session

__all__ = ["at_minutes", "summary", "write"]

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf"]


def at_minutes(state: Session, minutes: tuple[float, ...] = (1, 5, 10)) -> dict[str, Any]:
    """Runtime coverage (lines, arcs) and examples reached by each mark of
    cumulative session time; None past the session's end."""
    out: dict[str, Any] = {}
    for m in minutes:
        pts = [p for p in state.timeline if p[0] <= m * 60]
        if state.total < m * 60 - 1 or not pts:
            out[f"{m:g} min"] = None
            continue
        t, arcs, lines, ex = pts[-1]
        out[f"{m:g} min"] = {"lines": int(lines), "arcs": int(arcs), "examples": int(ex)}
    return out


def prop_rows(state: Session) -> list[dict[str, Any]]:
    rows = []
    for p in state.props:
        classes = state.classes.get(p["nodeid"], {})
        rows.append({
            "property": p["nodeid"], "examples": p["examples"],
            "seconds": round(p["seconds"], 1), "slices": p["slices"],
            "examples_per_s": round(p["examples"] / p["seconds"], 1) if p["seconds"] else 0.0,
            "discoveries": p["discoveries"], "new_arcs": state.prop_arcs.get(p["nodeid"], 0),
            "input_classes": sum(len(v) for v in classes.values()),
            "status": "failed" if p["failed"] else (f"skipped: {p['skipped']}" if p.get("skipped")
                                                    else "ok" if p["slices"] else "not run"),
        })
    return rows


def explored(state: Session) -> dict[str, list[str]]:
    """Input classes seen over all properties: kind -> sorted values."""
    out: dict[str, set[str]] = {}
    for kinds in state.classes.values():
        for kind, vals in kinds.items():
            out.setdefault(kind, set()).update(vals)
    return {k: sorted(v) for k, v in sorted(out.items())}


def summary(state: Session) -> dict[str, Any]:
    arcs, lines = state.coverage()
    return {
        "budget_s": state.budget_s, "elapsed_s": round(state.elapsed, 1),
        "total_elapsed_s": round(state.total, 1), "sessions": state.sessions,
        "ranks": state.nproc, "pytest_args": state.args,
        "properties": len(state.props),
        "properties_run": sum(1 for p in state.props if p["slices"]),
        "examples": sum(p["examples"] for p in state.props),
        "coverage": {"lines": lines, "arcs": arcs, "at": at_minutes(state)},
        "failures": len(state.failures),
        "world_restarts": max(0, len(state.worlds) - 1),
    }


def write(state: Session, folder: Path) -> Path:
    """Write the three files; returns the HTML page's path."""
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"summary": summary(state), "properties": prop_rows(state),
           "failures": [f.__dict__ for f in state.failures],
           "input_classes": explored(state),
           "input_classes_per_property": state.classes,
           "timeline": state.timeline, "worlds": state.worlds}
    (folder / "report.json").write_text(json.dumps(doc, indent=1))
    (folder / "report.md").write_text(markdown(state, doc))
    page = folder / "report.html"
    page.write_text(html_page(state, doc))
    return page


# -- Markdown ----------------------------------------------------------------------
def markdown(state: Session, doc: dict[str, Any]) -> str:
    s = doc["summary"]
    out = ["# Fuzzing report", "",
           f"- budget {s['budget_s']:.0f} s, ran {s['elapsed_s']:.0f} s"
           + (f" (session {s['sessions']}, {s['total_elapsed_s']:.0f} s in all)"
              if s["sessions"] > 1 else ""),
           f"- {s['ranks']} ranks; pytest args: `{' '.join(s['pytest_args'])}`",
           f"- {s['properties_run']}/{s['properties']} properties run, {s['examples']} examples",
           f"- runtime coverage: {s['coverage']['lines']} lines, {s['coverage']['arcs']} arcs",
           f"- failures: {s['failures']}; world restarts: {s['world_restarts']}", "",
           "## Coverage over time", "", "| time | lines | arcs | examples |", "|---|---|---|---|"]
    for mark, v in s["coverage"]["at"].items():
        out.append(f"| {mark} | " + (" | ".join(str(v[k]) for k in ("lines", "arcs", "examples"))
                                     if v else "- | - | -") + " |")
    out += ["", "## Failures", ""]
    if not state.failures:
        out.append("None.")
    for f in state.failures:
        same = f.same_on_every_rank()
        out += [f"### {f.nodeid}", "",
                f"- {f.kind}: `{f.exc_type}` at `{f.location or '?'}` after {f.found_at:.0f} s"
                + (f" (seen {f.seen}×)" if f.seen > 1 else ""),
                f"- message: {f.message}" if f.message else "",
                f"- shrunk identically on every rank: {'yes' if same else 'no' if same is False else 'n/a'}"
                + (f" ({ran_on(f, state.nproc)})" if f.per_rank else ""),
                "", "```", f"example: {f.example}", f.replay, "```", ""]
    out += ["## Properties", "",
            "| property | examples | s | ex/s | slices | discoveries | new arcs | classes | status |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["properties"]:
        out.append(f"| {r['property']} | {r['examples']} | {r['seconds']} | {r['examples_per_s']} | "
                   f"{r['slices']} | {r['discoveries']} | {r['new_arcs']} | {r['input_classes']} | "
                   f"{r['status']} |")
    out += ["", "## Input classes explored", ""]
    for kind, vals in doc["input_classes"].items():
        out.append(f"- **{kind}** ({len(vals)}): " + ", ".join(f"`{v}`" for v in vals[:60])
                   + (" …" if len(vals) > 60 else ""))
    if state.worlds:
        out += ["", "## Worlds", ""]
        for w in state.worlds:
            out.append(f"- {w.get('start', 0):.0f}–{w.get('end', 0):.0f} s: exit {w.get('rc')}"
                       f" {w.get('why', '')}")
    return "\n".join(out) + "\n"


# -- HTML with inline SVG ---------------------------------------------------------------
def ran_on(f: Failure, nproc: int) -> str:
    """The ranks that ran the failing test: all of them, or its sub-world's."""
    ranks = sorted(int(r) for r in f.per_rank)
    if len(ranks) == nproc or not ranks:
        return f"{len(ranks)} ranks"
    names = f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) \
        else ", ".join(map(str, ranks))
    return f"ranks {names}, the test's world of {len(ranks)} in {nproc}"


def line_chart(series: dict[str, list[tuple[float, float]]], title: str, ylabel: str,
               width: int = 720, height: int = 260) -> str:
    """An SVG line chart (step lines) of several series over seconds."""
    pad_l, pad_b, pad_t, pad_r = 60, 36, 28, 180
    pts = [p for s in series.values() for p in s]
    xmax = max([p[0] for p in pts] + [1.0])
    ymax = max([p[1] for p in pts] + [1.0])
    w, h = width - pad_l - pad_r, height - pad_t - pad_b

    def x(v: float) -> float:
        return pad_l + w * v / xmax

    def y(v: float) -> float:
        return pad_t + h - h * v / ymax

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<text x="{pad_l}" y="16" font-size="13" font-weight="bold">{html.escape(title)}</text>',
           f'<line x1="{pad_l}" y1="{pad_t + h}" x2="{pad_l + w}" y2="{pad_t + h}" stroke="#333"/>',
           f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{pad_t + h}" stroke="#333"/>',
           f'<text x="{pad_l + w / 2}" y="{height - 6}" text-anchor="middle">minutes</text>',
           f'<text x="12" y="{pad_t + h / 2}" transform="rotate(-90 12 {pad_t + h / 2})" '
           f'text-anchor="middle">{html.escape(ylabel)}</text>']
    for i in range(5):
        tv, yv = xmax * i / 4, ymax * i / 4
        out.append(f'<text x="{x(tv)}" y="{pad_t + h + 14}" text-anchor="middle">{tv / 60:.1f}</text>')
        out.append(f'<text x="{pad_l - 4}" y="{y(yv) + 4}" text-anchor="end">{yv:.0f}</text>')
        out.append(f'<line x1="{pad_l}" y1="{y(yv)}" x2="{pad_l + w}" y2="{y(yv)}" stroke="#eee"/>')
    for k, (name, s) in enumerate(series.items()):
        if not s:
            continue
        color = COLORS[k % len(COLORS)]
        path = [f"M{x(0):.1f},{y(0):.1f}"]
        for tv, yv in s:
            path.append(f"H{x(tv):.1f}V{y(yv):.1f}")
        out.append(f'<path d="{"".join(path)}" fill="none" stroke="{color}" stroke-width="1.6"/>')
        out.append(f'<text x="{pad_l + w + 6}" y="{pad_t + 12 + 14 * k}" fill="{color}">'
                   f'{html.escape(name[-30:])}</text>')
    out.append("</svg>")
    return "".join(out)


def bar_chart(values: list[tuple[str, float]], title: str, width: int = 720) -> str:
    bar, gap, label_w = 14, 4, 330
    height = 30 + len(values) * (bar + gap)
    vmax = max([v for _, v in values] + [1.0])
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<text x="0" y="16" font-size="13" font-weight="bold">{html.escape(title)}</text>']
    for i, (name, v) in enumerate(values):
        top = 26 + i * (bar + gap)
        bw = (width - label_w - 60) * v / vmax
        out.append(f'<text x="{label_w - 6}" y="{top + 11}" text-anchor="end">'
                   f'{html.escape(name[-52:])}</text>')
        out.append(f'<rect x="{label_w}" y="{top}" width="{bw:.1f}" height="{bar}" fill="#1f77b4"/>')
        out.append(f'<text x="{label_w + bw + 4}" y="{top + 11}">{v:.1f}</text>')
    out.append("</svg>")
    return "".join(out)


def html_page(state: Session, doc: dict[str, Any]) -> str:
    s = doc["summary"]
    total = {"lines": [(p[0], p[2]) for p in state.timeline],
             "arcs": [(p[0], p[1]) for p in state.timeline]}
    top = sorted(state.prop_timeline.items(), key=lambda kv: -(kv[1][-1][1] if kv[1] else 0))[:8]
    per_prop = {k.split("::")[-1]: [(t, v) for t, v in pts] for k, pts in top}
    rates = sorted(((r["property"].split("::")[-1], r["examples_per_s"])
                    for r in doc["properties"] if r["slices"]), key=lambda kv: -kv[1])
    esc = html.escape
    resumed = f" (session {s['sessions']})" if s["sessions"] > 1 else ""
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>Fuzzing report</title>",
             "<style>body{font-family:sans-serif;margin:24px;max-width:1100px}"
             "table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;"
             "padding:2px 6px;text-align:right}td:first-child,th:first-child{text-align:left}"
             ".fail{background:#fee}pre{background:#f6f6f6;padding:8px;white-space:pre-wrap}"
             "</style></head><body>",
             "<h1>Fuzzing report</h1>",
             f"<p>{s['ranks']} ranks, budget {s['budget_s']:.0f} s, ran {s['elapsed_s']:.0f} s"
             f"{resumed}; "
             f"{s['properties_run']}/{s['properties']} properties, {s['examples']} examples; "
             f"runtime coverage <b>{s['coverage']['lines']} lines</b>, {s['coverage']['arcs']} arcs; "
             f"<b>{s['failures']} failures</b>; {s['world_restarts']} world restarts.</p>",
             line_chart(total, "Runtime coverage over time (all properties)", "covered"),
             line_chart(per_prop, "New runtime arcs found, per property (top 8)", "arcs"),
             "<h2>Coverage at</h2><table><tr><th>time</th><th>lines</th><th>arcs</th>"
             "<th>examples</th></tr>"]
    for mark, v in s["coverage"]["at"].items():
        cells = "".join(f"<td>{v[k]}</td>" for k in ("lines", "arcs", "examples")) if v \
            else "<td>-</td>" * 3
        parts.append(f"<tr><td>{mark}</td>{cells}</tr>")
    parts.append("</table><h2>Failures</h2>")
    if not state.failures:
        parts.append("<p>None.</p>")
    for f in state.failures:
        same = f.same_on_every_rank()
        parts.append(f"<div class='fail'><h3>{esc(f.nodeid)}</h3><p>{esc(f.kind)}: "
                     f"<code>{esc(f.exc_type)}</code> at <code>{esc(f.location or '?')}</code>, "
                     f"after {f.found_at:.0f} s; shrunk identically on every rank: "
                     f"{'yes' if same else 'no' if same is False else 'n/a'}"
                     + (f" ({esc(ran_on(f, state.nproc))})" if f.per_rank else "") + "</p>"
                     f"<pre>{esc(f.message)}\nexample: {esc(f.example)}\n{esc(f.replay)}</pre></div>")
    parts.append(bar_chart(rates, "Examples per second, per property"))
    parts.append("<h2>Properties</h2><table><tr>" + "".join(
        f"<th>{h}</th>" for h in ("property", "examples", "s", "ex/s", "slices", "discoveries",
                                  "new arcs", "classes", "status")) + "</tr>")
    for r in doc["properties"]:
        parts.append("<tr>" + "".join(f"<td>{esc(str(r[k]))}</td>" for k in (
            "property", "examples", "seconds", "examples_per_s", "slices", "discoveries",
            "new_arcs", "input_classes", "status")) + "</tr>")
    parts.append("</table><h2>Input classes explored</h2><ul>")
    for kind, vals in doc["input_classes"].items():
        parts.append(f"<li><b>{esc(kind)}</b> ({len(vals)}): "
                     + ", ".join(f"<code>{esc(v)}</code>" for v in vals[:80]) + "</li>")
    parts.append("</ul></body></html>")
    return "\n".join(parts)
