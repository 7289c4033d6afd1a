"""Crossing over to and from ``torch.distributed.tensor.DTensor``.

``to_torch(dt)`` gives PyTorch's DTensor over the same ranks, placements and
local tensor (same storage, no copy), so code that needs PyTorch's own type
(FSDP2's ``fully_shard``, libraries that check ``isinstance``) can take ours;
``from_torch(tdt)`` comes back. Both are differentiable: gradients flow
through the conversion as through ``to_local``/``from_local``.

Meshes map one to one: PyTorch's mesh is built from our mesh's process groups
(``DeviceMesh.from_group``, no new groups, no collective), and ours from
PyTorch's ranks (our meshes create their groups among their own ranks only).
Each mesh is converted once and cached.

Example:
    >>> from dtensor.interop import to_torch, from_torch
    >>> t = to_torch(x)                       # torch.distributed.tensor.DTensor
    >>> t.to_local().data_ptr() == x.to_local().data_ptr()
    True
    >>> y = from_torch(t * 2)                 # back to dtensor.DTensor

Differences: an n-D mesh without axis names gets names ``"dim0"``,
``"dim1"``... on PyTorch's side (its ``from_group`` needs names). PyTorch's
internal placements (``_StridedShard``, masked partials) have no counterpart
and are refused.
"""

from __future__ import annotations

import math
import threading

import torch

from dtensor.errors import MeshError, PlacementError
from dtensor.mesh import DeviceMesh
from dtensor.placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    norm_partial,
)

__all__ = ["from_torch", "from_torch_mesh", "to_torch", "to_torch_mesh"]

_lock = threading.Lock()
_to_torch_meshes: dict = {}
_from_torch_meshes: dict = {}


def to_torch_mesh(mesh: DeviceMesh):
    """PyTorch's ``DeviceMesh`` over the same ranks, sharing this mesh's groups."""
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"to_torch_mesh: expected a dtensor.DeviceMesh, got {type(mesh).__name__}")
    with _lock:
        tm = _to_torch_meshes.get(mesh)
        if tm is not None:
            return tm
        names = mesh.mesh_dim_names
        if names is None and mesh.ndim > 1:
            names = tuple(f"dim{i}" for i in range(mesh.ndim))
        grid = mesh.mesh.to(torch.int)
        if mesh.get_coordinate() is None:
            # Outsiders hold no groups; PyTorch's mesh only needs the layout.
            tm = TorchMesh(mesh.device_type, grid, mesh_dim_names=names, _init_backend=False)
        elif mesh.ndim == 1:
            tm = TorchMesh.from_group(
                mesh.get_group(0), mesh.device_type, mesh=grid.tolist(), mesh_dim_names=names
            )
        else:
            groups = [mesh.get_group(a) for a in range(mesh.ndim)]
            tm = TorchMesh.from_group(groups, mesh.device_type, mesh=grid, mesh_dim_names=names)
        _to_torch_meshes[mesh] = tm
        return tm


def from_torch_mesh(tmesh) -> DeviceMesh:
    """Our ``DeviceMesh`` over the same ranks as PyTorch's ``tmesh``."""
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    if not isinstance(tmesh, TorchMesh):
        raise MeshError(
            f"from_torch_mesh: expected a torch.distributed DeviceMesh, got {type(tmesh).__name__}"
        )
    grid = tmesh.mesh.to(torch.int64)
    names = tuple(tmesh.mesh_dim_names) if tmesh.mesh_dim_names else None
    key = (tmesh.device_type, tuple(grid.flatten().tolist()), tuple(grid.shape), names)
    with _lock:
        mesh = _from_torch_meshes.get(key)
        if mesh is None:
            mesh = _from_torch_meshes[key] = DeviceMesh(
                tmesh.device_type, grid, mesh_dim_names=names
            )
        return mesh


def _placement_to_torch(p: Placement):
    from torch.distributed.tensor import Partial as TPartial
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard

    if isinstance(p, Shard):
        return TShard(p.dim)
    if isinstance(p, StridedShard):  # the same rows as PyTorch's private placement
        from torch.distributed.tensor.placement_types import _StridedShard

        return _StridedShard(p.dim, split_factor=p.split_factor)
    if isinstance(p, Partial):
        order = p.norm_order
        if order is None:
            return TPartial(p.reduce_op)
        if order == math.inf:  # pieces are >= 0: their max is the inf-norm
            return TPartial("max")
        if order == 0:  # counts of non-zeros add up
            return TPartial("sum")
        from torch.distributed.tensor._ops._math_ops import _NormPartial

        return _NormPartial(order)
    return TReplicate()


def _placement_from_torch(p) -> Placement:
    from torch.distributed.tensor import Partial as TPartial
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard

    if type(p) is TShard:
        return Shard(p.dim)
    if type(p) is TReplicate:
        return Replicate()
    if type(p) is TPartial:
        return Partial(p.reduce_op)
    if type(p).__name__ == "_StridedShard":
        return StridedShard(p.dim, int(p.split_factor))
    if type(p).__name__ == "_NormPartial" and hasattr(p, "norm_type"):
        return norm_partial(p.norm_type)
    raise PlacementError(
        f"from_torch: PyTorch placement {p!r} ({type(p).__name__}) has no dtensor "
        "counterpart; redistribute it to Shard/Replicate/Partial first, e.g. "
        "tdt.redistribute(tdt.device_mesh, [Replicate()] * tdt.device_mesh.ndim)"
    )


def to_torch(dt):
    """This DTensor as a ``torch.distributed.tensor.DTensor`` (same local storage).

    Differentiable: a gradient reaching the result flows back to ``dt``.
    """
    from torch.distributed.tensor import DTensor as TorchDTensor

    from dtensor.tensor import DTensor

    if not isinstance(dt, DTensor):
        raise PlacementError(f"to_torch: expected a dtensor.DTensor, got {type(dt).__name__}")
    spec = dt._spec
    tmesh = to_torch_mesh(spec.mesh)
    placements = [_placement_to_torch(p) for p in spec.placements]
    return TorchDTensor.from_local(
        dt.to_local(), tmesh, placements, run_check=False,
        shape=torch.Size(spec.shape), stride=tuple(spec.stride),
    )


def from_torch(tdt):
    """A ``torch.distributed.tensor.DTensor`` as our DTensor (same local storage).

    Differentiable: a gradient reaching the result flows back to ``tdt``.
    """
    from torch.distributed.tensor import DTensor as TorchDTensor

    from dtensor.tensor import DTensor

    if not isinstance(tdt, TorchDTensor):
        raise PlacementError(
            f"from_torch: expected a torch.distributed.tensor.DTensor, got {type(tdt).__name__}"
        )
    mesh = from_torch_mesh(tdt.device_mesh)
    placements = tuple(_placement_from_torch(p) for p in tdt.placements)
    return DTensor.from_local(
        tdt.to_local(), mesh, placements, shape=tuple(tdt.shape), stride=tuple(tdt.stride())
    )
