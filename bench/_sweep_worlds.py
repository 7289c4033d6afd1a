"""The OpInfo sweep's worlds (``bench/opinfo_sweep.py``): one world runs ops
from an index on, and a world that crashes or hangs in an op costs that op
only: it is recorded as an error for the side that had not finished, and a
new world goes on after it.

A worker reports through two files next to ``results``: one JSON line per
op done (``results``) and the op in progress (``results.progress``:
``{"index", "name", "impl", "record"}``; ``name`` None once every op is
done).

    >>> crash_record({"index": 3, "name": "cumsum", "impl": "torch",
    ...               "record": {"index": 3, "op": "cumsum", "ours": "pass"}}, done={0, 1, 2})
    {'index': 3, 'op': 'cumsum', 'ours': 'pass', 'torch': 'error', 'torch_detail': 'world crashed or hung', 'crash': 'torch'}
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["crash_record", "free_port", "run_worlds"]


def crash_record(state: dict, done: set[int]) -> dict | None:
    """The record of the op a world stopped in (``state``: its progress), or
    None when that op's record was written before the world stopped.

    The side that was running counts as an error ("world crashed or hung");
    a side that had finished keeps its verdict; a side that had not started
    counts as an error too, since the world that would have run it is gone.
    """
    if state["index"] in done:
        return None
    record = dict(state.get("record") or {"index": state["index"], "op": state["name"]})
    for impl in ("ours", "torch"):
        if impl not in record:
            record[impl] = "error"
            record[impl + "_detail"] = (
                "world crashed or hung" if state.get("impl") in (None, impl)
                else "not run: the world crashed in the other runtime")
    record["crash"] = state.get("impl") or True
    return record


def run_worlds(results: Path, command: Callable[[int], list[str]], timeout: float,
               env: dict | None = None) -> int:
    """Run worlds (``command(start)``: the command of a world that runs ops
    from index ``start`` on) until one finishes every op; each world a crash
    or hang stopped is followed by one starting after the op it stopped in.
    0 when every op has a record in ``results``, 1 when a world did not
    start (it wrote no progress)."""
    progress = Path(str(results) + ".progress")
    progress.unlink(missing_ok=True)
    start = 0
    while True:
        with open(str(results) + ".log", "a") as log:
            try:
                rc = subprocess.run(command(start), env=env, timeout=timeout,
                                    stdout=log, stderr=log).returncode
            except subprocess.TimeoutExpired:
                rc = -1
        if not progress.exists():
            print("worker did not start", file=sys.stderr)
            return 1
        state = json.loads(progress.read_text())
        if rc == 0 and state["name"] is None:
            return 0
        done = {json.loads(line)["index"] for line in results.read_text().splitlines()}
        record = crash_record(state, done)
        if record is not None:
            with results.open("a") as f:
                f.write(json.dumps(record) + "\n")
        start = state["index"] + 1
        print(f"restarting after {state['name']} (rc={rc})", file=sys.stderr)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


