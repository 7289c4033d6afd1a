"""Hypothesis strategies for distributed tensors: meshes, placements, inputs.

Every strategy is keyword-only and validates its arguments eagerly (when the
strategy is built, not when it is drawn), naming the argument and both values,
as ``hypothesis.extra.numpy.array_shapes`` does. Values shrink towards the
simplest layout: 1-D meshes over all ranks, ``Replicate()``, small shapes,
``float32``, ``arange`` contents.

Meshes are described by ``MeshLayout`` values (a shape and the global ranks in
row-major order); ``layout.build()`` turns one into a mesh. Drawing is
deterministic given the seed, so in a world test (the test service's
``launch.hypo.lockstep``, loaded with the service) every rank draws the same
layout and builds the same mesh.

Example:
    >>> from hypothesis import given
    >>> @given(distributed_inputs(world_size=4))
    ... def test_round_trip(inp):
    ...     dt = distribute_tensor(inp.tensor, inp.mesh, inp.placements)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from dtensor.placement import REDUCE_OPS, Partial, Placement, Replicate, Shard
from dtensor.testing.meshes import (
    MeshLayout,
    check_int,
    check_order,
    mesh_layouts,
    mesh_shapes,
    sub_meshes,
)

__all__ = [
    "DTYPES",
    "DistributedInput",
    "MeshLayout",
    "distributed_inputs",
    "dtypes",
    "mesh_layouts",
    "mesh_shapes",
    "placements",
    "sub_meshes",
    "tensor_shapes",
    "tensors",
]

#: The dtypes the property suite covers, simplest first.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.int64,
    torch.bool,
)


# Placements -----------------------------------------------------------------------
def placements(
    *,
    mesh_ndim: int,
    tensor_ndim: int,
    allow_partial: bool = True,
    reduce_ops: Sequence[str] = REDUCE_OPS,
    mixed_reduce_ops: bool = True,
) -> st.SearchStrategy[tuple[Placement, ...]]:
    """One placement per mesh axis, valid for a ``tensor_ndim``-D tensor.

    ``Shard(d)`` only for ``d < tensor_ndim`` (none for 0-d tensors); several
    axes may shard the same dim (nested sharding). With
    ``mixed_reduce_ops=False`` all ``Partial`` axes of one tuple share their
    reduce op (``torch.distributed.tensor`` rejects mixtures). Shrinks towards
    ``Replicate()``, then ``Shard(0)``.

    Example:
        >>> placements(mesh_ndim=2, tensor_ndim=1)   # e.g. (Shard(dim=0), Partial('max'))
    """
    fn = "placements"
    check_int(fn, "mesh_ndim", mesh_ndim, min_value=1)
    check_int(fn, "tensor_ndim", tensor_ndim)
    bad = [op for op in reduce_ops if op not in REDUCE_OPS]
    if bad or isinstance(reduce_ops, str):
        raise InvalidArgument(
            f"{fn}: reduce_ops={reduce_ops!r} must be a sequence of {REDUCE_OPS}"
        )
    if allow_partial and not reduce_ops:
        raise InvalidArgument(f"{fn}: allow_partial=True needs reduce_ops, got ()")
    return _placements(mesh_ndim, tensor_ndim, allow_partial, tuple(reduce_ops),
                       mixed_reduce_ops)


# NOTE: cached because property bodies build these strategies inside the test
# (per drawn shape, with ``st.data()``): a new strategy object is validated
# by Hypothesis on its first draw, which cost more than the draw itself (~10 %
# of the property suite's time). Strategies are immutable; sharing is safe.
@functools.lru_cache(maxsize=1024)
def _placements(mesh_ndim: int, tensor_ndim: int, allow_partial: bool,
                reduce_ops: tuple[str, ...], mixed_reduce_ops: bool):
    base: list[Placement] = [Replicate()]
    base += [Shard(d) for d in range(tensor_ndim)]
    if not allow_partial:
        return st.tuples(*[st.sampled_from(base)] * mesh_ndim)
    if mixed_reduce_ops:
        one = st.sampled_from(base + [Partial(op) for op in reduce_ops])
        return st.tuples(*[one] * mesh_ndim)
    return st.sampled_from(tuple(reduce_ops)).flatmap(
        lambda op: st.tuples(*[st.sampled_from([*base, Partial(op)])] * mesh_ndim))


# Tensors ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)  # see strategies._placements
def tensor_shapes(
    *,
    min_dims: int = 0,
    max_dims: int | None = None,
    min_side: int = 0,
    max_side: int | None = None,
) -> st.SearchStrategy[tuple[int, ...]]:
    """Global tensor shapes: 0-d scalars, size-0 dims and uneven sizes included.

    Defaults (as ``array_shapes``): ``max_dims = max(min_dims, 3)``,
    ``max_side = min_side + 5``. With meshes of 2 to 4 ranks, sides up to 5
    are mostly not divisible by the axis sizes, so shards are uneven and some
    are empty.

    Example:
        >>> tensor_shapes(max_dims=2)   # (), (0,), (5, 3), ...
    """
    fn = "tensor_shapes"
    check_int(fn, "min_dims", min_dims)
    if max_dims is None:
        max_dims = max(min_dims, 3)
    check_int(fn, "max_dims", max_dims)
    check_order(fn, "min_dims", min_dims, "max_dims", max_dims)
    check_int(fn, "min_side", min_side)
    if max_side is None:
        max_side = min_side + 5
    check_int(fn, "max_side", max_side)
    check_order(fn, "min_side", min_side, "max_side", max_side)
    side = st.integers(min_side, max_side)
    return st.lists(side, min_size=min_dims, max_size=max_dims).map(tuple)


def dtypes(*, include: Sequence[torch.dtype] = DTYPES) -> st.SearchStrategy[torch.dtype]:
    """One of ``include`` (default ``DTYPES``); shrinks towards the first."""
    include = tuple(include)
    if not include or not all(isinstance(d, torch.dtype) for d in include):
        raise InvalidArgument(
            f"dtypes: include={include!r} must be a non-empty sequence of torch.dtype"
        )
    return _sampled(include)


@functools.lru_cache(maxsize=1024)
def _sampled(values: tuple) -> st.SearchStrategy:
    return st.sampled_from(values)


#: How tensor contents are made, simplest first. ``arange``: distinct values
#: (a misplaced shard is visible); ``small``: random small ints, exact in every
#: dtype including bfloat16; ``normal``: random floats (ints for int/bool);
#: ``special``: floats mixed with nan, +-inf and -0.0 (order-independent under
#: sums, unlike huge finite values that cancel differently per shard; ints for
#: int/bool).
FILLS = ("arange", "small", "normal", "special")
_SPECIAL = (float("nan"), float("inf"), float("-inf"), -0.0, 0.5, 2.0)


def _fill(shape: tuple[int, ...], dtype: torch.dtype, fill: str, seed: int) -> torch.Tensor:
    # Cached: shrinking redraws the same tensors, and in a simulated world
    # every rank draws the one its rank-0 twin drew. A clone, so a test that
    # writes into its input cannot change another draw's.
    return _filled(tuple(shape), dtype, fill, seed).clone()


@functools.lru_cache(maxsize=512)
def _filled(shape: tuple[int, ...], dtype: torch.dtype, fill: str, seed: int) -> torch.Tensor:
    n = math.prod(shape)
    if fill == "arange":
        flat = torch.arange(n, dtype=torch.int64)
        if dtype == torch.bfloat16:
            flat = flat % 256  # bfloat16 holds integers exactly up to 256
    else:
        g = torch.Generator().manual_seed(seed)
        if fill == "small" or not (dtype.is_floating_point):
            flat = torch.randint(-4, 5, (n,), generator=g)
        elif fill == "special":
            flat = torch.randn(n, generator=g, dtype=torch.float64)
            pick = torch.randint(0, 2 * len(_SPECIAL), (n,), generator=g)
            special = torch.tensor(_SPECIAL, dtype=torch.float64)
            flat = torch.where(pick < len(_SPECIAL), special[pick % len(_SPECIAL)], flat)
        else:
            flat = torch.randn(n, generator=g, dtype=torch.float64)
    if dtype == torch.bool:
        flat = flat.remainder(2) if fill == "arange" else flat > 0
    return flat.to(dtype).reshape(shape)


def tensors(
    *,
    shape: Sequence[int] | st.SearchStrategy[tuple[int, ...]] | None = None,
    dtype: torch.dtype | st.SearchStrategy[torch.dtype] | None = None,
    fills: Sequence[str] = FILLS,
) -> st.SearchStrategy[torch.Tensor]:
    """Plain (global) tensors of ``shape`` and ``dtype`` (values or strategies).

    Contents come from a fill kind (see ``FILLS``) and, for random fills, a
    drawn seed, so examples stay small and shrink to ``arange``.
    """
    shapes = tensor_shapes() if shape is None else shape
    if not isinstance(shapes, st.SearchStrategy):
        if not all(isinstance(s, int) and s >= 0 for s in shapes):
            raise InvalidArgument(f"tensors: shape={shape!r} must be non-negative ints")
        shapes = _just_shape(tuple(shapes))
    dts = dtypes() if dtype is None else dtype
    if not isinstance(dts, st.SearchStrategy):
        if not isinstance(dts, torch.dtype):
            raise InvalidArgument(f"tensors: dtype={dtype!r} must be a torch.dtype or a strategy")
        dts = _dtype_strategy(dts)
    bad = [f for f in fills if f not in FILLS]
    if bad or not fills or isinstance(fills, str):
        raise InvalidArgument(f"tensors: fills={fills!r} must be a non-empty subset of {FILLS}")
    return _tensors(shapes, dts, tuple(fills))


@functools.lru_cache(maxsize=1024)
def _just_shape(shape: tuple[int, ...]) -> st.SearchStrategy[tuple[int, ...]]:
    return st.just(shape)


def _dtype_strategy(dtype: torch.dtype) -> st.SearchStrategy[torch.dtype]:
    return _sampled((dtype,))


@functools.lru_cache(maxsize=4096)
def _tensors(shapes, dts, fills: tuple[str, ...]) -> st.SearchStrategy[torch.Tensor]:
    # Keyed by the strategies' identities: the cached ones above make a
    # drawn shape and dtype hit (see _placements).
    return st.builds(_fill, shapes, dts, st.sampled_from(fills), st.integers(0, 2**16))


# The composite ----------------------------------------------------------------------
@dataclass(frozen=True)
class DistributedInput:
    """A global tensor, a mesh layout and placements, ready to distribute.

    ``mesh`` is built from ``layout`` by the strategy's ``mesh_factory``.
    """

    tensor: torch.Tensor
    layout: MeshLayout
    mesh: Any
    placements: tuple[Placement, ...]

    def __repr__(self) -> str:
        t = self.tensor
        dt = str(t.dtype).removeprefix("torch.")
        ps = ", ".join(map(str, self.placements))
        return (
            f"DistributedInput({dt}{list(t.shape)} {t.flatten().tolist()}, "
            f"mesh={self.layout}, placements=({ps}))"
        )

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis' printer
        p.text(repr(self))


@st.composite
def _distributed_inputs(draw, world_size, min_ndim, max_ndim, allow_sub_meshes,
                        allow_partial, reduce_ops, mixed_reduce_ops, shapes, dts, fills,
                        mesh_factory):
    layout = draw(
        mesh_layouts(
            world_size=world_size,
            min_ndim=min_ndim,
            max_ndim=max_ndim,
            allow_sub_meshes=allow_sub_meshes,
        )
    )
    if shapes is None and max(layout.shape) > 5:
        # A wide axis (8+ ranks, simulated worlds): sides past its size, or every
        # piece after the 6th would be empty; two dims bound the cost.
        shapes = tensor_shapes(max_dims=2, max_side=max(layout.shape) + 3)
    tensor = draw(tensors(shape=shapes, dtype=dts, fills=fills))
    ps = draw(
        placements(
            mesh_ndim=layout.ndim,
            tensor_ndim=tensor.ndim,
            allow_partial=allow_partial,
            reduce_ops=reduce_ops,
            mixed_reduce_ops=mixed_reduce_ops,
        )
    )
    return DistributedInput(tensor, layout, layout.build(mesh_factory), ps)


def distributed_inputs(
    *,
    world_size: int,
    min_ndim: int = 1,
    max_ndim: int = 3,
    allow_sub_meshes: bool = False,
    allow_partial: bool = True,
    reduce_ops: Sequence[str] = REDUCE_OPS,
    mixed_reduce_ops: bool = True,
    shape: st.SearchStrategy[tuple[int, ...]] | None = None,
    dtype: st.SearchStrategy[torch.dtype] | torch.dtype | None = None,
    fills: Sequence[str] = FILLS,
    mesh_factory: Callable[[MeshLayout], Any] | None = None,
) -> st.SearchStrategy[DistributedInput]:
    """(global tensor, mesh, placements) triples, as ``DistributedInput``.

    Args:
        world_size: ranks of the test's world.
        min_ndim, max_ndim: mesh axes.
        allow_sub_meshes: also meshes that leave ranks out.
        allow_partial, reduce_ops, mixed_reduce_ops: as for ``placements``.
        shape, dtype, fills: as for ``tensors``.
        mesh_factory: ``layout -> mesh``; default: a cached dtensor CPU mesh.

    Example (inside a ``world_size`` test; the test service runs this inner
    ``@given`` in lockstep, every rank drawing the same examples):
        >>> @given(distributed_inputs(world_size=world.size))
        ... def check(inp):
        ...     dt = distribute_tensor(inp.tensor, inp.mesh, inp.placements)
        >>> check()
    """
    fn = "distributed_inputs"
    check_int(fn, "world_size", world_size, min_value=1)
    mesh_shapes(world_size=world_size, min_ndim=min_ndim, max_ndim=max_ndim)  # validate
    placements(mesh_ndim=1, tensor_ndim=0, allow_partial=allow_partial,
               reduce_ops=reduce_ops)  # validate
    if mesh_factory is not None and not callable(mesh_factory):
        raise InvalidArgument(f"{fn}: mesh_factory={mesh_factory!r} must be callable")
    tensors(shape=shape, dtype=dtype, fills=fills)  # validate
    return _distributed_inputs(world_size, min_ndim, max_ndim, allow_sub_meshes,
                               allow_partial, reduce_ops, mixed_reduce_ops, shape, dtype,
                               fills, mesh_factory)
