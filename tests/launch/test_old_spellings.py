"""Covers: plugin spellings from configs written for the flat ``launch/``
layout: ``-p launch.hypothesis_lockstep`` and ``pytest_plugins =
["launch.given_lockstep"]`` still load the plugins they named (profiles,
lockstep Hypothesis), and a module name the service no longer has fails with
an error that names the new module."""

from __future__ import annotations

import pytest

# Imported before pytester snapshots sys.modules: the lockstep plugin imports
# torch.distributed around each test, and pytester drops what a test imported,
# so the next test would load torch's C extension a second time (a crash).
import torch  # noqa: F401

pytest_plugins = ["pytester"]

# The quick tier runs the two tests that load each moved module by its old name.
QUICK = ("test_p_hypothesis_lockstep_loads_the_profiles",
         "test_given_lockstep_in_pytest_plugins_loads_the_lockstep_plugin")

SUITE = """
from hypothesis import given, settings, strategies as st

def test_profile_is_loaded(pytestconfig):
    assert pytestconfig.pluginmanager.has_plugin("launch.hypo.profiles")
    assert settings._current_profile == "ci"
    assert settings().max_examples == 25

@given(st.integers())
def test_given(x):
    assert isinstance(x, int)
"""


def test_p_hypothesis_lockstep_loads_the_profiles(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_old=SUITE)
    r = pytester.runpytest_subprocess("-p", "launch.hypothesis_lockstep",
                                      "--hypothesis-profile=ci", "-p", "no:cacheprovider")
    r.assert_outcomes(passed=2)


def test_given_lockstep_in_pytest_plugins_loads_the_lockstep_plugin(
        pytester: pytest.Pytester) -> None:
    pytester.makeconftest('pytest_plugins = ["launch.given_lockstep"]\n')
    pytester.makepyfile(test_old="def test_a(pytestconfig):\n"
                        "    assert pytestconfig.pluginmanager.has_plugin("
                        "'launch.hypo.lockstep')\n"
                        "    assert pytestconfig.getoption('lockstep_timeout') == 300\n")
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    r.assert_outcomes(passed=1)


def test_a_moved_module_name_says_where_it_went(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_old="def test_a(): pass\n")
    r = pytester.runpytest_subprocess("-p", "launch.lockstep", "-p", "no:cacheprovider")
    assert r.ret != 0
    assert "launch.lockstep is now launch.modes.lockstep" in r.stderr.str() + r.stdout.str()
