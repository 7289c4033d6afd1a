"""Covers: bench/_sweep_worlds.py, the OpInfo sweep's restarts. A world that
crashes or hangs in an op costs that op only: it is recorded as an error for
the side that was running, and a new world goes on after it. Workers here are
small scripts that write what the sweep's worker writes, so a crash lands on a
chosen op without a torchrun world."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))

from _sweep_worlds import crash_record, run_worlds

# A worker over ops 0..3 that records each op, and stops as told in the op
# named by CRASH_AT: "exit" (the world crashed in torch's side, ours done),
# "hang" (the world hung in ours). Once CRASH_AT's op is past, it runs clean.
_WORKER = textwrap.dedent('''
    import json, os, sys, time
    results, start = sys.argv[1], int(sys.argv[2])
    progress = results + ".progress"
    crash_at, how = int(os.environ["CRASH_AT"]), os.environ["HOW"]
    with open(results + ".starts", "a") as f:
        f.write(f"{start}\\n")
    for index in range(start, 4):
        name = f"op{index}"
        if index == crash_at and how == "exit":
            ours = {"index": index, "op": name, "ours": "pass"}
            with open(progress, "w") as f:
                json.dump({"index": index, "name": name, "impl": "torch", "record": ours}, f)
            os._exit(3)
        with open(progress, "w") as f:
            json.dump({"index": index, "name": name, "impl": "ours"}, f)
        if index == crash_at and how == "hang":
            time.sleep(60)
        with open(results, "a") as f:
            f.write(json.dumps({"index": index, "op": name, "ours": "pass",
                                "torch": "pass"}) + "\\n")
    with open(progress, "w") as f:
        json.dump({"index": 4, "name": None}, f)
''')


def _sweep(tmp_path: Path, crash_at: int, how: str, timeout: float = 30.0):
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)
    results = tmp_path / "results.jsonl"
    results.write_text("")
    env = dict(os.environ, CRASH_AT=str(crash_at), HOW=how)
    rc = run_worlds(results, lambda start: [sys.executable, str(worker), str(results),
                                            str(start)], timeout, env)
    records = [json.loads(line) for line in results.read_text().splitlines()]
    starts = [int(s) for s in (tmp_path / "results.jsonl.starts").read_text().split()]
    return rc, records, starts


def test_a_crashed_world_costs_its_op_and_the_sweep_goes_on_after_it(tmp_path) -> None:
    rc, records, starts = _sweep(tmp_path, crash_at=1, how="exit")
    assert rc == 0
    assert starts == [0, 2]
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    crashed = records[1]
    # ours had finished: its verdict stays; torch's side was running
    assert crashed["ours"] == "pass" and crashed["torch"] == "error"
    assert crashed["torch_detail"] == "world crashed or hung" and crashed["crash"] == "torch"
    assert all(r["ours"] == r["torch"] == "pass" for r in records if r is not crashed)


def test_a_hung_world_is_stopped_at_the_timeout_and_its_op_recorded(tmp_path) -> None:
    rc, records, starts = _sweep(tmp_path, crash_at=2, how="hang", timeout=5.0)
    assert rc == 0
    assert starts == [0, 3]
    hung = records[2]
    assert hung["index"] == 2 and hung["op"] == "op2"
    assert hung["ours"] == hung["torch"] == "error"  # ours was running; torch never started
    assert hung["ours_detail"] == "world crashed or hung"
    assert hung["torch_detail"] == "not run: the world crashed in the other runtime"


def test_a_world_that_never_starts_fails_the_sweep(tmp_path) -> None:
    results = tmp_path / "results.jsonl"
    results.write_text("")
    rc = run_worlds(results, lambda start: [sys.executable, "-c", "raise SystemExit(2)"], 30.0)
    assert rc == 1


def test_an_op_recorded_before_the_world_stopped_keeps_its_record() -> None:
    state = {"index": 5, "name": "op5", "impl": "torch"}
    assert crash_record(state, done={4, 5}) is None
    assert crash_record(state, done={4})["crash"] == "torch"
