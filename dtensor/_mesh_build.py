"""Building meshes: ``init_device_mesh``, ``DeviceMesh.from_group``, flattening.

``dtensor.mesh`` holds the mesh itself (geometry, groups, identity); this
module holds the ways of making one from something else: a shape over the
world, existing process groups, axes of another mesh merged into one, a
pickle or a name in compiled code, and the checks of a mesh's arguments.
It sits below ``dtensor.mesh`` (which calls in here), so it never imports
it: builders take the mesh class (``cls``) or use ``type(mesh)``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from dtensor import _comm
from dtensor._mesh_layout import (
    Layout,
    _layout_of,
    _row_major,
    real_tensors,
    shared_layout,
    unravel,
)
from dtensor.errors import MeshAxisError, MeshError

# A dtensor.mesh.DeviceMesh: this module sits below dtensor.mesh and never
# imports it, not even for type checking (the class is handed in where needed).
_Mesh = Any

__all__ = [
    "check_device_type",
    "flatten",
    "from_group",
    "init_device_mesh",
    "mesh_from_fx",
    "select",
    "unpickle_mesh",
    "unravel",
    "validate",
]


# init_device_mesh ---------------------------------------------------------------
def _ensure_world(device_type: str) -> None:
    import torch.distributed as dist

    if _comm.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return  # single process: meshes of rank 0 work without a world
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)


def init_device_mesh(
    cls,
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
) -> _Mesh:
    """See ``dtensor.mesh.init_device_mesh``."""
    if isinstance(mesh_shape, int):
        mesh_shape = (mesh_shape,)
    mesh_shape = tuple(mesh_shape)
    if not mesh_shape or any(
        isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in mesh_shape
    ):
        raise MeshError(
            f"init_device_mesh: mesh_shape must be positive ints, got {mesh_shape}"
        )
    # Before the world: a CUDA mesh on a machine without CUDA fails here, on
    # every rank, rather than inside torch.cuda.
    check_device_type(device_type, "init_device_mesh")
    _ensure_world(device_type)
    world = _comm.get_world_size()
    size = math.prod(mesh_shape)
    if size > world:
        raise MeshError(
            f"init_device_mesh: mesh_shape {mesh_shape} holds {size} ranks but the "
            f"world has only {world}; use a mesh_shape of at most {world} ranks"
        )
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return cls(device_type, _row_major(mesh_shape), mesh_dim_names=mesh_dim_names)


# from_group ------------------------------------------------------------------------
def _group_ranks(group, what: str) -> list[int]:
    import torch.distributed as dist

    if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
        raise MeshError(
            f"{what}: this rank ({_comm.get_rank()}) is not in the group; pass "
            "mesh=<ranks> to build the mesh on ranks outside it"
        )
    return [int(r) for r in dist.get_process_group_ranks(group)]


def from_group(
    cls,
    group,
    device_type: str,
    mesh: Sequence | torch.Tensor | None = None,
    *,
    mesh_dim_names: Sequence[str] | None = None,
) -> _Mesh:
    """See ``DeviceMesh.from_group``."""
    what = "DeviceMesh.from_group"
    groups = list(group) if isinstance(group, (list, tuple)) else [group]
    if mesh is None:
        if len(groups) != 1:
            raise MeshError(
                f"{what}: {len(groups)} groups need mesh=<ranks> giving their layout"
            )
        mesh = _group_ranks(groups[0], what)
    # Geometry first (no groups): the caller's groups will serve the mesh.
    out = cls(device_type, mesh, mesh_dim_names=mesh_dim_names, _init_backend=False)
    if len(groups) != out.ndim:
        raise MeshError(
            f"{what}: got {len(groups)} groups for a {out.ndim}-D mesh {out!r}; "
            "pass one group per mesh axis"
        )
    if out.get_coordinate() is None:
        return cls(device_type, mesh, mesh_dim_names=mesh_dim_names)  # outsiders: no groups
    for axis, g in enumerate(groups):
        want = list(out._axis_ranks(axis))
        got = _group_ranks(g, what)
        if got != want:
            raise MeshError(
                f"{what}: group {axis} has ranks {got}, but this rank's line along "
                f"axis {axis} of {out!r} is {want}"
            )
    groups = tuple(g if out.shape[a] > 1 else None for a, g in enumerate(groups))
    return cls(device_type, mesh, mesh_dim_names=mesh_dim_names, _groups=groups)


# Selecting and flattening axes ---------------------------------------------------
def _root_axes(mesh: _Mesh) -> tuple[tuple[int, ...], ...]:
    return mesh._root_axes or tuple((a,) for a in range(mesh.ndim))


def _resolve(mesh: _Mesh, name) -> tuple[int, ...]:
    """The axes of ``mesh`` that ``name`` (an axis or a flattened name) covers."""
    if not isinstance(name, str) or (mesh.mesh_dim_names and name in mesh.mesh_dim_names):
        return (mesh._axis(name),)
    root = mesh._get_root_mesh()
    want = root._flattened.get(name)
    if want is not None:
        # The axes of this mesh whose root axes, in order, are the merged ones.
        starts = {r[0]: a for a, r in enumerate(_root_axes(mesh))}
        have, axes, i = _root_axes(mesh), [], 0
        while i < len(want) and want[i] in starts:
            a = starts[want[i]]
            if want[i : i + len(have[a])] != have[a]:
                break
            axes.append(a)
            i += len(have[a])
        if i == len(want):
            return tuple(axes)
    known = tuple(mesh.mesh_dim_names or ()) + tuple(root._flattened)
    raise MeshAxisError(f"mesh has no axis named {name!r}; its axes are {known}")


def select(mesh: _Mesh, names) -> _Mesh:
    """``mesh[names]``: the sub-mesh over named axes that holds this rank.

    A flattened name stands for the axes it merged. On a rank outside the
    mesh it is the sub-mesh at coordinate 0 of the other axes.
    """
    if isinstance(names, str):
        names = (names,)
    groups = [_resolve(mesh, n) for n in names]
    axes = [a for g in groups for a in g]
    if len(set(axes)) != len(axes):
        raise MeshError(f"mesh[{tuple(names)}]: each axis at most once, got axes {axes}")
    if axes == list(range(mesh.ndim)) and all(len(g) == 1 for g in groups):
        return mesh
    coord = mesh.get_coordinate() or (0,) * mesh.ndim
    index = tuple(slice(None) if a in axes else coord[a] for a in range(mesh.ndim))
    kept = sorted(axes)
    with real_tensors():
        # Indexing keeps axes in mesh order; put them in the asked order, merged.
        grid = mesh.mesh[index].permute([kept.index(a) for a in axes])
        grid = grid.reshape([math.prod(mesh.shape[a] for a in g) for g in groups])
    out_names = (
        tuple(n if len(g) > 1 else mesh.mesh_dim_names[g[0]] for n, g in zip(names, groups, strict=True))
        if mesh.mesh_dim_names else None
    )
    have = _root_axes(mesh)
    return type(mesh)(
        mesh.device_type,
        grid,
        mesh_dim_names=out_names,
        _init_backend=mesh._init_backend,
        _root=mesh._get_root_mesh(),
        _root_axes=tuple(tuple(r for a in g for r in have[a]) for g in groups),
    )


def flatten(mesh: _Mesh, name: str | None = None) -> _Mesh:
    """See ``DeviceMesh.flatten``."""
    if name is None:
        if not mesh.mesh_dim_names:
            raise MeshError(
                f"flatten: {mesh!r} has no mesh_dim_names; pass a name, e.g. "
                "mesh.flatten('dp')"
            )
        name = "_".join(mesh.mesh_dim_names)
    if not isinstance(name, str) or not name:
        raise MeshError(f"flatten: the name must be a non-empty str, got {name!r}")
    if mesh.ndim == 1 and mesh.mesh_dim_names == (name,):
        return mesh
    root = mesh._get_root_mesh()
    merged = tuple(r for axes in _root_axes(mesh) for r in axes)
    if root.mesh_dim_names and name in root.mesh_dim_names:
        raise MeshError(
            f"flatten: {name!r} already names an axis of {root!r}; pick another name"
        )
    known = root._flattened.get(name)
    if known is not None and known != merged:
        names = root.mesh_dim_names or tuple(range(root.ndim))
        raise MeshError(
            f"flatten: {name!r} already names the flattened axes "
            f"{tuple(names[a] for a in known)} of {root!r}; got axes "
            f"{tuple(names[a] for a in merged)}. Pick another name"
        )
    root._flattened[name] = merged
    with real_tensors():
        grid = mesh.mesh.reshape(-1)
    return type(mesh)(
        mesh.device_type,
        grid,
        mesh_dim_names=(name,),
        _init_backend=mesh._init_backend,
        _root=root,
        _root_axes=(merged,),
    )


# Checking a mesh's arguments --------------------------------------------------------
def validate(device_type, mesh, mesh_dim_names, init_backend: bool):
    """(``Layout``, axis names) of ``DeviceMesh``'s arguments.

    Raises ``MeshError`` for anything malformed; pure and local, so every rank
    given the same arguments raises the same error.
    """
    if init_backend:
        check_device_type(device_type, "DeviceMesh")
    elif not isinstance(device_type, str):
        raise MeshError(
            f"DeviceMesh: device_type must be a str like 'cpu' or 'cuda', "
            f"got {device_type!r}"
        )
    known = _layout_of(mesh)
    if known is not None:  # a layout checked before: skip the O(ranks) checks
        return _check_fit(known, mesh_dim_names, init_backend)
    try:
        with real_tensors():
            grid = torch.as_tensor(mesh, dtype=torch.int64, device="cpu")
            grid = grid.reshape(1) if grid.ndim == 0 else grid
            ranks = tuple(grid.flatten().tolist())
    except (TypeError, ValueError, RuntimeError) as e:
        raise MeshError(
            f"DeviceMesh: mesh must be a (nested) list or tensor of ranks, "
            f"got {mesh!r} ({e})"
        ) from None
    if len(set(ranks)) != len(ranks) or any(r < 0 for r in ranks):
        raise MeshError(
            f"DeviceMesh: each rank may appear once and ranks are >= 0, got {ranks}"
        )
    if grid.numel() == 0:
        raise MeshError(f"DeviceMesh: the mesh is empty: {mesh!r}")
    return _check_fit(shared_layout(ranks, grid), mesh_dim_names, init_backend)


def _check_fit(layout: Layout, mesh_dim_names, init_backend: bool):
    """``(layout, axis names)`` once the layout fits the world and the names fit it."""
    grid, ranks = layout.grid, layout.ranks
    world = _comm.get_world_size()
    if init_backend and _comm.is_initialized() and max(ranks) >= world:
        raise MeshError(
            f"DeviceMesh: ranks {ranks} exceed the world of {world} ranks "
            f"(valid ranks are 0..{world - 1})"
        )
    if mesh_dim_names is not None:
        mesh_dim_names = tuple(mesh_dim_names)
        if len(mesh_dim_names) != grid.ndim or len(set(mesh_dim_names)) != len(
            mesh_dim_names
        ):
            raise MeshError(
                f"DeviceMesh: expected {grid.ndim} unique mesh_dim_names, "
                f"got {mesh_dim_names}"
            )
    return layout, mesh_dim_names


# Checking a device type ------------------------------------------------------------
def check_device_type(device_type, what: str) -> None:
    """Raise ``MeshError`` unless this machine has devices of ``device_type``.

    A pure local check, so on a homogeneous cluster every rank raises it.
    """
    if not isinstance(device_type, str) or not device_type.isalpha():
        raise MeshError(
            f"{what}: device_type must be a str like 'cpu' or 'cuda' "
            f"(a type, no index), got {device_type!r}"
        )
    if device_type in ("cpu", "meta"):
        return
    module = getattr(torch, device_type, None)
    available = getattr(module, "is_available", None)
    if available is None:
        raise MeshError(f"{what}: unknown device_type {device_type!r}; use 'cpu' or 'cuda'")
    if not available():
        raise MeshError(
            f"{what}: device_type {device_type!r} but this machine has no "
            f"{device_type} device (torch.{device_type}.is_available() is False); "
            "use 'cpu' for a CPU-only machine"
        )


# Rebuilding a mesh from its pickle or from compiled code ----------------------------
fx_meshes: dict[tuple, _Mesh] = {}  # NOTE: process lifetime, see __fx_repr__


def mesh_from_fx(cls, device_type, ranks, shape, mesh_dim_names, rank, world) -> _Mesh:
    """The mesh ``DeviceMesh.__fx_repr__`` wrote, in this process."""
    key = (device_type, ranks, shape, mesh_dim_names, rank, world)
    mesh = fx_meshes.get(key)
    if mesh is not None:
        return mesh
    here = (_comm.get_rank(), _comm.world_tag())
    if (rank, world) != here:
        # NOTE: compile caches key programs on rank and world, so this means a
        # program was carried to another process by hand.
        raise MeshError(
            f"compiled code names mesh {ranks} of rank {rank} in world {world!r}, "
            f"but this process is rank {here[0]} in world {here[1]!r}; recompile "
            "in this world (clear the torch.compile caches)"
        )
    mesh = unpickle_mesh(cls, device_type, ranks, shape, mesh_dim_names)
    return fx_meshes.setdefault(key, mesh)


def unpickle_mesh(cls, device_type, ranks, shape, mesh_dim_names) -> _Mesh:
    with real_tensors():
        grid = torch.tensor(ranks, dtype=torch.int64, device="cpu").reshape(shape)
    return cls(device_type, grid, mesh_dim_names=mesh_dim_names)
