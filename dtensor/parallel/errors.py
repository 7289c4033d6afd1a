"""Errors of tensor-parallel plans.

``PlanError`` is a ``ValueError`` (where PyTorch raises ``ValueError``, users
catch that); ``UnsupportedModuleError`` is also a ``NotImplementedError``,
which PyTorch raises for a style applied to a module type it cannot shard.
"""

from __future__ import annotations

from dtensor.errors import ShardingError

__all__ = ["PlanError", "UnsupportedModuleError"]


class PlanError(ShardingError, ValueError):
    """A parallelize plan, a style's arguments or a module's inputs are malformed."""


class UnsupportedModuleError(PlanError, NotImplementedError):
    """A parallel style was applied to a module type it does not know how to shard."""
