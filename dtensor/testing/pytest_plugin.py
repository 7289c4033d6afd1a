"""The installed pytest plugin for proving users' rules and plans (``pytest11``).

With the package installed, any repository gets, with no conftest:

- the ``dtensor_verify`` fixture: ``dtensor_verify.rule(op, samples)``,
  ``.certify(op, ...)``, ``.plan(make_model, plan, inputs=...)``; it takes
  the test service's ``world`` fixture, so the test runs on a world
  (``pytest``, ``torchrun --nproc_per_node=4 -m pytest``, ``pytest --dist-sim``);
- the ``dtensor_impl("torch")`` marker: run them on ``torch.distributed.tensor``
  instead of this runtime (default ``"dtensor"``).

Nothing heavy is imported until a test asks for the fixture (this module is
loaded by every pytest run in an environment where the package is installed).

Example:
    >>> @pytest.mark.world_size(4)
    ... def test_my_rule(dtensor_verify):
    ...     dtensor_verify.rule(torch.ops.mylib.scale.default)
"""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["Verifier"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "dtensor_impl(name): the DTensor runtime dtensor_verify checks on: "
        "'dtensor' (default) or 'torch'")


class Verifier:
    """``verify_rule`` / ``certify_rule`` / ``verify_plan`` bound to one runtime."""

    def __init__(self, impl: str, world: Any) -> None:
        self.impl = impl
        self.world = world

    def rule(self, op: Any, sample_inputs: Any = None, **kwargs: Any) -> None:
        """``dtensor.testing.verify_rule`` on this runtime."""
        from dtensor.testing.verify import verify_rule

        verify_rule(op, sample_inputs, **{"impl": self.impl, **kwargs})

    def certify(self, op: Any, make_args: Any = None, **kwargs: Any) -> Any:
        """``dtensor.testing.certify_rule`` on this runtime; fails on a wrong case."""
        from dtensor.testing.certify import certify_rule

        return certify_rule(op, make_args, **{"impl": self.impl, **kwargs})

    def plan(self, make_model: Any, plan: Any, **kwargs: Any) -> None:
        """``dtensor.testing.verify_plan.verify_plan`` on this runtime."""
        from dtensor.testing.verify_plan import verify_plan

        verify_plan(make_model, plan, **{"impl": self.impl, **kwargs})


@pytest.fixture
def dtensor_verify(request: pytest.FixtureRequest, world: Any) -> Verifier:
    """Prove a rule or a plan against single device on the test's world."""
    marker = request.node.get_closest_marker("dtensor_impl")
    impl = marker.args[0] if marker and marker.args else "dtensor"
    if impl not in ("dtensor", "torch"):
        raise pytest.UsageError(
            f"dtensor_impl({impl!r}): expected 'dtensor' or 'torch'")
    return Verifier(impl, world)
