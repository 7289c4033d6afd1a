"""dtensor: a fast, correct distributed-tensor runtime for PyTorch.

Public names mirror ``torch.distributed.tensor``; switch by changing the import.
"""

from __future__ import annotations

from dtensor.dispatch import implicit_replication
from dtensor.errors import MeshError, PlacementError, ShardingError, UnsupportedOpError
from dtensor.factories import (
    empty,
    full,
    manual_seed,
    ones,
    rand,
    randint,
    randn,
    zeros,
)
from dtensor.mesh import DeviceMesh, current_mesh, init_device_mesh
from dtensor.placement import Partial, Placement, Replicate, Shard
from dtensor.sharding import OpCall, Sharding, register_rule
from dtensor.spec import DTensorSpec, TensorMeta
from dtensor.tensor import DTensor, distribute_tensor

__all__ = [
    "DTensor",
    "DTensorSpec",
    "DeviceMesh",
    "MeshError",
    "OpCall",
    "Partial",
    "Placement",
    "PlacementError",
    "Replicate",
    "Shard",
    "Sharding",
    "ShardingError",
    "TensorMeta",
    "UnsupportedOpError",
    "current_mesh",
    "distribute_tensor",
    "empty",
    "full",
    "implicit_replication",
    "init_device_mesh",
    "manual_seed",
    "ones",
    "rand",
    "randint",
    "randn",
    "register_rule",
    "zeros",
]
