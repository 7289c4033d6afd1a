"""What one example did: its text, its input classes, the runtime lines it ran.

``Probe.wrap`` wraps a ``@given`` test's inner function (inside the lockstep
plugin's wrapper, so it sees exactly what every rank sees). Per example it

- records the drawn arguments and every ``data.draw`` (text, for reports and
  the hang record; values, for the input classes);
- on the rank that measures coverage, traces line-to-line arcs of frames whose
  file lies under the runtime package (``sys.settrace`` with a global hook
  that returns no local tracer for any other file, so the test's and torch's
  own frames cost one call event each);
- before the example runs, writes it to ``inflight.json`` (rank 0), so a hang
  or a dead rank is recorded with the example that was running.

Input classes come from the project's ``pytest_launch_classify`` hook
(``launch.hookspecs``; the property suite's conftest implements it with
DTensor's mesh and placement classes), else from ``classify`` here, which
knows only tensors: dtype, op and size.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launch.hypo.engine import is_data

__all__ = ["ArcTracer", "Probe", "classify"]

class ArcTracer:
    """Line-to-line arcs of code under ``root`` (negative line: entry/exit)."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip(os.sep) + os.sep
        self.arcs: dict[str, set[tuple[int, int]]] = {}
        self._names: dict[str, str] = {}
        base = os.path.dirname(self.root.rstrip(os.sep))
        self._base = base + os.sep

    def _hook(self, frame: Any, event: str, arg: Any) -> Any:
        if event != "call":
            return None
        fname = frame.f_code.co_filename
        if not fname.startswith(self.root):
            return None
        name = self._names.get(fname)
        if name is None:
            name = self._names[fname] = fname[len(self._base):]
        arcs = self.arcs.setdefault(name, set())
        last = -frame.f_code.co_firstlineno

        def local(frame: Any, event: str, arg: Any) -> Any:
            nonlocal last
            if event == "line":
                arcs.add((last, frame.f_lineno))
                last = frame.f_lineno
            elif event == "return":
                arcs.add((last, -frame.f_code.co_firstlineno))
            return local

        return local

    def __enter__(self) -> ArcTracer:
        self._prev = sys.gettrace()
        sys.settrace(self._hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.settrace(self._prev)

    def take(self) -> dict[str, set[tuple[int, int]]]:
        out, self.arcs = self.arcs, {}
        return out


def classify(values: list[tuple[str, Any]], op: str = "") -> dict[str, str]:
    """The service's own input classes of one example (a project refines them
    with ``pytest_launch_classify``): dtype, op (a draw labelled ``op``, or
    the test's parametrization) and size (``empty`` / ``scalar`` /
    ``nonempty`` / ``none``), from tensors and int tuples among the draws."""
    found: dict[str, str] = {}
    shapes: list[tuple[int, ...]] = []

    def walk(v: Any, depth: int) -> None:
        if hasattr(v, "dtype") and hasattr(v, "shape") and hasattr(v, "numel"):
            found.setdefault("dtype", str(v.dtype).removeprefix("torch."))
            shapes.append(tuple(v.shape))
        elif type(v).__name__ == "dtype" and str(v).startswith("torch."):
            found.setdefault("dtype", str(v).removeprefix("torch."))
        elif isinstance(v, (tuple, list)) and depth < 3:
            if v and all(isinstance(x, int) for x in v) and len(v) <= 4:
                shapes.append(tuple(v))
                return
            for x in list(v)[:16]:
                walk(x, depth + 1)
        elif isinstance(v, dict) and depth < 3:
            for x in list(v.values())[:16]:
                walk(x, depth + 1)

    for label, v in values:
        if label == "op" and isinstance(v, str):
            op = op or v
        walk(v, 0)
    if op:
        found["op"] = op
    found["size"] = ("empty" if any(0 in s for s in shapes) else
                     "scalar" if shapes and all(s == () for s in shapes) else
                     "nonempty" if shapes else "none")
    return found


class Probe:
    """Per-slice recorder for one rank (see the module docstring)."""

    def __init__(self, rank: int, run_dir: Path | None, tracer: ArcTracer | None,
                 rank_now: Callable[[], int] | None = None,
                 classes: Callable[[list[tuple[str, Any]], str], dict] = classify) -> None:
        # rank_now: the calling thread's rank, in a simulated world where every
        # rank is a thread of this process running the same wrapped function.
        # Only calls from ``rank`` count, trace and classify; every rank's last
        # example is kept (``lasts``) so the ranks' final examples can be compared.
        self.rank, self.run_dir, self.tracer = rank, run_dir, tracer
        self.rank_now = rank_now
        self.classify = classes  # (label, value) draws, op -> input classes
        self.inflight = run_dir / "inflight.json" if run_dir is not None and rank == 0 else None
        self.begin("", 0, "")

    def begin(self, nodeid: str, k: int, op: str) -> None:
        self.nodeid, self.k, self.op = nodeid, k, op
        self.examples = 0
        self.last = ""
        self.lasts: dict[int, str] = {}
        self.classes: list[dict[str, str]] = []
        self.started = time.time()

    def _write(self, text: str) -> None:
        if self.inflight is None:
            return
        tmp = self.inflight.with_name("inflight.tmp")
        tmp.write_text(json.dumps({"nodeid": self.nodeid, "slice": self.k, "n": self.examples,
                                   "example": text[-3000:], "t": time.time(),
                                   "started": self.started}))
        os.replace(tmp, self.inflight)

    def wrap(self, inner: Any, given: set[str]) -> Any:
        @functools.wraps(inner)
        def fuzz_inner(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            me = self.rank if self.rank_now is None else self.rank_now()
            own = me == self.rank
            parts = [f"{k}={v!r}" for k, v in sorted(kwargs.items())
                     if k in given and not is_data(v)]
            values: list[tuple[str, Any]] = [(k, v) for k, v in kwargs.items()
                                             if k in given and not is_data(v)]
            for v in kwargs.values():
                if is_data(v):
                    self._record_draws(v, parts, values, own)
            if own:
                self.examples += 1
                self._write("; ".join(parts))
            try:
                if own and self.tracer is not None:
                    with self.tracer:
                        return inner(*args, **kwargs)
                return inner(*args, **kwargs)
            finally:
                self.lasts[me] = "; ".join(parts)
                if own:
                    self.last = self.lasts[me]
                    self.classes.append(self.classify(values, self.op))

        return fuzz_inner

    def _record_draws(self, data: Any, parts: list[str], values: list[tuple[str, Any]],
                      own: bool = True) -> None:
        draw = data.draw

        def recording_draw(strategy: Any, label: Any = None) -> Any:
            value = draw(strategy, label)
            parts.append(f"draw {len(values) + 1}{f' ({label})' if label else ''}: {value!r}")
            values.append((str(label or ""), value))
            if own:
                self._write("; ".join(parts))
            return value

        data.draw = recording_draw
