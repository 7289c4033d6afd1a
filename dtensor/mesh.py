"""DeviceMesh: an n-D grid of global ranks, its coordinates, and sub-meshes.

A mesh may cover the whole world or only some of its ranks. Process groups
for the mesh axes are created when the mesh is built, by the mesh's own ranks
only (see ``dtensor._comm``): ranks outside the mesh may build it too, or not
at all, and nothing hangs. Build meshes in the same order on the ranks that
share them, as you would any SPMD code; the constructor creates each rank's
axis groups in axis order, which keeps overlapping groups deadlock-free.

Example:
    >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    >>> mesh["tp"].size(), mesh.get_coordinate()   # on rank 3
    (2, (1, 1))
    >>> with mesh:                                 # the current mesh
    ...     x = distribute_tensor(torch.ones(4, 4), placements=[Shard(0), Replicate()])
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Sequence

import torch

from dtensor import _comm, _mesh_build
from dtensor._mesh_build import unravel
from dtensor.errors import MeshAxisError, MeshError

__all__ = ["DeviceMesh", "current_mesh", "device_of", "init_device_mesh", "mesh_max", "resolve_mesh",
           "unravel"]

_stack = threading.local()


def _mesh_stack() -> list[DeviceMesh]:
    s = getattr(_stack, "meshes", None)
    if s is None:
        s = _stack.meshes = []
    return s


def current_mesh() -> DeviceMesh | None:
    """The innermost mesh entered with ``with mesh:``, or ``None``."""
    return s[-1] if (s := _mesh_stack()) else None


def resolve_mesh(mesh: DeviceMesh | None, what: str) -> DeviceMesh:
    """``mesh``, else the current mesh; ``MeshError`` naming ``what`` if neither."""
    if mesh is None and torch.compiler.is_compiling():  # NOTE: compiled code won't guard it
        raise MeshError(f"{what}: under torch.compile pass device_mesh=... explicitly "
                        "(the current mesh of `with mesh:` is not tracked by compiled code)")
    if mesh is None and (mesh := current_mesh()) is None:
        raise MeshError(f"{what}: no device_mesh given and no current mesh; pass "
                        "device_mesh=... or use `with mesh:`")
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"{what}: expected a dtensor.DeviceMesh, got {type(mesh).__name__}")
    return mesh


class DeviceMesh:
    """An n-D grid of global ranks on one device type.

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (any torch device type).
        mesh: nested lists or an integer tensor of global ranks; every rank at
            most once. It may leave some of the world's ranks out.
        mesh_dim_names: optional unique names of the axes, for ``mesh["tp"]``.

    Example:
        >>> DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))
    """

    __slots__ = (
        "__weakref__",  # torch.compile keys tables of graph inputs by weakref
        "_coordinate",
        "_flattened",
        "_groups",
        "_hash",
        "_init_backend",
        "_layout",
        "_rank",
        "_ranks",
        "_root",
        "_root_axes",
        "_shape",
        "_world",
        "device_type",
        "mesh",
        "mesh_dim_names",
        "ndim",
        "ranks",
        "shape",
    )

    def __init__(
        self,
        device_type: str,
        mesh: Sequence | torch.Tensor,
        *,
        mesh_dim_names: Sequence[str] | None = None,
        _init_backend: bool = True,
        _groups: tuple | None = None,
        _root: DeviceMesh | None = None,
        _root_axes: tuple[tuple[int, ...], ...] | None = None,
    ) -> None:
        layout, mesh_dim_names = _mesh_build.validate(
            device_type, mesh, mesh_dim_names, _init_backend
        )
        grid, ranks = layout.grid, layout.ranks
        # A rank thread of torch's thread-per-rank test bases: its own state.
        from dtensor import _rank_state

        _rank_state.auto_enter()
        self.device_type = device_type
        self.mesh = grid
        self.mesh_dim_names = mesh_dim_names
        self._shape = tuple(grid.shape)
        self._ranks = ranks
        # Plain attributes rather than properties: compiled code reads meshes as
        # torch.compile constants, whose properties Dynamo 2.13 cannot read.
        self.shape: tuple[int, ...] = self._shape
        self.ndim: int = len(self._shape)
        self.ranks: tuple[int, ...] = ranks  # global ranks, row-major
        self._rank = _comm.get_rank()
        # The world is part of a mesh's identity: equal ranks in another world
        # (a re-initialised or swapped-in world) are other processes' groups.
        self._world = _comm.world_tag()
        # The rank too: several ranks may share a process (a simulated world,
        # launch/sim/), and a mesh carries its rank's coordinate and groups,
        # so caches keyed by meshes (specs, plans) must not hand one rank's
        # mesh to another. Constant per process otherwise.
        self._hash = hash((device_type, layout.hash, mesh_dim_names, self._world, self._rank))
        self._layout = layout  # shared by the ranks of a simulated world, as are its lines
        self._coordinate = layout.coordinate(self._rank)
        self._groups: tuple | None = _groups if self._coordinate is not None else None
        self._init_backend = _init_backend
        # Sub-meshes and flattened meshes remember the mesh they came from
        # and which of its axes each of their axes covers, so names flattened
        # on any of them resolve on the root (``root["dp_cp"]``), as in torch.
        self._root = _root
        self._root_axes = _root_axes
        self._flattened: dict[str, tuple[int, ...]] = {}
        if (
            _init_backend
            and self._groups is None
            and self._coordinate is not None
            and _comm.is_initialized()
        ):
            # Created eagerly, axis by axis, so every member creates its groups
            # in the same global order (lazy creation could interleave
            # differently per rank and deadlock).
            self._groups = self._make_groups()

    # Geometry ---------------------------------------------------------------
    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of ranks in the mesh, or along one axis."""
        if mesh_dim is None:
            return math.prod(self._shape)
        return self._shape[self._axis(mesh_dim)]

    def get_rank(self) -> int:
        """This process's global rank."""
        return self._rank

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's coordinate in the mesh, or ``None`` when it is outside."""
        return self._coordinate

    def is_member(self) -> bool:
        return self._coordinate is not None

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index along ``mesh_dim`` (required for n-D meshes)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise MeshError(f"get_local_rank: mesh has {self.ndim} axes; pass mesh_dim")
            mesh_dim = 0
        axis = self._axis(mesh_dim)
        if self._coordinate is None:
            raise MeshError(f"get_local_rank: rank {self._rank} is not in {self!r}; "
                            "check mesh.get_coordinate() is not None first")
        return self._coordinate[axis]

    def get_group(self, mesh_dim: int | str | None = None):
        """The process group of this rank's line along ``mesh_dim``.

        ``None`` on ranks outside the mesh. A size-1 axis has a one-rank group.
        """
        if mesh_dim is None:
            if self.ndim != 1:
                raise MeshError(f"get_group: mesh has {self.ndim} axes; pass mesh_dim")
            mesh_dim = 0
        axis = self._axis(mesh_dim)
        if self._coordinate is None:
            return None
        group = self.axis_group(axis)
        if group is None:
            group = _comm.group_for(self._axis_ranks(axis))
        return group

    def axis_group(self, axis: int):
        """Group of this rank's line along ``axis``; ``None`` for size-1 axes."""
        if self._groups is None:
            if self._coordinate is None:
                return None
            self._groups = self._make_groups()
        return self._groups[axis]

    def _make_groups(self) -> tuple:
        return tuple(
            _comm.group_for(self._axis_ranks(a)) if self._shape[a] > 1 else None
            for a in range(self.ndim)
        )

    def _axis_ranks(self, axis: int) -> tuple[int, ...]:
        return self._layout.line(self._coordinate, axis)

    def _axis(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
                raise MeshAxisError(f"mesh has no axis named {mesh_dim!r}; "
                                    f"its axes are {self.mesh_dim_names}")
            return self.mesh_dim_names.index(mesh_dim)
        if isinstance(mesh_dim, bool) or not isinstance(mesh_dim, int):
            raise MeshError(f"mesh axis must be an int or a name, got {mesh_dim!r}")
        if not -self.ndim <= mesh_dim < self.ndim:
            raise MeshAxisError(f"mesh axis {mesh_dim} out of range for a "
                                f"{self.ndim}-D mesh")
        return mesh_dim % self.ndim

    # Sub-meshes -------------------------------------------------------------
    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        """The sub-mesh over the named axes that contains this rank.

        Names may be flattened ones (``mesh["dp_cp"]`` after
        ``mesh["dp", "cp"].flatten("dp_cp")``). On a rank outside the mesh it
        is the sub-mesh at coordinate 0 of the other axes (which the rank is
        not in either).
        """
        return _mesh_build.select(self, names)

    def flatten(self, name: str | None = None) -> DeviceMesh:
        """This mesh as one axis ``name`` (default: its names joined by ``_``), row-major.

        The root mesh learns the name: ``root[name]`` is the same mesh. Example
        (rank 0 of a 2x2x2 dp/cp/tp mesh): ``mesh["dp", "cp"].flatten().ranks``
        is ``(0, 2, 4, 6)``. PyTorch spells it ``_flatten``.
        """
        return _mesh_build.flatten(self, name)

    _flatten = flatten  # PyTorch's spelling (torchtitan, FSDP use it)

    def _get_root_mesh(self) -> DeviceMesh:
        """The mesh this one was sliced or flattened from (itself for a root)."""
        return self._root if self._root is not None else self

    @classmethod
    def from_group(cls, group, device_type: str, mesh=None, *, mesh_dim_names=None) -> DeviceMesh:
        """A mesh whose axes use existing process groups (``group``).

        ``group`` is one group (a 1-D mesh over its ranks) or one per mesh
        axis (this rank's line along it); ``mesh`` gives the ranks' layout
        (needed for several groups, and on ranks outside ``group``). Example:
        ``DeviceMesh.from_group(dist.group.WORLD, "cpu")``.
        """
        return _mesh_build.from_group(cls, group, device_type, mesh, mesh_dim_names=mesh_dim_names)

    def get_all_groups(self) -> list:
        """This rank's process group of every axis (``None`` each, outside the mesh)."""
        return [self.get_group(axis) for axis in range(self.ndim)]

    # The current mesh -------------------------------------------------------
    def __enter__(self) -> DeviceMesh:
        _mesh_stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _mesh_stack().pop()

    # Identity ----------------------------------------------------------------
    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.device_type == other.device_type
            and self._shape == other._shape
            and self._ranks == other._ranks
            and self.mesh_dim_names == other.mesh_dim_names
            and self._world == other._world
            and self._rank == other._rank
        )

    def __setattr__(self, name: str, value) -> None:
        # Specs hold meshes and are aliased freely, so a mesh's public
        # geometry must never change once built (private caches may fill in).
        if not name.startswith("_") and hasattr(self, "_hash"):
            raise dataclasses.FrozenInstanceError(
                f"DeviceMesh is immutable: cannot assign {name!r}; build a new mesh"
            )
        object.__setattr__(self, name, value)

    # A mesh owns process groups, which cannot be copied; copies are the mesh
    # itself (torch.compile deep-copies a DTensor's spec to guard on it).
    def __copy__(self) -> DeviceMesh:
        return self

    def __deepcopy__(self, memo) -> DeviceMesh:
        return self

    def __reduce__(self):
        # Pickles as its ranks; loading rebuilds it (and its process groups)
        # in the loading process, which must be in the same world.
        return _unpickle_mesh, (
            self.device_type, self._ranks, self._shape, self.mesh_dim_names,
        )

    # Naming a mesh in generated code ----------------------------------------
    def _cache_key(self) -> tuple:
        """What compiled code depends on: geometry, this rank (its coordinate)
        and the world (its group names); compile caches key programs on it."""
        return (
            self.device_type, self._ranks, self._shape, self.mesh_dim_names,
            self._rank, self._world,
        )

    def __fx_repr__(self) -> tuple[str, dict]:
        """This mesh in code torch.compile generates: a lookup, not a build (which
        would create groups while tracing); registered for the process's life."""
        key = self._cache_key()
        _mesh_build.fx_meshes.setdefault(key, self)
        return f"dtensor_mesh{key!r}", {"dtensor_mesh": _mesh_from_fx}

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        with _mesh_build.real_tensors():
            ranks = self.mesh.tolist()
        return f"DeviceMesh({self.device_type!r}, {ranks}{names})"

    def __str__(self) -> str:
        names = self.mesh_dim_names or tuple(f"a{i}" for i in range(self.ndim))
        dims = ",".join(f"{n}={s}" for n, s in zip(names, self._shape, strict=True))
        return f"{self.device_type}<{dims}>"


def device_of(mesh: DeviceMesh) -> torch.device:
    """The device this rank's blocks live on for ``mesh``."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def mesh_max(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Max of ``t`` over every rank of ``mesh`` (members only): agreeing on a verdict."""
    for axis in range(mesh.ndim):
        group = mesh.axis_group(axis)
        if group is not None:
            t = _comm.all_reduce(t.to(device_of(mesh)), "max", group).cpu()
    return t


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
) -> DeviceMesh:
    """A mesh of shape ``mesh_shape`` over the world's first ranks, row-major.

    As in PyTorch: ranks ``0 .. prod(mesh_shape) - 1``, the whole world or
    its first ranks (the others are outsiders); larger than the world is a
    ``MeshError``. Starts the default process group from torchrun's
    environment if needed (Gloo for ``cpu``, NCCL for ``cuda``). Example:
    ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``.
    """
    return _mesh_build.init_device_mesh(
        DeviceMesh, device_type, mesh_shape, mesh_dim_names=mesh_dim_names
    )


def _unpickle_mesh(device_type, ranks, shape, mesh_dim_names) -> DeviceMesh:
    return _mesh_build.unpickle_mesh(DeviceMesh, device_type, ranks, shape, mesh_dim_names)


def _mesh_from_fx(*key) -> DeviceMesh:
    """The mesh ``DeviceMesh.__fx_repr__`` wrote, in this process."""
    return _mesh_build.mesh_from_fx(DeviceMesh, *key)
