"""Covers: dtensor/testing/verify_shrink.py: cases drawn from seeds and the
first failing one shrunk without Hypothesis' engine (the form ``verify_*``
take in simulated worlds). Without a process group the verdicts are this
process's own; the lockstep across rank threads is run by
``pytest --dist-sim tests/test_verify_rule_dist.py``."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st

from dtensor.testing.rule_case import RuleCounterexample
from dtensor.testing.verify_shrink import run_drawn


def _sum_and_scale(data) -> None:
    xs = data.draw(st.lists(st.integers(0, 100)))
    y = data.draw(st.floats(0, 10))
    assert not (sum(xs) > 30 and y > 1), f"xs={xs} y={y}"


def test_a_failing_case_is_shrunk_to_the_smallest() -> None:
    with pytest.raises(RuleCounterexample) as e:
        run_drawn(_sum_and_scale, 100, base_seed=7)
    msg = str(e.value)
    assert msg.startswith("xs=[31] y=2.0\n"), msg
    assert "drawn from seeds in a simulated world and shrunk there" in msg, msg


def test_the_budget_bounds_the_shrinking() -> None:
    with pytest.raises(RuleCounterexample) as e:
        run_drawn(_sum_and_scale, 100, base_seed=7, max_shrinks=3)
    msg = str(e.value)
    assert "3 smaller candidates tried, budget spent" in msg, msg


def test_rejected_cases_are_not_failures_and_passing_ones_raise_nothing() -> None:
    from hypothesis import reject

    def example(data) -> None:
        x = data.draw(st.integers(0, 10))
        if x % 2:
            reject()
        assert x % 2 == 0

    run_drawn(example, 50, base_seed=1)


def test_the_error_class_is_the_callers() -> None:
    class PlanWrong(AssertionError):
        pass

    def example(data) -> None:
        assert data.draw(st.integers(0, 3)) < 0, "never"

    with pytest.raises(PlanWrong, match="never"):
        run_drawn(example, 5, base_seed=0, error=PlanWrong)
