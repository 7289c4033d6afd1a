"""Errors of tensor-parallel plans, re-exported from ``dtensor.errors``.

They live with the other errors so that modules below ``parallel`` (such as
``dtensor.module``) raise them without importing upward. ``PlanError`` is a
``ValueError`` (where PyTorch raises ``ValueError``, users catch that);
``UnsupportedModuleError`` is also a ``NotImplementedError``, which PyTorch
raises for a style applied to a module type it cannot shard.
"""

from __future__ import annotations

from dtensor.errors import PlanError, UnsupportedModuleError

__all__ = ["PlanError", "UnsupportedModuleError"]
