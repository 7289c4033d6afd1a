"""Errors raised by the runtime.

Every error is a ``ShardingError`` (a ``RuntimeError``) and never a
``TypeError``: torch's operator wrappers turn a ``TypeError`` raised inside a
subclass hook into "unsupported operand type(s)", which hides the message.

Where ``torch.distributed.tensor`` raises another built-in type for the same
mistake, ours is a subclass of that type too, so ``except ValueError:`` (or
``KeyError``, ``IndexError``, ``NotImplementedError``) written for PyTorch
catches ours as well; the message stays ours (expected, got, fix):

==========================  =========================  ======================
mistake                     torch raises               ours (also a ...)
==========================  =========================  ======================
wrong number of placements  ValueError                 PlacementError (ValueError)
shard dim out of range      IndexError                 ShardDimError (ValueError, IndexError)
unknown mesh axis name      KeyError                   MeshAxisError (ValueError, KeyError)
mesh axis index too large   IndexError                 MeshAxisError (... , IndexError)
redistribute across meshes  NotImplementedError        CrossMeshError (NotImplementedError)
malformed mesh, world size  RuntimeError               MeshError (RuntimeError)
ops on mixed meshes/types   RuntimeError               ShardingError
malformed parallelize plan  ValueError                 PlanError (ValueError)
style on an unknown module  NotImplementedError        UnsupportedModuleError (NotImplementedError)
==========================  =========================  ======================

Example:
    >>> try:
    ...     distribute_tensor(t, mesh, [Shard(0), Shard(1)])   # 1-D mesh
    ... except ValueError as e:                                 # as with torch
    ...     print(type(e).__name__)
    PlacementError
"""

from __future__ import annotations

__all__ = [
    "CrossMeshError",
    "MeshAxisError",
    "MeshError",
    "PlacementError",
    "PlanError",
    "ShardDimError",
    "ShardingError",
    "UnsupportedModuleError",
    "UnsupportedOpError",
]


class ShardingError(RuntimeError):
    """An operation cannot be carried out with the given placements or meshes."""

    # KeyError (a base of MeshAxisError) quotes its message in str(); every
    # error of ours prints its message as written.
    def __str__(self) -> str:
        return BaseException.__str__(self)


class PlacementError(ShardingError, ValueError):
    """A placement or a list of placements does not fit the mesh or the tensor."""


class ShardDimError(PlacementError, IndexError):
    """A ``Shard(dim)`` names a tensor dim the tensor does not have."""


class MeshError(ShardingError, ValueError):
    """A device mesh is malformed, or operands live on different meshes."""


class MeshAxisError(MeshError, KeyError, IndexError):
    """A mesh axis (by name or index) that the mesh does not have."""


class CrossMeshError(MeshError, NotImplementedError):
    """A DTensor cannot move to another mesh by ``redistribute``."""


class UnsupportedOpError(ShardingError):
    """No sharding rule can run this op, and the replicate fallback is not allowed."""


class PlanError(ShardingError, ValueError):
    """A parallelize plan, a style's arguments or a module's inputs are malformed."""


class UnsupportedModuleError(PlanError, NotImplementedError):
    """A parallel style was applied to a module type it does not know how to shard."""
