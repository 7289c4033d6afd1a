"""Where ``fully_shard`` puts a parameter: its mesh, placements and unsharded spec.

- A plain parameter on a 1-D mesh: ``(Shard(0),)``; on a 2-D mesh (HSDP,
  axes ``(replicate, shard)``): ``(Replicate(), Shard(0))``.
- A DTensor on the ``tp`` axis of a 2-D mesh, with ``fully_shard`` given the
  other axis (``mesh["dp"]``): the tensor-parallel block is split again by
  rows over ``dp``. That layout is the spec ``(tp placement, Shard(0))`` on
  the mesh with its axes in the order ``(tp, dp)``: placements apply axis by
  axis, so ``tp`` cuts first and ``dp`` cuts each of its blocks, which is
  the interleaving FSDP over TP needs when both shard dim 0 (PyTorch spells
  it ``(_StridedShard(0, split_factor=tp), Shard(0))`` on ``(dp, tp)``).
  Every parameter of such a model uses that one mesh, so optimizers, norms
  and checkpoints see one mesh.
"""

from __future__ import annotations

from dtensor.fsdp.errors import FSDPError
from dtensor.mesh import DeviceMesh
from dtensor.placement import Replicate, Shard
from dtensor.tensor import DTensor

__all__ = ["fsdp_layout"]

_transposed: dict = {}


def fsdp_layout(param, path: str, mesh: DeviceMesh):
    """((mesh, shard axis, replicate axis or None), placements, inner spec or None)."""
    if not isinstance(param, DTensor):
        if mesh.ndim == 1:
            return (mesh, 0, None), (Shard(0),), None
        if mesh.ndim == 2:
            return (mesh, 1, 0), (Replicate(), Shard(0)), None
        raise FSDPError(
            f"fully_shard: expected a 1-D data-parallel mesh or a 2-D (replicate, shard) "
            f"mesh, got {mesh} ({mesh.ndim} axes); pass mesh['dp'] (or "
            "mesh['dp_replicate', 'dp_shard'] for HSDP)"
        )
    pmesh = param.device_mesh
    root = mesh._get_root_mesh()
    if pmesh == mesh or pmesh._get_root_mesh() != root or mesh.ndim != 1 or pmesh.ndim != 1 \
            or root.ndim != 2:
        if pmesh == mesh or (pmesh._get_root_mesh() == root and mesh.ndim != 1):
            what = "has no data-parallel axis apart from the parameters' own"
        else:
            what = "is not the other axis of the 2-D mesh the parameter lives on"
        raise FSDPError(
            f"fully_shard: parameter {path!r} is already a DTensor on {pmesh!r} "
            f"{param.placements}, and the mesh given, {mesh!r}, {what}. Expected the "
            "data-parallel axis of the parameters' 2-D mesh: parallelize_module(model, "
            "mesh['tp'], plan) then fully_shard(model, mesh=mesh['dp'])"
        )
    placement = param.placements[0]
    if placement.is_partial():
        raise FSDPError(
            f"fully_shard: parameter {path!r} is Partial on {pmesh}; expected Shard or "
            "Replicate (redistribute it first)"
        )
    return (_tp_dp_mesh(root, pmesh, mesh), 1, None), (placement, Shard(0)), param._spec


def _tp_dp_mesh(root: DeviceMesh, tp: DeviceMesh, dp: DeviceMesh) -> DeviceMesh:
    """``root`` with its axes ordered (tp, dp): one object per root and order."""
    names = root.mesh_dim_names
    tp_axis = _axis_in_root(root, tp)
    dp_axis = _axis_in_root(root, dp)
    key = (root, tp_axis, dp_axis)
    if key not in _transposed:
        _transposed[key] = DeviceMesh(
            root.device_type, root.mesh.permute(tp_axis, dp_axis),
            mesh_dim_names=None if names is None else (names[tp_axis], names[dp_axis]),
        )
    return _transposed[key]


def _axis_in_root(root: DeviceMesh, sub: DeviceMesh) -> int:
    axes = sub._root_axes
    if axes is not None and len(axes) == 1 and len(axes[0]) == 1:
        return axes[0][0]
    if sub.mesh_dim_names and root.mesh_dim_names and sub.mesh_dim_names[0] in root.mesh_dim_names:
        return root.mesh_dim_names.index(sub.mesh_dim_names[0])
    raise FSDPError(f"fully_shard: cannot tell which axis of {root} the mesh {sub} is; "
                    "slice it by name (mesh['dp'], mesh['tp'])")
