"""Covers: Hypothesis' local literal pool is pinned (emptied) only where the
service needs every process to draw the same examples: in rank processes and
simulated worlds. A user's own plain test in a repository with the plugin
installed draws from Hypothesis' unmodified pool."""

from __future__ import annotations

import pytest

# Imported before pytester snapshots sys.modules (see test_old_spellings.py).
import torch  # noqa: F401

pytest_plugins = ["pytester"]

SUITE = """
import pytest

def _pinned():
    from hypothesis.internal.conjecture import providers
    return providers._get_local_constants.__module__.startswith("launch")

def test_plain():
    assert _pinned() is EXPECT_PLAIN

@pytest.mark.world_size(2)
def test_in_a_world(world):
    assert _pinned()
"""


@pytest.mark.slow  # a child run in real worlds (~35 s on 2 cores): the full run
def test_a_plain_run_leaves_the_pool_alone_and_pins_its_worlds(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_pool=SUITE.replace("EXPECT_PLAIN", "False"))
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    r.assert_outcomes(passed=2)  # the world's ranks (server mode) are pinned


def test_a_simulated_run_pins_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_pool=SUITE.replace("EXPECT_PLAIN", "True"))
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--dist-sim")
    r.assert_outcomes(passed=2)
