"""Errors raised by the runtime.

Every error is a ``RuntimeError`` or ``ValueError`` subclass, never a
``TypeError``: torch's operator wrappers turn a ``TypeError`` raised inside a
subclass hook into "unsupported operand type(s)", which hides the message.
"""

from __future__ import annotations

__all__ = ["MeshError", "PlacementError", "ShardingError", "UnsupportedOpError"]


class ShardingError(RuntimeError):
    """An operation cannot be carried out with the given placements or meshes."""


class PlacementError(ShardingError, ValueError):
    """A placement or a list of placements does not fit the mesh or the tensor."""


class MeshError(ShardingError, ValueError):
    """A device mesh is malformed, or operands live on different meshes."""


class UnsupportedOpError(ShardingError):
    """No sharding rule can run this op, and the replicate fallback is not allowed."""
