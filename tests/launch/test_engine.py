"""Covers: launch/hypo/engine.py, the one seam to a ``@given`` test's run
(layers in one order, each restoring what it replaced), and
``launch.agree.example_verdict``, the one per-example verdict that real and
simulated worlds share."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from launch.agree import example_verdict
from launch.hypo import engine


def _fresh():
    @settings(max_examples=5, database=None)
    @given(st.integers())
    def prop(x):
        calls.append(x)

    calls: list[int] = []
    return prop, calls


def test_layers_nest_in_order_and_restore_what_they_replaced() -> None:
    fn, calls = _fresh()
    before = (fn._hypothesis_internal_use_settings, fn.hypothesis.inner_test)
    seen = []

    def tag(name):
        def wrap(inner):
            def wrapped(*a, **k):
                seen.append(name)
                return inner(*a, **k)
            return wrapped
        return wrap

    with engine.layer(fn, "slice", settings=lambda cur: settings(cur, max_examples=3),
                      inner=tag("slice")):
        with engine.layer(fn, "lockstep", inner=tag("lockstep"),
                          settings=lambda cur: engine.multi_process_settings(cur)):
            assert engine.layers(fn) == ["slice", "lockstep"]
            assert fn._hypothesis_internal_use_settings.max_examples == 3
            assert fn._hypothesis_internal_use_settings.deadline is None
            fn()
    assert (fn._hypothesis_internal_use_settings, fn.hypothesis.inner_test) == before
    assert engine.layers(fn) == []
    assert len(calls) == 3 and seen[:2] == ["lockstep", "slice"]  # inner layer runs first


def test_a_layer_out_of_order_is_an_error_naming_both() -> None:
    fn, _ = _fresh()
    with engine.layer(fn, "fanout"):
        with pytest.raises(engine.LayerOrderError, match="'slice' put on .* inside 'fanout'"):
            engine.push(fn, "slice")
    with pytest.raises(engine.LayerOrderError, match="'replay' taken off"):
        engine.pop(fn, "replay")
    with pytest.raises(ValueError, match="unknown layer 'mine'"):
        engine.push(fn, "mine")


@pytest.mark.parametrize(("outcomes", "want"), [
    ({0: "pass", 1: "pass"}, ("passed", [])),
    ({0: "pass", 1: "fail"}, ("failed", [1])),
    ({0: "reject", 1: "pass"}, ("rejected", [0])),
    ({0: "fail", 1: "reject"}, ("failed", [0])),
    ({0: "found", 1: "found"}, ("found", [0, 1])),
    ({0: "found", 1: "pass"}, ("diverged", [0])),
    ({0: "control", 1: "control"}, ("control", [0, 1])),
    ({0: "control", 1: "pass"}, ("diverged", [0])),
    ({0: "control", 1: "released"}, ("control", [0])),  # let out by rank 0's skip
    ({0: "fail", 1: "released"}, ("failed", [0])),
    ({0: "pass", 1: "released"}, ("diverged", [1])),
    ({0: "hung", 1: "fail"}, ("diverged", [0])),
])
def test_example_verdict(outcomes: dict[int, str], want: tuple) -> None:
    assert example_verdict(outcomes) == want


def test_example_verdict_rejects_an_unknown_outcome() -> None:
    with pytest.raises(ValueError, match="unknown outcome"):
        example_verdict({0: "passed"})
