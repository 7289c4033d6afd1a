"""Hypothesis strategies for production-sized meshes drawn from the world size.

At 512 or 1024 ranks the layouts that break are the wide ones: one mesh axis
of hundreds of ranks, 3-D and 4-D meshes such as 8x8x8 or 4x8x4x8, a
sub-mesh of some of their axes in any order, several axes flattened into one
(a data-parallel axis), and tensors whose sides split unevenly over those
axes (most ranks one row, some none). ``big_meshes`` draws such a mesh view
of the whole world and ``uneven_shapes`` a tensor shape for it; both work at
every world size (2 ranks included), so a property that uses them runs on
real worlds and in simulated worlds of 256 to 1024 ranks alike.

Example:
    >>> @given(data=st.data())
    ... def test_blocks(world, impl, data):
    ...     case = data.draw(big_meshes(world_size=world.size))
    ...     mesh = case.build(impl)
    ...     shape = data.draw(uneven_shapes(mesh_shape=case.shape))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from dtensor.testing.meshes import (
    AXIS_NAMES,
    MeshLayout,
    NamedSubMesh,
    _factorizations,
    check_int,
    check_order,
)

__all__ = ["BigMesh", "big_mesh_shapes", "big_meshes", "uneven_shapes"]

#: What ``BigMesh.build`` makes of the named parent mesh.
VIEWS = ("whole", "sub-mesh", "flattened")


def big_mesh_shapes(*, world_size: int, min_ndim: int = 1,
                    max_ndim: int = 4) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes of ``min_ndim..max_ndim`` axes over all ``world_size`` ranks,
    every axis of size >= 2 (where the world allows it).

    Shrinks towards one axis over the whole world, the widest axis there is;
    then towards few axes with the widest first. Size-1 axes are left to
    ``mesh_shapes``: at hundreds of ranks they only dilute the draws.

    Example:
        >>> big_mesh_shapes(world_size=512)   # (512,), (2, 256), (8, 8, 8), ...
    """
    fn = "big_mesh_shapes"
    check_int(fn, "world_size", world_size, min_value=1)
    check_int(fn, "min_ndim", min_ndim, min_value=1)
    check_int(fn, "max_ndim", max_ndim, min_value=1)
    check_order(fn, "min_ndim", min_ndim, "max_ndim", max_ndim)
    if max_ndim > len(AXIS_NAMES):
        raise InvalidArgument(f"{fn}: max_ndim={max_ndim} must be <= {len(AXIS_NAMES)} "
                              f"(one name each from {AXIS_NAMES})")
    shapes = [s for ndim in range(min_ndim, max_ndim + 1)
              for s in sorted(_factorizations(world_size, ndim), key=lambda s: -s[0])
              if min(s) >= 2]
    if not shapes:  # a prime world, or 1 rank: the one-axis mesh
        shapes = [(world_size,) + (1,) * (min_ndim - 1)]
    return st.sampled_from(shapes)


@dataclass(frozen=True, slots=True)
class BigMesh:
    """A named mesh over the whole world and the view of it a test uses.

    ``view`` is ``"whole"`` (the named mesh itself), ``"sub-mesh"``
    (``mesh[picked]``, axes in the order picked) or ``"flattened"``
    (``mesh[picked]._flatten(name)``, one axis). ``shape`` is the view's shape;
    ``ranks(rank)`` the reference rank grid of the view holding ``rank``,
    built element by element from the parent's grid.
    """

    sub: NamedSubMesh
    view: str

    @property
    def shape(self) -> tuple[int, ...]:
        layout = self.sub.layout
        if self.view == "whole":
            return layout.shape
        sizes = tuple(layout.shape[self.sub.names.index(n)] for n in self.sub.picked)
        return (math.prod(sizes),) if self.view == "flattened" else sizes

    @property
    def flat_name(self) -> str:
        return "_".join(self.sub.picked) + "_flat"

    def ranks(self, rank: int) -> torch.Tensor:
        """The view's rank grid as the rank ``rank`` sees it."""
        if self.view == "whole":
            return self.sub.layout.grid()
        grid = self.sub.sub_grid(rank)
        return grid.flatten() if self.view == "flattened" else grid

    def build(self, impl: Any) -> Any:
        """The view, built through ``impl`` (a ``dtensor.testing.Impl``)."""
        parent = impl.named_mesh(self.sub.layout, self.sub.names)
        if self.view == "whole":
            return parent
        mesh = parent[self.sub.picked]
        return mesh._flatten(self.flat_name) if self.view == "flattened" else mesh

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.sub.layout.shape))
        names = ",".join(self.sub.names)
        if self.view == "whole":
            return f"BigMesh({shape} ({names}))"
        picked = ",".join(self.sub.picked)
        return f"BigMesh({shape} ({names}), {self.view} [{picked}])"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis' printer
        p.text(repr(self))


def big_meshes(*, world_size: int, max_ndim: int = 4,
               views: tuple[str, ...] = VIEWS) -> st.SearchStrategy[BigMesh]:
    """A named mesh over all ``world_size`` ranks (``big_mesh_shapes``) and one
    of ``views`` of it: the whole mesh, a sub-mesh of some axes in any order,
    or some axes flattened into one.

    Pass ``views=("whole", "sub-mesh")`` for an implementation whose
    flattening is not public API. Shrinks towards the whole 1-D mesh.

    Example:
        >>> big_meshes(world_size=1024)   # e.g. 8x8x16 (dp,tp,cp), flattened [cp,dp]
    """
    fn = "big_meshes"
    bad = [v for v in views if v not in VIEWS]
    if not views or bad:
        raise InvalidArgument(f"{fn}: views={views!r} must be a non-empty tuple of {VIEWS}")

    def with_view(shape: tuple[int, ...]) -> st.SearchStrategy[BigMesh]:
        names = AXIS_NAMES[: len(shape)]
        layout = MeshLayout(shape, tuple(range(world_size)))
        whole = BigMesh(NamedSubMesh(layout, names, names), "whole")
        split = [v for v in views if v != "whole"]
        if not split or (len(shape) == 1 and "whole" in views):
            return st.just(whole)
        picks = st.permutations(names).flatmap(
            lambda perm: st.integers(1, len(perm)).map(lambda k: tuple(perm[:k])))
        views_of = st.builds(lambda picked, v: BigMesh(NamedSubMesh(layout, names, picked), v),
                             picks, st.sampled_from(split))
        return (st.just(whole) | views_of) if "whole" in views else views_of

    return big_mesh_shapes(world_size=world_size, max_ndim=max_ndim).flatmap(with_view)


def uneven_shapes(*, mesh_shape: tuple[int, ...],
                  max_dims: int = 2) -> st.SearchStrategy[tuple[int, ...]]:
    """Tensor shapes of 1..``max_dims`` dims with one side that splits
    unevenly over the axes of a mesh of ``mesh_shape``: ``q * n + r`` for an
    axis size (or a product of two axis sizes, a nested split) ``n``, with
    ``q`` in 0..2 and ``0 < r < n``, so some ranks get ``q + 1`` rows, some
    ``q`` and, for ``q == 0``, most get none; a side of ``n`` itself (even) is
    drawn too, as the contrast. The other sides are 1..4 (the tensor stays
    small: a simulated world copies it to each of its ranks).

    Example:
        >>> uneven_shapes(mesh_shape=(8, 128))   # e.g. (131, 3), (9,), (2, 1027)
    """
    fn = "uneven_shapes"
    if not mesh_shape or any(not isinstance(n, int) or n < 1 for n in mesh_shape):
        raise InvalidArgument(f"{fn}: mesh_shape={mesh_shape!r} must be a non-empty "
                              "tuple of positive ints")
    check_int(fn, "max_dims", max_dims, min_value=1)
    splits = sorted({*mesh_shape, *(a * b for i, a in enumerate(mesh_shape)
                                     for b in mesh_shape[i + 1:])}, reverse=True)

    def side(n: int) -> st.SearchStrategy[int]:
        if n == 1:
            return st.integers(0, 3)
        uneven = st.builds(lambda q, r: q * n + r, st.integers(0, 2), st.integers(1, n - 1))
        return uneven | st.just(n)

    def place(big: int, small: list[int], at: int) -> tuple[int, ...]:
        return (*small[:at], big, *small[at:])

    def shape(big: int) -> st.SearchStrategy[tuple[int, ...]]:
        small = st.lists(st.integers(1, 4), max_size=max_dims - 1)
        return small.flatmap(lambda rest: st.integers(0, len(rest)).map(
            lambda at: place(big, rest, at)))

    return st.sampled_from(splits).flatmap(side).flatmap(shape)
