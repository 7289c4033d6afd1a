"""The hooks the test service defines, for a project's conftest to implement.

- ``pytest_lockstep_replay_args(config)``: extra words for the ``Replay:``
  command printed with a failed property (``NAME=value`` or an option).
- ``pytest_dist_sim_smaller_worlds(item, size)``: the same test at smaller
  world sizes, for ``--dist-sim-confirm``.
- ``pytest_launch_classify(config, values, op)``: the input classes of one
  fuzzing example in the project's own terms (``python -m launch fuzz``).

Example (a conftest)::

    def pytest_lockstep_replay_args(config):
        return ["MY_IMPL=fast", "--my-option=1"]
"""

from __future__ import annotations

import sys

import pytest

__all__ = ["register"]


@pytest.hookspec
def pytest_lockstep_replay_args(config: pytest.Config) -> list[str]:
    """Extra words for the ``Replay:`` command of a failed property:
    ``NAME=value`` (an environment variable) or a pytest option."""


@pytest.hookspec(firstresult=True)
def pytest_dist_sim_smaller_worlds(item: pytest.Item, size: int) -> list | None:
    """The same test at smaller world sizes, as ``[(m, nodeid, env), ...]``
    (``env``: variables the run at m needs). A project whose tests take
    their world size from a parameter implements it; without it,
    ``--dist-sim-confirm`` only re-runs the failure at its own size."""


@pytest.hookspec(firstresult=True)
def pytest_launch_classify(config: pytest.Config, values: list, op: str) -> dict | None:
    """Input classes of one fuzzing example, from its drawn ``(label, value)``
    pairs and its op (a draw labelled ``op``, or the test's parametrization):
    ``{class: value}``, e.g. ``{"mesh": "2x2", "dtype": "float32"}``. A class
    value not seen before counts as progress for the scheduler. None: the
    service's own classes (``launch.fuzz.probe.classify``: tensors only)."""


def register(pluginmanager: pytest.PytestPluginManager) -> None:
    """Add these hook specs once, whichever of the service's plugins asks first
    (the lockstep Hypothesis plugin also loads without ``launch.plugin``)."""
    caller = getattr(pluginmanager.hook, "pytest_lockstep_replay_args", None)
    if caller is None or not caller.has_spec():
        pluginmanager.add_hookspecs(sys.modules[__name__])
