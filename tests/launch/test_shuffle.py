"""Covers: launch/shuffle.py (``--shuffle SEED``): a seeded order that is the
same for the same seed, differs for another, keeps every test once and keeps
a module's tests together; and a child suite really runs in that order."""

from __future__ import annotations

import pytest

from launch.shuffle import shuffled

pytest_plugins = ["pytester"]

IDS = [f"m{m}.py::t{t}" for m in range(5) for t in range(6)]


def _module(i: str) -> str:
    return i.split("::")[0]


def test_same_seed_same_order_other_seed_other_order() -> None:
    a, b, c = shuffled(list(IDS), 3, _module), shuffled(list(IDS), 3, _module), shuffled(list(IDS), 4, _module)
    assert a == b and a != c and a != IDS
    assert sorted(a) == sorted(IDS)


def test_a_modules_tests_stay_together() -> None:
    order = [_module(i) for i in shuffled(list(IDS), 11, _module)]
    runs = [m for k, m in enumerate(order) if k == 0 or order[k - 1] != m]
    assert len(runs) == len(set(runs)) == 5


def test_child_suite_runs_in_the_shuffled_order(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(**{f"test_m{m}": "\n".join(
        f"def test_t{t}(): pass" for t in range(4)) for m in range(3)})
    want = [i.split("::")[0].removesuffix(".py") + "::" + i.split("::")[1] for i in shuffled(
        [f"test_m{m}.py::test_t{t}" for m in range(3) for t in range(4)], 5, _module)]
    result = pytester.runpytest("-p", "launch.shuffle", "--shuffle", "5", "-v")
    result.assert_outcomes(passed=12)
    ran = [line.split(" ")[0] for line in result.outlines if " PASSED" in line]
    assert [r.replace(".py", "") for r in ran] == want
    assert any("shuffled order, seed 5" in line for line in result.outlines)
