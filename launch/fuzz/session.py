"""The state of a fuzzing session: what ran, what it covered, what failed.

One JSON document, written by rank 0 after every slice (``state.json`` in
the session folder) and by the launcher between worlds and at the end (a
copy beside the example database, so the next session resumes from it).
Pure data and parsing; no processes.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Failure", "Session", "parse_failure"]

STATE_NAME = "fuzz-state.json"  # beside the example database (resume)


@dataclass
class Failure:
    """One distinct failure: (test, exception type, location) is its identity."""

    nodeid: str
    kind: str  # "error" (an example failed), "hang", "dead rank", "divergence"
    exc_type: str
    location: str
    message: str
    example: str
    replay: str
    found_at: float  # session seconds (cumulative over resumed sessions)
    per_rank: dict[str, str] = field(default_factory=dict)  # rank -> last example run
    seen: int = 1
    text: str = ""  # the failing report's text (tail)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.nodeid, self.exc_type, self.location)

    def same_on_every_rank(self) -> bool | None:
        """Whether every rank that ran the test ended on the same (shrunk)
        example; a rank with no example (outside the test's sub-world, in a
        state saved by an older session) is not compared."""
        vals = {v for v in self.per_rank.values() if v}
        return None if not vals else len(vals) == 1


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_EXC = re.compile(r"^(?:E\s+)?([A-Za-z_][\w.]*(?:Error|Exception|Failure|Divergence|Exit|Interrupt)\b"
                  r"|AssertionError)(?::\s?(.*))?$")
_RANK_HEAD = re.compile(r"^(?:E\s+)?----- ranks? [\d,–\s]+(?:, same error)? -----\s*$")
_EXAMPLE = re.compile(r"example failed on rank\(s\) \[[^\]]*\] of \[[^\]]*\]"
                      r"(?: \(simulated world\))?: (.*)")


def parse_failure(nodeid: str, text: str, found_at: float) -> Failure:
    """A ``Failure`` from a failed report's text (the lockstep plugin's
    ``RankFailure``: the minimal example, each failing rank's traceback and
    the ``Replay:`` line; or a launch/watchdog message)."""
    lines = text.splitlines()
    replay = next((ln.strip().lstrip("E").strip() for ln in lines if "Replay:" in ln), "")
    m = next((_EXAMPLE.search(ln) for ln in lines if _EXAMPLE.search(ln)), None)
    example = m.group(1).strip() if m else ""
    # The first failing rank's own traceback: between its "----- rank" header
    # and the next header (or the Replay line).
    start = next((i for i, ln in enumerate(lines) if _RANK_HEAD.match(ln)), None)
    body = lines[start + 1:] if start is not None else lines
    end = next((i for i, ln in enumerate(body) if _RANK_HEAD.match(ln) or "Replay:" in ln),
               len(body))
    body = body[:end]
    frames = [f for ln in body for f in _FILE_LINE.findall(ln)]
    # The innermost frame of the project (not a library's, not the service's
    # wrappers) locates the failure; else the innermost frame at all.
    ours = [f for f in frames if "site-packages" not in f[0] and "/launch/" not in f[0]]
    frames = ours or frames
    location = f"{_short(frames[-1][0])}:{frames[-1][1]} in {frames[-1][2]}" if frames else ""
    exc_type, message = "", ""
    for ln in reversed(body):
        e = _EXC.match(ln.strip())
        if e and not e.group(1).endswith("RankFailure"):
            exc_type, message = e.group(1).split(".")[-1], (e.group(2) or "").strip()
            break
    kind = "error"
    if "LockstepDivergence" in text:
        kind, exc_type = "divergence", exc_type or "LockstepDivergence"
    elif not exc_type and "launch:" in text:
        kind = "hang" if ("did not answer" in text or "hang" in text) else "dead rank"
        exc_type = kind
        message = next((ln.strip().lstrip("E").strip() for ln in lines if "launch:" in ln), "")
    return Failure(nodeid, kind, exc_type or "unknown", location, message[:300],
                   example[:2000], replay, round(found_at, 1), text=text[-4000:])


def _short(path: str) -> str:
    for marker in ("/dtensor/", "/tests/", "/launch/", "/tools/"):
        if marker in path:
            return marker[1:] + path.split(marker, 1)[1]
    return os.path.basename(path)


@dataclass
class Session:
    """Everything a report needs; JSON round-trips through ``dump``/``load``."""

    budget_s: float = 0.0
    nproc: int = 0
    args: list[str] = field(default_factory=list)
    elapsed_before: float = 0.0  # seconds of earlier sessions (resume)
    elapsed: float = 0.0  # seconds of this session so far
    sessions: int = 1
    props: list[dict[str, Any]] = field(default_factory=list)  # Scheduler.dump()
    failures: list[Failure] = field(default_factory=list)
    # coverage: file -> sorted arcs [from_line, to_line] of the runtime
    arcs: dict[str, list[list[int]]] = field(default_factory=dict)
    prop_arcs: dict[str, int] = field(default_factory=dict)  # nodeid -> arcs it covered
    # input classes: nodeid -> kind -> values seen (mesh, placements, op, dtype, size)
    classes: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    # [cumulative seconds, total arcs, total lines, total examples]
    timeline: list[list[float]] = field(default_factory=list)
    prop_timeline: dict[str, list[list[float]]] = field(default_factory=dict)  # [t, arcs]
    # [t, nodeid, new arcs, new input classes], one per slice that found any
    discoveries: list[list[Any]] = field(default_factory=list)
    worlds: list[dict[str, Any]] = field(default_factory=list)  # start, end, rc, why
    current: dict[str, Any] = field(default_factory=dict)  # the running slice

    @property
    def total(self) -> float:
        return self.elapsed_before + self.elapsed

    def add_failure(self, f: Failure) -> bool:
        """Add ``f`` unless a failure with the same identity is known (then
        count it); True when it is new."""
        for old in self.failures:
            if old.key == f.key:
                old.seen += 1
                if f.per_rank and not old.per_rank:
                    old.per_rank = f.per_rank
                return False
        self.failures.append(f)
        return True

    def coverage(self) -> tuple[int, int]:
        """(arcs, lines) covered in the runtime."""
        arcs = sum(len(v) for v in self.arcs.values())
        lines = sum(len({x for a in v for x in a if x > 0}) for v in self.arcs.values())
        return arcs, lines

    # -- JSON ------------------------------------------------------------------
    def dump(self) -> dict[str, Any]:
        d = asdict(self)
        d["failures"] = [asdict(f) for f in self.failures]
        return d

    @classmethod
    def load(cls, d: dict[str, Any]) -> Session:
        d = dict(d)
        fails = [Failure(**f) for f in d.pop("failures", [])]
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        s = cls(**known)
        s.failures = fails
        return s

    def save(self, path: Path) -> None:
        """Atomic write: a reader never sees half a file."""
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.dump()))
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> Session | None:
        try:
            return cls.load(json.loads(path.read_text()))
        except (OSError, ValueError):
            return None

    def resumed(self) -> Session:
        """The start of a next session over the same database: totals,
        coverage, classes and failures carry over; this session's clock
        starts at zero."""
        s = Session.load(self.dump())
        s.elapsed_before, s.elapsed = self.total, 0.0
        s.sessions = self.sessions + 1
        s.worlds, s.current = [], {}
        return s
