"""Covers: launch/agree.py (outcome agreement rules, no processes)."""

from __future__ import annotations

import json

from _pytest.reports import TestReport

from launch import agree

LOC = ("t.py", 1, "test_x")


def _rep(when: str, outcome: str, longrepr: object = None) -> TestReport:
    return TestReport("t.py::test_x", LOC, {}, outcome, longrepr, when)


def _passing() -> list[TestReport]:
    return [_rep("setup", "passed"), _rep("call", "passed"), _rep("teardown", "passed")]


def test_all_passed_is_the_one_character_fast_path() -> None:
    assert agree.verdict(_passing()) == "P"
    assert agree.decide(["P", "P"], (0, 1)) is None


def test_failure_on_one_rank_fails_everywhere_naming_the_rank() -> None:
    failing = [_rep("setup", "passed"), _rep("call", "failed", "E boom"), _rep("teardown", "passed")]
    d = agree.decide(["P", agree.verdict(failing)], (0, 1))
    assert d is not None and d.when == "call"
    assert d.short == "failed on rank 1 of 2 (rank 0: passed)"
    assert "rank 1 (call)" in d.text and "E boom" in d.text
    out = agree.apply(d, _passing(), "t.py::test_x", LOC)
    assert [(r.when, r.outcome) for r in out] == [
        ("setup", "passed"), ("call", "failed"), ("teardown", "passed")]


def test_skip_on_some_ranks_and_pass_on_others_is_an_error() -> None:
    skipped = [_rep("setup", "skipped", ("t.py", 3, "Skipped: no gpu")), _rep("teardown", "passed")]
    d = agree.decide(["P", agree.verdict(skipped)], (0, 1))
    assert d is not None and d.when == "setup"
    assert "passed on ranks 0" in d.text and "skipped on ranks 1 (no gpu)" in d.text
    out = agree.apply(d, skipped, "t.py::test_x", LOC)
    assert [(r.when, r.outcome) for r in out] == [("setup", "failed"), ("teardown", "passed")]


def test_skip_everywhere_is_kept_and_non_members_do_not_count() -> None:
    v = agree.verdict([_rep("setup", "skipped", ("t.py", 3, "Skipped: why"))])
    assert json.loads(v)[0] == "skipped"
    assert agree.decide([v, v, "-"], (0, 1)) is None
    assert agree.decide(["P", "P", "-", "-"], (0, 1)) is None


def test_earliest_failing_phase_wins() -> None:
    setup_err = agree.verdict([_rep("setup", "failed", "E fixture")])
    call_fail = agree.verdict([_rep("setup", "passed"), _rep("call", "failed", "E call")])
    d = agree.decide([call_fail, setup_err], (0, 1))
    assert d is not None and d.when == "setup"
    assert d.short == "failed on ranks 0, 1 of 2"


def test_a_rank_missing_the_test_fails_it() -> None:
    d = agree.decide(["P", agree.missing_verdict(1, "t.py::test_x")], (0, 1))
    assert d is not None and "not collected on rank 1" in d.text
