"""The hooks the test service defines, for a project's conftest to implement.

- ``pytest_lockstep_replay_args(config)``: extra words for the ``Replay:``
  command printed with a failed property (``NAME=value`` or an option).
- ``pytest_dist_sim_smaller_worlds(item, size)``: the same test at smaller
  world sizes, for ``--dist-sim-confirm``.

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


def register(pluginmanager: pytest.PytestPluginManager) -> None:
    """Add these hook specs once, whichever of the service's plugins asks first
    (the lockstep Hypothesis plugin also loads without ``launch.plugin``)."""
    caller = getattr(pluginmanager.hook, "pytest_lockstep_replay_args", None)
    if caller is None or not caller.has_spec():
        pluginmanager.add_hookspecs(sys.modules[__name__])
