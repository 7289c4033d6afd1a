"""Covers: launch/fuzz/nodedb.py, replay.py and rank.py's slice settings: a
failure a fuzzing run stores is replayed first by the next run, in its own
node id and variant only, in real and simulated worlds."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

from launch.fuzz.nodedb import per_node
from launch.fuzz.rank import slice_settings
from launch.fuzz.replay import replay_seed, replay_settings

pytest_plugins = ["pytester"]


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
