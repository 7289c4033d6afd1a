"""Hypothesis strategies for meshes: ``MeshLayout`` values (a shape and the
global ranks in row-major order) over all ranks of a world or some of them.

Re-exported by ``dtensor.testing.strategies``; see it for the conventions
(keyword-only, eager validation, shrinking towards the simplest layout).

Example:
    >>> mesh_shapes(world_size=4)          # e.g. (4,), (2, 2), (1, 2, 2)
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

__all__ = [
    "AXIS_NAMES",
    "MeshLayout",
    "NamedSubMesh",
    "check_int",
    "check_order",
    "mesh_layouts",
    "mesh_shapes",
    "named_sub_meshes",
    "sub_meshes",
]


# Validation -----------------------------------------------------------------
def check_int(fn: str, name: str, value: Any, *, min_value: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{fn}: {name}={value!r} must be an int")
    if value < min_value:
        raise InvalidArgument(f"{fn}: {name}={value} must be >= {min_value}")


def check_order(fn: str, lo: str, lo_v: int, hi: str, hi_v: int) -> None:
    if lo_v > hi_v:
        raise InvalidArgument(f"{fn}: {lo}={lo_v} must be <= {hi}={hi_v}")


# Meshes -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MeshLayout:
    """A mesh as a value: its shape and its global ranks in row-major order.

    ``ranks`` may leave ranks of the world out (a sub-mesh). ``build`` makes
    the mesh (cached, so an example that repeats a layout reuses its groups).
    """

    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if math.prod(self.shape) != len(self.ranks):
            raise InvalidArgument(
                f"MeshLayout: shape {self.shape} holds {math.prod(self.shape)} "
                f"ranks, got {len(self.ranks)}: {self.ranks}"
            )

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def grid(self) -> torch.Tensor:
        """The rank tensor (a fresh tensor: the caller may keep or change it)."""
        return _grid(self).clone()

    def coordinate_of(self, rank: int) -> tuple[int, ...] | None:
        """Mesh coordinate of global ``rank``; ``None`` when outside."""
        if rank not in self.ranks:
            return None
        flat = self.ranks.index(rank)
        # Not through dtensor.mesh: a planted bug there must not reach the reference.
        from dtensor._mesh_build import unravel

        return unravel(flat, self.shape)

    def build(self, factory: Callable[[MeshLayout], Any] | None = None) -> Any:
        """The mesh; ``factory(layout)`` builds it (default: a dtensor CPU mesh)."""
        return (factory or _dtensor_mesh)(self)

    def __repr__(self) -> str:
        return _layout_text(self.shape, self.ranks)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis' printer
        p.text(repr(self))


@functools.lru_cache(maxsize=64)
def _layout_text(shape: tuple[int, ...], ranks: tuple[int, ...]) -> str:
    # Kept: messages name the layout on every rank, and at 1,024 ranks the
    # text costs ~0.2 ms each time (the key's hash, ~5 us).
    return f"MeshLayout(shape={shape}, ranks={ranks})"


def _dtensor_mesh(layout: MeshLayout):
    from dtensor import _comm

    # Per world: the same layout names other groups in another (sub-)world;
    # and per rank, for simulated worlds (all ranks in one process).
    return _dtensor_mesh_in(layout, f"{_comm.world_tag()}/{_comm.get_rank()}")


@functools.lru_cache(maxsize=4096)  # every rank of a 1,024-rank world, a few layouts
def _dtensor_mesh_in(layout: MeshLayout, world: str):
    from dtensor.mesh import DeviceMesh

    return DeviceMesh("cpu", layout.grid())


@functools.lru_cache(maxsize=256)
def _factorizations(n: int, ndim: int) -> tuple[tuple[int, ...], ...]:
    """Ordered ways to write ``n`` as a product of ``ndim`` positive ints."""
    if ndim == 1:
        return ((n,),)
    out = []
    for d in range(1, n + 1):
        if n % d == 0:
            out.extend((d, *rest) for rest in _factorizations(n // d, ndim - 1))
    return tuple(out)


@functools.lru_cache(maxsize=256)  # see strategies._placements
def mesh_shapes(
    *,
    world_size: int,
    min_ndim: int = 1,
    max_ndim: int = 3,
    min_ranks: int | None = None,
) -> st.SearchStrategy[tuple[int, ...]]:
    """Mesh shapes of ``min_ndim..max_ndim`` axes over ``min_ranks..world_size`` ranks.

    Args:
        world_size: ranks available (>= 1).
        min_ndim, max_ndim: number of mesh axes (1 <= min_ndim <= max_ndim).
        min_ranks: fewest ranks the mesh may hold; defaults to ``world_size``
            (the mesh uses every rank). Smaller values allow sub-meshes.

    Size-1 axes are included (they are legal and a classic edge case). Shrinks
    towards fewer axes, then towards the largest first axis.

    Example:
        >>> mesh_shapes(world_size=4, max_ndim=2)   # (4,), (1, 4), (2, 2), (4, 1)
    """
    fn = "mesh_shapes"
    check_int(fn, "world_size", world_size, min_value=1)
    check_int(fn, "min_ndim", min_ndim, min_value=1)
    check_int(fn, "max_ndim", max_ndim, min_value=1)
    check_order(fn, "min_ndim", min_ndim, "max_ndim", max_ndim)
    if min_ranks is None:
        min_ranks = world_size
    check_int(fn, "min_ranks", min_ranks, min_value=1)
    check_order(fn, "min_ranks", min_ranks, "world_size", world_size)
    shapes = [
        shape
        for ndim in range(min_ndim, max_ndim + 1)
        for k in range(world_size, min_ranks - 1, -1)
        for shape in _factorizations(k, ndim)
    ]
    return st.sampled_from(shapes)


@functools.lru_cache(maxsize=256)  # see strategies._placements
def sub_meshes(
    *,
    world_size: int,
    min_ndim: int = 1,
    max_ndim: int = 3,
    min_outsiders: int = 1,
) -> st.SearchStrategy[MeshLayout]:
    """Meshes over some of the world's ranks, leaving ``>= min_outsiders`` out.

    The mesh's ranks are a sorted subset of ``range(world_size)``, so which
    ranks sit outside varies (not only the last ones).

    Example:
        >>> sub_meshes(world_size=4)   # e.g. MeshLayout(shape=(1, 2), ranks=(1, 3))
    """
    fn = "sub_meshes"
    check_int(fn, "world_size", world_size, min_value=2)
    check_int(fn, "min_outsiders", min_outsiders, min_value=1)
    check_order(fn, "min_outsiders", min_outsiders, "world_size - 1", world_size - 1)
    shapes = mesh_shapes(
        world_size=world_size - min_outsiders,
        min_ndim=min_ndim,
        max_ndim=max_ndim,
        min_ranks=1,
    )

    def with_ranks(shape: tuple[int, ...]) -> st.SearchStrategy[MeshLayout]:
        k = math.prod(shape)
        if world_size > 64:
            # Hundreds of ranks: k unique draws each would overrun Hypothesis'
            # buffer; a strided run of ranks (every stride-th from start) instead.
            return st.integers(1, (world_size - 1) // max(k - 1, 1)).flatmap(
                lambda stride: st.integers(0, world_size - 1 - stride * (k - 1)).map(
                    lambda start: MeshLayout(shape, tuple(range(start, start + stride * k,
                                                                stride)))))
        if math.comb(world_size, k) > 4096:
            # Large (simulated) worlds: C(64, 32) subsets cannot be listed; draw one.
            return st.lists(st.integers(0, world_size - 1), min_size=k, max_size=k,
                            unique=True).map(lambda ranks: MeshLayout(shape, tuple(sorted(ranks))))
        subsets = list(itertools.combinations(range(world_size), k))
        return st.sampled_from(subsets).map(lambda ranks: MeshLayout(shape, ranks))

    return shapes.flatmap(with_ranks)


@functools.lru_cache(maxsize=256)  # see strategies._placements
def mesh_layouts(
    *,
    world_size: int,
    min_ndim: int = 1,
    max_ndim: int = 3,
    allow_sub_meshes: bool = False,
) -> st.SearchStrategy[MeshLayout]:
    """Mesh layouts over all ``world_size`` ranks (ranks in order), or with
    ``allow_sub_meshes=True`` also over some of them."""
    full = mesh_shapes(world_size=world_size, min_ndim=min_ndim, max_ndim=max_ndim).map(
        lambda shape: MeshLayout(shape, tuple(range(world_size)))
    )
    if not allow_sub_meshes or world_size == 1:
        return full
    return full | sub_meshes(world_size=world_size, min_ndim=min_ndim, max_ndim=max_ndim)


# Named meshes and their sub-meshes ----------------------------------------------
#: Axis names drawn for named meshes, in the parent's order.
AXIS_NAMES = ("dp", "tp", "cp", "pp")


@dataclass(frozen=True, slots=True)
class NamedSubMesh:
    """A named mesh over the whole world and the axes of a sub-mesh of it.

    ``picked`` lists the sub-mesh's axes in the order asked (``mesh[picked]``),
    often not the parent's order. ``sub_grid(rank)`` is the reference rank
    tensor of the sub-mesh holding ``rank``, built element by element from the
    parent's grid (not by the runtime's slicing and permuting).
    """

    layout: MeshLayout
    names: tuple[str, ...]
    picked: tuple[str, ...]

    def sub_grid(self, rank: int) -> torch.Tensor:
        coord = self.layout.coordinate_of(rank)
        axes = [self.names.index(n) for n in self.picked]
        # One build per sub-mesh, not per rank: ranks that differ only along
        # the picked axes share it (1,024 ranks built it element by element).
        key = tuple(0 if a in axes else c for a, c in enumerate(coord))
        return _sub_grid(self, key).clone()

    def _build_sub_grid(self, coord: tuple[int, ...]) -> torch.Tensor:
        grid = self.layout.grid()
        axes = [self.names.index(n) for n in self.picked]
        sizes = [self.layout.shape[a] for a in axes]
        out = torch.empty(sizes, dtype=torch.int64)
        for idx in itertools.product(*(range(n) for n in sizes)):
            full = list(coord)
            for a, i in zip(axes, idx, strict=True):
                full[a] = i
            out[idx] = grid[tuple(full)]
        return out

    def __repr__(self) -> str:
        return (f"NamedSubMesh({self.layout}, names={self.names}, "
                f"sub-mesh={list(self.picked)})")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis' printer
        p.text(repr(self))


@functools.lru_cache(maxsize=1024)
def _sub_grid(case: NamedSubMesh, coord: tuple[int, ...]) -> torch.Tensor:
    return case._build_sub_grid(coord)


@functools.lru_cache(maxsize=256)  # see strategies._placements
def named_sub_meshes(
    *,
    world_size: int,
    min_ndim: int = 2,
    max_ndim: int = 3,
) -> st.SearchStrategy[NamedSubMesh]:
    """A named mesh over all ``world_size`` ranks and a sub-mesh of some of its
    axes, in any order (``mesh["tp", "dp"]`` of a ``("dp", "tp")`` mesh).

    Example:
        >>> named_sub_meshes(world_size=4)   # e.g. (2, 2) dp/tp, sub-mesh ["tp", "dp"]
    """
    fn = "named_sub_meshes"
    check_int(fn, "max_ndim", max_ndim, min_value=1)
    if max_ndim > len(AXIS_NAMES):
        raise InvalidArgument(f"{fn}: max_ndim={max_ndim} must be <= {len(AXIS_NAMES)}")
    shapes = mesh_shapes(world_size=world_size, min_ndim=min_ndim, max_ndim=max_ndim)

    def with_names(shape: tuple[int, ...]) -> st.SearchStrategy[NamedSubMesh]:
        names = AXIS_NAMES[: len(shape)]
        layout = MeshLayout(shape, tuple(range(world_size)))
        return st.permutations(names).flatmap(
            lambda perm: st.integers(1, len(perm)).map(
                lambda k: NamedSubMesh(layout, names, tuple(perm[:k]))))

    return shapes.flatmap(with_names)


@functools.lru_cache(maxsize=64)
def _grid(layout: MeshLayout) -> torch.Tensor:
    # Each rank of a simulated world builds its mesh from the layout:
    # torch.tensor of 1,024 ranks costs ~150 us, a clone of the kept one ~4 us.
    return torch.tensor(layout.ranks, dtype=torch.int64).reshape(layout.shape)
