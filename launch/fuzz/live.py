"""Live progress of a fuzzing session in the launcher's terminal.

``rows`` turns the session state into table rows (pure, tested); ``Live``
draws them with ``rich`` when it is installed (``pip install -e '.[fuzz]'``)
and as a plain table every ``every`` seconds otherwise (also when the output
is not a terminal).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from launch.fuzz.session import Session

__all__ = ["Live", "headline", "rows"]

HEAD = ("property", "examples", "ex/s", "new arcs 1m", "new classes 1m", "failures",
        "status")


def short(nodeid: str) -> str:
    return nodeid.split("/")[-1]


def rows(state: Session, inflight: dict[str, Any] | None, now: float) -> list[tuple[str, ...]]:
    """One row per property that has run or is running, busiest first."""
    t = state.total
    recent: dict[str, list[int]] = {}
    for when, nodeid, arcs, classes, *_ in state.discoveries:
        if when >= t - 60:
            r = recent.setdefault(nodeid, [0, 0])
            r[0] += int(arcs)
            r[1] += int(classes)
    fails: dict[str, int] = {}
    for f in state.failures:
        fails[f.nodeid] = fails.get(f.nodeid, 0) + 1
    running = state.current.get("nodeid") if state.current else None
    out = []
    for p in state.props:
        if not p["slices"] and p["nodeid"] != running:
            continue
        ex = p["examples"]
        if p["nodeid"] == running and inflight and inflight.get("nodeid") == running:
            ex += int(inflight.get("n", 0))
        rate = p["examples"] / p["seconds"] if p["seconds"] else 0.0
        status = ("running" if p["nodeid"] == running else "FAILED" if p["failed"]
                  else "skipped" if p.get("skipped") else "")
        arcs, classes = recent.get(p["nodeid"], [0, 0])
        out.append((short(p["nodeid"]), str(ex), f"{rate:.1f}", str(arcs), str(classes),
                    str(fails.get(p["nodeid"], 0)), status))
    out.sort(key=lambda r: (r[-1] != "running", -int(r[1])))
    return out


def headline(state: Session, now: float) -> str:
    arcs, lines = state.coverage()
    total = sum(p["examples"] for p in state.props)
    live = sum(1 for p in state.props if p["slices"])
    restarts = len(state.worlds)  # every world that ended was followed by this one
    return (f"fuzz: {state.elapsed:.0f}s / {state.budget_s:.0f}s  |  {live}/{len(state.props)} "
            f"properties run, {total} examples  |  runtime coverage {lines} lines, {arcs} arcs"
            f"  |  {len(state.failures)} failures  |  {restarts} world restarts")


class Live:
    def __init__(self, every: float = 10.0, limit: int = 25) -> None:
        self.every, self.limit = every, limit
        self.last = 0.0
        self.rich = None
        if sys.stdout.isatty():
            try:
                from rich.console import Console
                from rich.live import Live as RichLive

                self.rich = RichLive(console=Console(), refresh_per_second=2, transient=False)
                self.rich.start()
            except ImportError:
                self.rich = None

    def update(self, state: Session, inflight: dict[str, Any] | None) -> None:
        now = time.time()
        rs = rows(state, inflight, now)[: self.limit]
        if self.rich is not None:
            from rich.table import Table

            table = Table(title=headline(state, now), title_justify="left")
            for h in HEAD:
                table.add_column(h, justify="left" if h in ("property", "status") else "right")
            for r in rs:
                table.add_row(*r, style="red" if r[-1] == "FAILED" else None)
            self.rich.update(table)
            return
        if now - self.last < self.every:
            return
        self.last = now
        widths = [max(len(h), *(len(r[i]) for r in rs)) if rs else len(h)
                  for i, h in enumerate(HEAD)]
        widths[0] = min(widths[0], 70)
        print(headline(state, now), flush=True)
        print("  " + "  ".join(h.ljust(w) for h, w in zip(HEAD, widths)), flush=True)
        for r in rs:
            print("  " + "  ".join(c[-w:].ljust(w) for c, w in zip(r, widths)), flush=True)

    def stop(self) -> None:
        if self.rich is not None:
            self.rich.stop()
