"""Covers: launch/fuzz/scheduler.py, session.py, report.py, live.py, probe.py,
replay.py, nodedb.py, rank.py's slice settings (pure parts; no process
worlds, runs in seconds)."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

from launch.fuzz import report
from launch.fuzz.live import rows
from launch.fuzz.nodedb import per_node
from launch.fuzz.probe import ArcTracer, Probe, classify
from launch.fuzz.rank import slice_settings
from launch.fuzz.replay import from_lockstep, replay_line, replay_seed, replay_settings
from launch.fuzz.scheduler import Scheduler
from launch.fuzz.session import Session, parse_failure

pytest_plugins = ["pytester"]

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


# -- database round trip ------------------------------------------------------------------
NODE, NODE2 = "tests/p.py::test_x[4ranks]", "tests/p.py::test_x[2ranks]"


def test_a_failure_saved_by_a_fuzz_run_is_replayed_first_by_a_ci_run(tmp_path):
    """Hypothesis' database API: a fuzzing run (random seed, writable
    database) stores the shrunk failure; a ``ci``-like run (derandomized, the
    database read-only through ``replay_settings``) replays it as its very
    first example, and keeps it for the next run."""
    path = tmp_path / "db"
    calls: list[int] = []

    def make(s: settings):  # the same source each time: the same database key
        def body(x: int) -> None:
            calls.append(x)
            assert x < 500

        return given(st.integers(0, 1000))(s(body))

    fuzz = slice_settings(settings(), DirectoryBasedExampleDatabase(str(path)), NODE, 1000)
    with pytest.raises(AssertionError):
        make(fuzz)()
    assert calls[-1] == 500 and any(path.iterdir())  # shrunk, then stored
    ci = settings(derandomize=True, database=None, max_examples=25, deadline=None)
    for _ in range(2):  # read-only: the example is still there for the next run
        calls.clear()
        test = make(replay_settings(ci, path, NODE))
        test._hypothesis_internal_use_seed = replay_seed(test.hypothesis.inner_test)
        with pytest.raises(AssertionError):
            test()
        assert calls[0] == 500  # the stored example ran before any generated one
    calls.clear()
    with pytest.raises(AssertionError):
        make(ci)()
    assert calls[0] != 500  # without the database, ci starts elsewhere


def test_the_database_keeps_each_node_id_apart(tmp_path):
    db = DirectoryBasedExampleDatabase(str(tmp_path / "db"))
    per_node(db, NODE).save(b"k", b"v4")
    per_node(db, NODE2).save(b"k", b"v2")
    assert set(per_node(db, NODE).fetch(b"k")) == {b"v4"}
    per_node(db, NODE2).delete(b"k", b"v2")
    per_node(db, NODE).move(b"k", b"k.secondary", b"v4")
    assert set(per_node(db, NODE2).fetch(b"k")) == set()
    assert set(per_node(db, NODE).fetch(b"k.secondary")) == {b"v4"}
    assert set(db.fetch(b"k.secondary")) == set()  # never under the bare key
    assert per_node(None, NODE) is None


def test_a_variant_sharing_the_hypothesis_key_does_not_erase_anothers_failure(tmp_path):
    """The property suite's ``[2ranks]``/``[4ranks]`` variants come from
    ``pytest_generate_tests``, so Hypothesis gives them one database key. A
    fuzzing slice of ``[2ranks]`` after ``[4ranks]`` stored a failure must not
    replay it (it passes on 2 ranks and Hypothesis deletes it as stale): the
    next ``ci`` run of ``[4ranks]`` replays it first."""
    path = tmp_path / "db"
    db = DirectoryBasedExampleDatabase(str(path))
    calls: list[int] = []

    def make(s: settings, ranks: int):  # one source: one Hypothesis key for both variants
        def body(x: int) -> None:
            calls.append(x)
            assert not (ranks == 4 and x >= 500)

        return given(st.integers(0, 1000))(s(body))

    def fuzz_slice(nodeid: str, ranks: int):  # a fixed seed: the same examples every run
        test = make(slice_settings(settings(), db, nodeid, 1000), ranks)
        test._hypothesis_internal_use_seed = 0
        return test

    with pytest.raises(AssertionError):  # the session's [4ranks] slice finds and stores it
        fuzz_slice(NODE, 4)()
    assert calls[-1] == 500
    calls.clear()
    fuzz_slice(NODE2, 2)()  # a later [2ranks] slice passes
    assert calls[0] != 500  # it did not replay [4ranks]' example
    calls.clear()
    ci = settings(derandomize=True, database=None, max_examples=25, deadline=None)
    test = make(replay_settings(ci, path, NODE), 4)
    test._hypothesis_internal_use_seed = replay_seed(test.hypothesis.inner_test)
    with pytest.raises(AssertionError):
        test()
    assert calls[0] == 500  # still stored: the ci run replays it first


VARIANTS = '''
import os

import pytest
from hypothesis import given, settings, strategies as st


def pytest_generate_tests(metafunc):  # like tests/properties: no parametrize marker
    metafunc.parametrize("n", [pytest.param(n, id=f"{n}ranks") for n in (2, 4)])


@settings(max_examples=1, derandomize=True, deadline=None, database=None)
@given(x=st.integers(0, 1000))
def test_k(n, x):
    with open(os.environ["CALLS"], "a") as f:
        f.write(f"{n}:{x}\\n")
    assert not (n == 4 and x >= 990)
'''


@pytest.mark.slow  # child runs in real worlds (~20 s on 2 cores): the full run
def test_a_ci_run_replays_a_stored_failure_first_in_its_own_variant_only(pytester, tmp_path,
                                                                         monkeypatch):
    """End to end through pytest (one process, no worlds): the fuzzer stored
    a failure of ``test_k[4ranks]``; a ci-like run with the database moves
    ``[4ranks]`` to the front and replays it first, and ``[2ranks]`` (the same
    function object, the same Hypothesis key) never sees it."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # The child pytest would inherit this rank's torchrun environment and
        # try to join the world; the file it runs has no world tests anyway.
        pytest.skip("runs a pytest subprocess of a single-process file; plain pytest only")
    import importlib.util

    path = pytester.makepyfile(test_v=VARIANTS)
    spec = importlib.util.spec_from_file_location("h23_test_v", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    calls, db_path = tmp_path / "calls", tmp_path / "db"
    monkeypatch.setenv("CALLS", str(calls))
    fn = mod.test_k
    fn._hypothesis_internal_use_settings = slice_settings(
        fn._hypothesis_internal_use_settings, DirectoryBasedExampleDatabase(str(db_path)),
        "test_v.py::test_k[4ranks]", 1000)
    fn._hypothesis_internal_use_seed = 0
    with pytest.raises(AssertionError):  # the session's slice: found, shrunk, stored
        fn(n=4)
    assert calls.read_text().splitlines()[-1] == "4:990"
    calls.unlink()
    monkeypatch.setenv("LAUNCH_FUZZ_DB", str(db_path))
    result = pytester.runpytest_subprocess("-p", "launch.fuzz.replay", "-v",
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.re_match_lines([r".*test_k\[4ranks\] FAILED", r".*test_k\[2ranks\] PASSED"])
    got = calls.read_text().splitlines()
    assert got[0] == "4:990"  # the stored example, before anything else
    assert "2:990" not in got  # the other variant did not replay it


# -- --sim N: the session's slices on simulated worlds (threads of one process) ------------
SIM_TESTS = '''
import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st


@pytest.mark.world_size(2)
@given(x=st.integers(0, 100))
def test_sum(world, x):
    # rank 1 clips its contribution at 3: the all-reduced sum is wrong from x = 4 on
    t = torch.tensor([x if world.rank == 0 else min(x, 3)])
    dist.all_reduce(t, group=world.group)
    if world.rank == 0 and os.environ.get("CALLS"):
        with open(os.environ["CALLS"], "a") as f:
            f.write(f"{x}\\n")
    assert t.item() == 2 * x


_slices = [0]


@pytest.fixture
def slice_no():  # set up once per slice (one pytest run of the item)
    _slices[0] += 1
    return _slices[0]


@pytest.mark.world_size(2)
@given(x=st.integers(0, 100))
def test_second(world, slice_no, x):
    assert slice_no < 2, "reached a second slice"


@pytest.mark.world_size(4)
@given(x=st.integers(0, 100))
def test_big(world, x):
    pass
'''


@pytest.mark.slow  # a fuzzing session (~35 s on 2 cores): the full run
def test_a_sim_session_finds_shrinks_and_stores_a_failure_in_one_process(pytester, tmp_path,
                                                                         monkeypatch):
    """``python -m launch fuzz --sim 2``: the slices run in one ``pytest
    --dist-sim`` process (no torchrun), the rank-dependent bug is found and
    shrunk to the same minimal example on both simulated ranks, a property
    gets a second slice with its fixtures set up again (it fails there, on
    purpose, so the session ends by itself), a property needing more ranks
    than ``--sim`` is skipped, and a simulated ci-like run with the database
    replays the stored example first. Deterministic: the first slice's 10
    distinct examples of 0..100 include one above 3."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        pytest.skip("runs pytest subprocesses that must not join this rank's world; "
                    "plain pytest only")
    import json
    import sys

    pytester.makeconftest('pytest_plugins = ["launch.hypothesis_lockstep"]\n')
    pytester.makepyfile(test_s=SIM_TESTS)
    db, calls = tmp_path / "db", tmp_path / "calls"
    res = pytester.run(sys.executable, "-m", "launch", "fuzz", "test_s.py", "--sim", "2",
                       "--minutes", "2", "--slice", "0.5", "--db", str(db),
                       "--log-dir", str(tmp_path / "logs"),
                       timeout=240)
    out = res.stdout.str()
    assert res.ret == 1, out  # new failures; nothing left to run ends the session
    assert "2 simulated ranks" in out and "FAILED test_s.py::test_sum" in out
    (world,) = (tmp_path / "logs").glob("fuzz-*/world0.log")
    cmd = world.read_text().splitlines()[0]
    assert "--dist-sim" in cmd and "torch.distributed.run" not in cmd
    state = json.loads((db / "fuzz-state.json").read_text())
    fails = {f["nodeid"]: f for f in state["failures"]}
    assert set(fails) == {"test_s.py::test_sum", "test_s.py::test_second"}
    second = fails["test_s.py::test_second"]
    assert second["exc_type"] == "AssertionError", second  # not a fixture left unset
    assert "reached a second slice" in second["message"]
    f = fails["test_s.py::test_sum"]
    assert f["example"] == "x=4"
    assert set(f["per_rank"]) == {"0", "1"} and len(set(f["per_rank"].values())) == 1
    assert "--nproc_per_node=2" in f["replay"] and "--dist-sim" not in f["replay"]
    props = {p["nodeid"]: p for p in state["props"]}
    assert "world_size(4) > --sim 2" in props["test_s.py::test_big"]["skipped"]
    assert props["test_s.py::test_second"]["slices"] == 2
    monkeypatch.setenv("LAUNCH_FUZZ_DB", str(db))
    monkeypatch.setenv("CALLS", str(calls))
    res = pytester.run(sys.executable, "-m", "pytest", "-p", "launch.fuzz.replay", "--dist-sim",
                       "-p", "no:cacheprovider", "--hypothesis-profile=ci", "test_s.py::test_sum",
                       timeout=240)
    assert res.ret == 1, res.stdout.str()
    assert calls.read_text().splitlines()[0] == "4"  # the stored example ran first


@pytest.mark.parametrize(("argv", "says"), [
    (["--sim", "0"], "--sim must be >= 1, got 0"),
    (["--minutes", "0"], "--minutes must be > 0, got 0.0"),
    (["--nproc", "0"], "--nproc must be >= 1, got 0"),
    (["--hang", "-1"], "--hang must be > 0, got -1.0"),
])
def test_a_session_that_cannot_run_is_refused_before_any_world_starts(argv, says, capsys):
    # Was: --sim 0 silently ran real ranks and --minutes 0 an empty session
    # that reported "0 new failures" like a clean one.
    from launch.fuzz.cli import parse

    with pytest.raises(SystemExit):
        parse(["tests/properties", *argv])
    assert says in capsys.readouterr().err


def test_sim_left_out_means_real_ranks():
    from launch.fuzz.cli import parse

    args, rest = parse(["tests/properties", "--nproc", "4"])
    assert (args.sim, args.nproc, rest) == (0, 4, ["tests/properties"])
