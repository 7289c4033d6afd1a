"""How a DTensor presents itself to ``torch.save`` and to
``torch.distributed.checkpoint`` (DCP): pure functions of its local block and
spec, which ``DTensor``'s protocol methods call.

This module sits below ``dtensor.tensor`` (it never needs the DTensor class),
so the tensor can call it directly; ``dtensor.checkpoint`` (save/load over a
state dict's ranks) sits above both.
"""

from __future__ import annotations

import torch

from dtensor.errors import PlacementError, ShardingError
from dtensor.placement import Partial, Placement, Replicate, Shard

__all__ = [
    "create_chunk_list",
    "create_write_items",
    "decode_placement",
    "get_tensor_shard",
    "reduce_args",
    "refuse_partial",
]


# torch.save / torch.load -----------------------------------------------------
def encode_placement(p: Placement) -> tuple:
    if isinstance(p, Shard):
        return ("S", p.dim)
    if isinstance(p, Partial):
        return ("P", p.reduce_op)
    return ("R",)


def decode_placement(code: tuple) -> Placement:
    kind = code[0]
    if kind == "S":
        return Shard(int(code[1]))
    if kind == "P":
        return Partial(str(code[1]))
    if kind == "R":
        return Replicate()
    raise ShardingError(f"rebuild_dtensor: unknown placement code {code!r} in the file")


def reduce_args(dt) -> tuple:
    """The arguments of ``dtensor.tensor.rebuild_dtensor`` that rebuild ``dt``:
    only primitives, tensors and dtypes, so ``torch.load(weights_only=True)``
    needs nothing allowlisted but that one function (no mesh, spec or
    placement classes)."""
    spec = dt._spec
    mesh = spec.mesh
    args = (
        dt._local_tensor.detach(),
        mesh.device_type,
        tuple(mesh.ranks),
        tuple(mesh.shape),
        tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        tuple(encode_placement(p) for p in spec.placements),
        tuple(spec.shape),
        tuple(spec.stride),
        bool(dt.requires_grad),
    )
    return args


# The DCP tensor-subclass protocol --------------------------------------------
def refuse_partial(dt, what: str) -> None:
    spec = dt._spec
    if spec.has_partial():
        raise PlacementError(
            f"{what}: cannot checkpoint a DTensor with Partial placements "
            f"{spec}; reduce it first, e.g. dt.redistribute(mesh, "
            "[Replicate() if p.is_partial() else p for p in dt.placements])"
        )


def _chunk(dt):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    sizes, offsets = dt._spec.local_block(dt._spec.mesh.get_coordinate())
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def _holds_data(dt) -> bool:
    # Outsiders hold nothing; an empty trailing shard (uneven) adds nothing
    # either, and DCP treats chunks as non-empty boxes.
    if dt._spec.mesh.get_coordinate() is None:
        return False
    sizes, _ = dt._spec.local_block(dt._spec.mesh.get_coordinate())
    return all(s > 0 for s in sizes) or len(sizes) == 0


def create_write_items(dt, fqn: str) -> list:
    """DCP: one write item for this rank's block (none outside the mesh).

    Replicas produce the same item (same offsets); DCP keeps one of them.
    """
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import (
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    refuse_partial(dt, f"checkpoint save of {fqn!r}")
    if not _holds_data(dt):
        return []
    chunk = _chunk(dt)
    return [
        WriteItem(
            index=MetadataIndex(fqn, chunk.offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=chunk,
                properties=TensorProperties.create_from_tensor(dt._local_tensor),
                size=torch.Size(dt._spec.shape),
            ),
        )
    ]


def create_chunk_list(dt) -> list:
    """DCP: the global boxes this rank's block covers (none outside the mesh)."""
    refuse_partial(dt, "checkpoint load")
    return [_chunk(dt)] if _holds_data(dt) else []


def get_tensor_shard(dt, index) -> torch.Tensor:
    """DCP: the local tensor that holds the box at ``index`` (written in place on load)."""
    refuse_partial(dt, f"checkpoint of {getattr(index, 'fqn', index)!r}")
    return dt._local_tensor
