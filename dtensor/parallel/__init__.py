"""Tensor parallelism on DTensors: plans of per-module styles (``torch.distributed.tensor.parallel``).

Example:
    >>> from dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    >>> parallelize_module(mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
"""

from __future__ import annotations

from dtensor.parallel.api import parallelize_module
from dtensor.parallel.errors import PlanError, UnsupportedModuleError
from dtensor.parallel.loss import loss_parallel
from dtensor.parallel.prepare import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
)
from dtensor.parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PlanError",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "UnsupportedModuleError",
    "loss_parallel",
    "parallelize_module",
]
