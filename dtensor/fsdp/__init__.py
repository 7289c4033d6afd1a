"""Fully sharded data parallelism on DTensors (``torch.distributed.fsdp``'s FSDP2 API).

Example:
    >>> from dtensor.fsdp import fully_shard
    >>> for block in model.layers:
    ...     fully_shard(block, mesh=mesh)
    >>> fully_shard(model, mesh=mesh)
"""

from __future__ import annotations

from dtensor.fsdp.api import FSDPModule, fully_shard
from dtensor.fsdp.errors import FSDPError
from dtensor.fsdp.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "CPUOffloadPolicy",
    "FSDPError",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "fully_shard",
]
