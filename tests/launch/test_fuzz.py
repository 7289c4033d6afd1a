"""Covers: launch/fuzz/scheduler.py, session.py, report.py, live.py, probe.py,
replay.py, cli.py's argument checks (pure parts; no process worlds, runs in
seconds). The database and replay across runs: test_fuzz_database.py."""

from __future__ import annotations

import json

import pytest

from launch.fuzz import report
from launch.fuzz.live import rows
from launch.fuzz.probe import ArcTracer, Probe, classify
from launch.fuzz.replay import from_lockstep, replay_line
from launch.fuzz.scheduler import Scheduler
from launch.fuzz.session import Session, parse_failure

A, B, C = "t.py::a", "t.py::b", "t.py::c"


# -- scheduler ------------------------------------------------------------------
def test_every_property_gets_a_first_slice_in_order():
    s = Scheduler([A, B, C], first_examples=7)
    got = []
    for _ in range(3):
        sl = s.choose()
        got.append((sl.nodeid, sl.examples, sl.why))
        s.record(sl.nodeid, 7, 1.0, 0)
    assert got == [(A, 7, "first"), (B, 7, "first"), (C, 7, "first")]


def test_time_goes_to_the_property_still_finding_coverage():
    s = Scheduler([A, B], slice_seconds=5.0)
    s.record(A, 100, 5.0, 50)  # A keeps finding new arcs
    s.record(B, 100, 5.0, 0)
    picks = []
    for _ in range(6):
        sl = s.choose()
        picks.append(sl.nodeid)
        s.record(sl.nodeid, 100, 5.0, 50 if sl.nodeid == A else 0)
    assert picks.count(A) > picks.count(B)


def test_floor_gives_a_starved_property_its_share():
    s = Scheduler([A, B], slice_seconds=5.0, floor=0.5)
    s.record(A, 100, 40.0, 400)
    s.record(B, 10, 1.0, 0)
    sl = s.choose()  # B has 1 s of a 20.5 s fair share: below the floor
    assert (sl.nodeid, sl.why) == (B, "floor")
    s0 = Scheduler([A, B], slice_seconds=5.0, floor=0.0)
    s0.record(A, 100, 40.0, 400)
    s0.record(B, 10, 1.0, 0)
    assert s0.choose().nodeid == A  # without a floor, yield alone decides


def test_failed_and_skipped_properties_are_done():
    s = Scheduler([A, B, C])
    s.record(A, 5, 1.0, 3, failed=True)
    s.skip(B, "needs world_size(4)")
    s.record(C, 5, 1.0, 0)
    assert {s.choose().nodeid for _ in range(3)} == {C}
    s.record(C, 5, 1.0, 0, failed=True)
    assert s.choose() is None


def test_slice_size_follows_the_measured_rate_and_the_time_left():
    s = Scheduler([A], slice_seconds=10.0, min_examples=5, max_examples=1000)
    s.record(A, 200, 4.0, 0)  # 50 examples/s
    assert s.choose().examples == 500
    assert s.choose(remaining=2.0).examples == 100
    assert s.choose(remaining=0.01).examples == 25  # at least half a second


def test_scheduler_state_round_trips_and_resumes():
    s = Scheduler([A, B])
    s.record(A, 50, 2.0, 4, failed=True)
    s.record(B, 30, 1.0, 1)
    s.skip(B, "why")
    again = Scheduler([A, B, C])
    again.load(json.loads(json.dumps(s.dump())))
    assert again.props[A].failed and again.props[A].examples == 50
    assert again.props[B].examples == 30 and again.props[B].skipped == ""  # re-judged
    assert again.choose().nodeid == C  # the new property gets its first slice first


# -- failures -------------------------------------------------------------------------
RANK_FAILURE = """\
-------------------- rank 0 (call) --------------------
E   launch.hypothesis_lockstep.RankFailure: example failed on rank(s) [0, 1] of [0, 1]: x=900
E   ----- rank 0 -----
E   Traceback (most recent call last):
E     File "/r/launch/hypothesis_lockstep.py", line 207, in example
E       result = inner(*args, **kwargs)
E     File "/r/tests/fuzztoy/test_toy.py", line 10, in test_small
E       assert x < 900
E     File "/v/site-packages/torch/testing/_comparison.py", line 1631, in assert_close
E       raise error_metas[0].to_error(msg)
E   AssertionError: assert 900 < 900
E   ----- rank 1 -----
E   Traceback (most recent call last):
E     File "/r/tests/fuzztoy/test_toy.py", line 11, in test_small
E   ValueError: other
E   Replay: DTENSOR_MUTANT=m torchrun --nproc_per_node=2 -m pytest -p launch.hypothesis_lockstep 't.py::a[x]' --hypothesis-profile=fuzz --hypothesis-seed=5 --dtensor-impl=torch
"""


def test_a_rank_failure_is_parsed_into_test_type_location_example():
    f = parse_failure("t.py::a", RANK_FAILURE, 12.34)
    assert (f.kind, f.exc_type, f.location) == ("error", "AssertionError",
                                                "tests/fuzztoy/test_toy.py:10 in test_small")
    assert f.example == "x=900" and f.message == "assert 900 < 900"
    assert f.replay.startswith("Replay: DTENSOR_MUTANT=m torchrun") and f.found_at == 12.3


def test_failures_are_deduplicated_by_test_type_and_location():
    s = Session()
    f1 = parse_failure("t.py::a", RANK_FAILURE, 1.0)
    f2 = parse_failure("t.py::a", RANK_FAILURE.replace("x=900", "x=901"), 2.0)
    f3 = parse_failure("t.py::b", RANK_FAILURE, 3.0)
    assert s.add_failure(f1) and not s.add_failure(f2) and s.add_failure(f3)
    assert [f.seen for f in s.failures] == [2, 1]


def test_a_watchdog_report_is_a_hang_or_dead_rank():
    f = parse_failure("t.py::a", "launch: rank 1 died (exit code -9) during t.py::a", 0)
    assert f.kind == "dead rank"
    assert parse_failure("t.py::a", "LockstepDivergence: ranks diverged", 0).kind == "divergence"


def test_a_session_that_ran_nothing_says_why_from_the_newest_world_that_said_it(tmp_path):
    # The session's end can stop its last world before that world's ranks
    # reach the error the first world logged.
    from launch.fuzz.cli import _nothing_ran

    (tmp_path / "world0.log").write_text(
        "[rank1] ImportError: this module cannot be imported on a rank (planted)\n")
    (tmp_path / "world1.log").write_text("launch: starting 2 ranks\n")
    state = Session(args=["test_r.py"], props=[], worlds=[{"rc": 1}, {"rc": -15}])
    why = _nothing_ran(state, tmp_path)
    assert "2 world(s) exited without running a slice" in why, why
    assert "cannot be imported on a rank (planted)" in why, why
    assert str(tmp_path / "world0.log") in why, why


def test_replay_line_uses_the_database_and_keeps_env_and_options():
    line = from_lockstep(parse_failure("t.py::a", RANK_FAILURE, 0).replay, "t.py::a[x]", 4, "/db")
    assert line == ("Replay: DTENSOR_MUTANT=m LAUNCH_FUZZ_DB=/db torchrun --nproc_per_node=4 "
                    "-m pytest 't.py::a[x]' --hypothesis-profile=ci --dtensor-impl=torch")
    assert replay_line("t.py::b", 2, "/db").endswith(" t.py::b --hypothesis-profile=ci")


SIM_FAILURE = """\
E   launch.sim_fanout.SimRankFailure: example failed on rank(s) [1] of [0, 1] (simulated world): x=4
E   ----- rank 1 -----
E   Traceback (most recent call last):
E     File "/r/test_s.py", line 18, in test_sum
E       assert t.item() == 2 * x
E   AssertionError: assert 7 == 8
E   Replay: DTENSOR_MUTANT=m pytest --dist-sim 't.py::a' --hypothesis-profile=fuzz
"""


def test_a_simulated_worlds_failure_gives_its_example_and_a_torchrun_replay():
    f = parse_failure("t.py::a", SIM_FAILURE, 0)
    assert (f.example, f.exc_type) == ("x=4", "AssertionError")
    assert f.location == "test_s.py:18 in test_sum"
    assert from_lockstep(f.replay, "t.py::a", 2, "/db") == (
        "Replay: DTENSOR_MUTANT=m LAUNCH_FUZZ_DB=/db torchrun --nproc_per_node=2 "
        "-m pytest t.py::a --hypothesis-profile=ci")


# -- session state and report -----------------------------------------------------------
def _session() -> Session:
    s = Scheduler([A, B])
    s.record(A, 120, 60.0, 30)
    s.record(B, 40, 20.0, 2, failed=True)
    st_ = Session(budget_s=600, nproc=4, args=["tests/properties"], elapsed=330.0)
    st_.props = s.dump()
    st_.arcs = {"dtensor/x.py": [[-1, 2], [2, 3], [3, -1]]}
    st_.classes = {A: {"mesh": ["2x2", "4"], "dtype": ["float32"]}, B: {"size": ["uneven"]}}
    st_.timeline = [[30.0, 2, 2, 50], [59.0, 3, 3, 100], [290.0, 3, 3, 160]]
    st_.prop_timeline = {A: [[30.0, 2], [59.0, 3]], B: [[290.0, 1]]}
    st_.discoveries = [[30.0, A, 2, 1], [300.0, B, 1, 0]]
    f = parse_failure(B, RANK_FAILURE, 290.0)
    f.per_rank = {"0": "abc", "1": "abc"}
    st_.add_failure(f)
    return st_


def test_session_state_round_trips_through_json_and_resumes(tmp_path):
    s = _session()
    s.save(tmp_path / "state.json")
    back = Session.read(tmp_path / "state.json")
    assert back.dump() == s.dump()
    nxt = back.resumed()
    assert (nxt.elapsed_before, nxt.elapsed, nxt.sessions) == (330.0, 0.0, 2)
    assert nxt.failures[0].key == s.failures[0].key and nxt.arcs == s.arcs
    assert Session.read(tmp_path / "missing.json") is None


def test_report_writes_markdown_json_and_html_with_plots(tmp_path):
    s = _session()
    page = report.write(s, tmp_path / "r")
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    assert doc["summary"]["coverage"]["at"] == {
        "1 min": {"lines": 3, "arcs": 3, "examples": 100},
        "5 min": {"lines": 3, "arcs": 3, "examples": 160}, "10 min": None}
    assert doc["summary"]["examples"] == 160 and doc["summary"]["failures"] == 1
    assert doc["input_classes"] == {"dtype": ["float32"], "mesh": ["2x2", "4"],
                                    "size": ["uneven"]}
    rates = {r["property"]: r["examples_per_s"] for r in doc["properties"]}
    assert rates == {A: 2.0, B: 2.0}
    md = (tmp_path / "r" / "report.md").read_text()
    assert "AssertionError" in md and "shrunk identically on every rank: yes" in md
    assert "Replay: DTENSOR_MUTANT=m" in md
    html = page.read_text()
    assert html.count("<svg") == html.count("</svg>") == 3
    assert "<path d=" in html and "t.py::b" in html


def test_live_rows_show_examples_rates_recent_coverage_and_failures():
    s = _session()
    s.current = {"nodeid": A}
    got = rows(s, {"nodeid": A, "n": 5}, 0.0)
    assert got[0] == ("t.py::a", "125", "2.0", "0", "0", "0", "running")
    assert got[1] == ("t.py::b", "40", "2.0", "1", "0", "1", "FAILED")


# -- probe ------------------------------------------------------------------------------
def test_the_services_own_input_classes_know_only_tensors():
    """Without a project's ``pytest_launch_classify`` the service classifies
    by tensors alone: dtype, op, size; it names no runtime type."""
    import torch

    x = torch.zeros(3, 5, dtype=torch.float64)
    assert classify([("x", x), ("ps", ("S", 1))], op="abs") == {
        "dtype": "float64", "op": "abs", "size": "nonempty"}
    assert classify([("x", torch.zeros(0, 2))])["size"] == "empty"
    assert classify([("x", torch.tensor(1.0))])["size"] == "scalar"
    assert classify([("op", "rand"), ("shape", (4, 4))]) == {"op": "rand", "size": "nonempty"}
    assert classify([("n", 3)]) == {"size": "none"}


def test_a_probe_classifies_with_the_function_it_is_given(tmp_path):
    seen = []

    def mine(values, op):
        seen.append((values, op))
        return {"kind": str(values[0][1])}

    probe = Probe(0, tmp_path, None, classes=mine)
    probe.begin("t.py::a", 0, "add")
    probe.wrap(lambda x: None, {"x"})(x=7)
    assert probe.classes == [{"kind": "7"}] and seen == [([("x", 7)], "add")]


def test_in_a_simulated_world_only_the_measuring_ranks_calls_count(tmp_path):
    """Every rank thread runs the same wrapped function: rank 0's calls count,
    write the in-flight example and are classified; every rank's last example
    is kept, for the same-minimal-example check."""
    me = [0]
    probe = Probe(0, tmp_path, None, rank_now=lambda: me[0])
    probe.begin("t.py::a", 0, "")
    wrapped = probe.wrap(lambda x: None, {"x"})
    for x, rank in ((1, 0), (1, 1), (2, 1), (2, 0)):
        me[0] = rank
        wrapped(x=x)
    assert probe.examples == 2 and len(probe.classes) == 2
    assert probe.lasts == {0: "x=2", 1: "x=2"} and probe.last == "x=2"
    assert json.loads((tmp_path / "inflight.json").read_text())["n"] == 2


def test_arc_tracer_records_only_the_package(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "mod.py").write_text("def f(x):\n    if x:\n        return 1\n    return 2\n")
    import importlib.util

    spec = importlib.util.spec_from_file_location("pkg_mod_fuzz", pkg / "mod.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tr = ArcTracer(str(pkg))
    with tr:
        mod.f(True)
        json.dumps([1])  # outside the package: not recorded
    first = tr.take()
    with tr:
        mod.f(False)
    second = tr.take()
    assert list(first) == ["pkg/mod.py"] and list(second) == ["pkg/mod.py"]
    assert (2, 3) in first["pkg/mod.py"] and (2, 4) in second["pkg/mod.py"]
    assert (2, 4) not in first["pkg/mod.py"]


@pytest.mark.parametrize(("argv", "says"), [
    (["--sim", "0"], "--sim must be >= 1, got 0"),
    (["--minutes", "0"], "--minutes must be > 0, got 0.0"),
    (["--nproc", "0"], "--nproc must be >= 1, got 0"),
    (["--hang", "-1"], "--hang must be > 0, got -1.0"),
])
def test_a_session_that_cannot_run_is_refused_before_any_world_starts(argv, says, capsys):
    # Else --sim 0 would run real ranks, and --minutes 0 an empty session
    # that reports "0 new failures" like a clean one.
    from launch.fuzz.cli import parse

    with pytest.raises(SystemExit):
        parse(["tests/properties", *argv])
    assert says in capsys.readouterr().err


def test_sim_left_out_means_real_ranks():
    from launch.fuzz.cli import parse

    args, rest = parse(["tests/properties", "--nproc", "4"])
    assert (args.sim, args.nproc, rest) == (0, 4, ["tests/properties"])
