"""dtensor: a fast, correct distributed-tensor runtime for PyTorch.

Public names mirror ``torch.distributed.tensor``; switch by changing the import.
"""

from __future__ import annotations

# checkpoint registers DTensor's rebuild function for torch.load(weights_only=True).
from dtensor import (
    checkpoint,
    debug,
    experimental,
    interop,
    parallel,
)
from dtensor.dispatch import implicit_replication
from dtensor.distribute import distribute_tensor
from dtensor.errors import (
    CrossMeshError,
    MeshAxisError,
    MeshError,
    PlacementError,
    ShardDimError,
    ShardingError,
    UnsupportedOpError,
)
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
from dtensor.module import distribute_module
from dtensor.placement import Partial, Placement, Replicate, Shard, StridedShard
from dtensor.sharding import OpCall, Sharding, register_rule
from dtensor.spec import DTensorSpec, TensorMeta
from dtensor.tensor import DTensor

__all__ = [
    "CrossMeshError",
    "DTensor",
    "DTensorSpec",
    "DeviceMesh",
    "MeshAxisError",
    "MeshError",
    "OpCall",
    "Partial",
    "Placement",
    "PlacementError",
    "Replicate",
    "Shard",
    "ShardDimError",
    "Sharding",
    "ShardingError",
    "StridedShard",
    "TensorMeta",
    "UnsupportedOpError",
    "checkpoint",
    "current_mesh",
    "debug",
    "distribute_module",
    "distribute_tensor",
    "empty",
    "experimental",
    "full",
    "implicit_replication",
    "init_device_mesh",
    "interop",
    "manual_seed",
    "ones",
    "parallel",
    "rand",
    "randint",
    "randn",
    "register_rule",
    "zeros",
]
