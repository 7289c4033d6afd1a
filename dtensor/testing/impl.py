"""One adapter over two DTensor implementations, so properties run on both.

``get_impl("dtensor")`` is this project's runtime; ``get_impl("torch")`` is
``torch.distributed.tensor``. Properties use strategy values (dtensor's
placements, ``MeshLayout``) and convert them with ``impl.placements`` and
``impl.mesh``.

Example:
    >>> impl = get_impl("torch")
    >>> mesh = impl.mesh(layout)
    >>> dt = impl.distribute_tensor(x, mesh, impl.placements(ps))
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtensor._rank_state import is_sim_rank
from dtensor.placement import Partial, Placement, Shard, StridedShard
from dtensor.spec import local_block
from dtensor.strided import block_runs, has_strided

__all__ = ["IMPLS", "Impl", "exact_split", "get_impl", "once_per_value", "partial_piece"]

IMPLS = ("dtensor", "torch")


@dataclass(frozen=True)
class Impl:
    """The names a property needs from one implementation.

    ``sub_meshes``: whether meshes may leave ranks of the world out (torch's
    ``DeviceMesh`` needs every world rank to construct it).
    ``mixed_partials``: whether one placement tuple may mix ``Partial`` reduce
    ops (torch raises ValueError); properties pass it to the strategies so the
    comparison exercises everything else, and a dedicated property covers it.
    """

    name: str
    DeviceMesh: Any
    DTensor: Any
    Shard: Any
    Replicate: Any
    Partial: Any
    distribute_tensor: Any
    sub_meshes: bool
    mixed_partials: bool = True

    def __repr__(self) -> str:
        return f"Impl({self.name!r})"

    def placements(self, ps: Sequence[Placement]) -> tuple:
        """dtensor placements (as drawn) in this implementation's classes."""
        out = []
        for p in ps:
            if isinstance(p, Shard):
                out.append(self.Shard(p.dim))
            elif isinstance(p, Partial):
                out.append(self.Partial(p.reduce_op))
            elif isinstance(p, StridedShard):
                out.append(p if self.name == "dtensor" else _torch_strided(p))
            else:
                out.append(self.Replicate())
        return tuple(out)

    def mesh(self, layout) -> Any:
        """The (cached) CPU mesh of a ``MeshLayout``.

        For an implementation without ``sub_meshes``, a layout that is not the
        whole world in rank order skips the test (``pytest.skip``), the same
        way on every rank: building it would hang the ranks outside the test.
        """
        if not self.sub_meshes:
            import torch.distributed as dist

            world = dist.get_world_size() if dist.is_initialized() else 1
            if tuple(layout.ranks) != tuple(range(world)):
                import pytest

                pytest.skip(f"{self.name}: DeviceMesh construction is collective over "
                            f"the whole world ({world} ranks); cannot build {layout}")
        return _mesh(self.name, layout, _world_key())

    def named_mesh(self, layout, names: Sequence[str]) -> Any:
        """The (cached) CPU mesh of ``layout`` with axis names ``names``."""
        if not self.sub_meshes:
            self.mesh(layout)  # skips, as there, a layout that is not the whole world
        return _named_mesh(self.name, layout, tuple(names), _world_key())

    def from_blocks(self, x: torch.Tensor, mesh: Any, ps: Sequence[Placement], *,
                    exact: bool | None = None) -> Any:
        """A DTensor holding ``x`` built from the expected local blocks.

        Independent of the runtime's redistribute: each rank cuts its block of
        ``x`` with ``dtensor.spec.local_block`` and calls ``from_local``.
        Partial pieces are non-trivial, so a rule that wrongly keeps a
        ``Partial`` through a non-linear op shows, yet they reduce to ``x`` in
        any order of the mesh axes (see ``partial_piece``). ``exact``
        (default: ``exact_split(x)``) picks integer splits; pass
        ``all(exact_split(t) for t in operands)`` when several operands meet
        in one op, so pieces of different magnitudes never round together.
        """
        coord = mesh.get_coordinate()
        ours = tuple(ps)
        strided = coord is not None and has_strided(ours)
        shape, offset = local_block(x.shape, tuple(mesh.shape),
                                    ours if not strided else (), None if strided else coord)
        if coord is None:
            local = torch.empty(shape, dtype=x.dtype)
        else:
            if strided:  # interleaved rows: gather them by index
                local = x
                for d, runs in enumerate(block_runs(x.shape, tuple(mesh.shape), ours, coord)):
                    rows = [i for s, n in runs for i in range(s, s + n)]
                    local = local.index_select(d, torch.tensor(rows, dtype=torch.long))
            else:
                idx = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
                local = x[idx].clone()
            exact = exact_split(x) if exact is None else exact
            salt = _salt(x) if any(isinstance(p, Partial) for p in ours) else 0
            for axis, p in enumerate(ours):
                if isinstance(p, Partial):
                    local = partial_piece(local, p.reduce_op, mesh.shape[axis], coord[axis],
                                          exact=exact, salt=salt + axis)
        return self.DTensor.from_local(
            local, mesh, self.placements(ours), shape=tuple(x.shape),
            stride=x.stride() if x.is_contiguous() else None,
        )

    @contextlib.contextmanager
    def comm_counter(self) -> Iterator[Any]:
        """Counts collectives: ``with impl.comm_counter() as c: ...; c.total``."""
        if self.name == "dtensor":
            from dtensor.debug import CommCounter

            with CommCounter() as c:
                yield c
        else:
            from torch.distributed.tensor.debug import CommDebugMode

            mode = CommDebugMode()
            box = _TorchCount(mode)
            with mode:
                yield box


class _TorchCount:
    def __init__(self, mode: Any) -> None:
        self._mode = mode

    @property
    def total(self) -> int:
        return self._mode.get_total_counts()


def exact_split(x: torch.Tensor) -> bool:
    """Whether ``x`` can be split into integer pieces exactly (ints, and floats
    holding small integers: exact in bfloat16 too)."""
    if x.dtype == torch.bool:
        return False
    if not x.is_floating_point():
        return True
    if x.numel() == 0:
        return True
    return _by_content("exact", x, _exact_floats)


def _exact_floats(x: torch.Tensor) -> bool:
    return bool(torch.isfinite(x).all() and (x == x.round()).all() and x.abs().max() <= 64)


def _by_content(what: str, x: torch.Tensor, fn):
    """``fn(x)``, computed once per value in a simulated world.

    Every rank of a simulated world asks these of its own copy of the same
    global tensor: ~40-60 us of ops each, n times per operand. Keyed by the
    bytes themselves (~4 us), a rank reuses the answer another rank computed
    for equal contents, so a copy written in place only misses.
    """
    return once_per_value(what, (x,), lambda: fn(x))


def once_per_value(what: Any, tensors: Sequence[torch.Tensor], fn: Callable[[], Any]) -> Any:
    """``fn()``, computed once per (``what``, contents of ``tensors``) in a
    simulated world; called directly anywhere else.

    The ranks of a simulated world are threads of one process, each holding
    its own copy of the same drawn values, and each would compute the same
    single-device reference. ``fn`` must depend only on ``what`` (hashable
    values naming the op and the non-tensor arguments; never an ``id()``:
    each rank holds its own copy of a drawn object, and a freed copy's id
    comes back as another object's) and the tensors' values, and must not
    draw random numbers: a rank that skips it would leave its generator out
    of step. Every rank gets the one answer, so callers only read it. A
    tensor that is large, on another device or needs grad: computed directly.

    Example:
        >>> expected = once_per_value(("mul", 2), (x,), lambda: x * 2)
    """
    if not is_sim_rank():
        return fn()
    parts = []
    for x in tensors:
        if (type(x) is not torch.Tensor or not x.is_cpu or x.numel() > _CONTENT_LIMIT
                or x.requires_grad):
            return fn()
        try:
            parts.append((x.dtype, x.shape, x.numpy().tobytes()))
        except (TypeError, RuntimeError):  # bfloat16; a conjugate or negative view
            return fn()
    key = (what, *parts)
    try:
        hit = _CONTENT.get(key, _CONTENT)
    except TypeError:
        raise TypeError(
            f"once_per_value: `what` must be hashable values naming the op and its "
            f"non-tensor arguments (a tuple of str/int/float), got {what!r}; "
            f"pass repr() of a list or dict") from None
    if hit is _CONTENT:
        if len(_CONTENT) >= 1024:
            _CONTENT.clear()
        hit = _CONTENT[key] = fn()
    return hit


_CONTENT: dict = {}  # (what, (dtype, shape, bytes) per tensor) -> answer: once_per_value
_CONTENT_LIMIT = 4096  # elements: larger tensors are few, and their keys cost more


def partial_piece(v: torch.Tensor, op: str, n: int, c: int, *, exact: bool,
                  salt: int = 0) -> torch.Tensor:
    """Coordinate ``c``'s piece (of ``n``) of value ``v`` under ``Partial(op)``.

    sum: ``v - (n-1)`` at 0 and ``1`` elsewhere (``v`` and zeros when the
    split would round: non-integer floats, inf/nan); avg: ``v + (n-1)`` at 0
    and ``v - 1`` elsewhere (``v`` everywhere when inexact); max: ``v`` at
    each element's holder and ``v - 1`` elsewhere; min: ``v + 1`` elsewhere
    (bool: False / True). Element ``i`` is held by coordinate
    ``(i + salt) % n``: ``from_blocks`` draws the salt from the whole
    tensor's values, so two operands of one op rarely hold their extremes on
    the same coordinates, and a rule that adds max pieces elementwise (right
    only where one rank holds both extremes) shows. Each piece is a function
    of the coordinate alone with slope 1, so nested partial axes, with mixed
    reduce ops too, reduce to ``v`` in any order.
    """
    first = c == 0
    if op == "sum":
        if not exact:
            return v if first else torch.zeros_like(v)
        return v - (n - 1) if first else torch.ones_like(v)
    if op == "avg":
        if not exact:
            return v
        return v + (n - 1) if first else v - 1
    if op not in ("max", "min"):
        raise ValueError(f"partial_piece: unknown reduce op {op!r}")
    held = ((torch.arange(v.numel()) + salt) % n == c).reshape(v.shape)
    if v.dtype == torch.bool:
        other = torch.zeros_like(v) if op == "max" else torch.ones_like(v)
    else:
        other = v - 1 if op == "max" else v + 1
    return torch.where(held, v, other)


def _salt(x: torch.Tensor) -> int:
    """A number read off all of ``x``'s values (every rank reads the same),
    spread by a multiplicative hash so nearby totals (integer data) land on
    different coordinates."""
    if x.numel() == 0:
        return 0
    return _by_content("salt", x, _salt_of)


def _salt_of(x: torch.Tensor) -> int:
    finite = torch.nan_to_num(x.detach().to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)
    weights = torch.arange(1, x.numel() + 1, dtype=torch.float64)
    total = (finite.reshape(-1) * weights).sum().item()
    return ((hash(total) if math.isfinite(total) else 0) * 0x9E3779B1 >> 16) & 0xFFFF


def _world_key() -> str:
    # A mesh holds the process groups of the world it was built in; under a
    # test service that swaps sub-worlds in (launch/rank/subworld.py) the same
    # layout names different groups in each world, so the cache is per world.
    from dtensor import _comm

    # And per rank: a simulated world (launch/sim/world.py) hosts every rank in
    # this process, and a mesh holds its own rank's coordinate and groups.
    return f"{_comm.world_tag()}/{_comm.get_rank()}"


def _torch_strided(p: StridedShard):
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(p.dim, split_factor=p.split_factor)


# Sized for every rank of a 1,024-rank simulated world and a few layouts:
# one entry per (layout, rank), and an entry evicted before its rank asks
# again rebuilds the mesh (O(ranks) checks) on every rank, in every example.
_MESHES_KEPT = 4096


@functools.lru_cache(maxsize=_MESHES_KEPT)
def _mesh(name: str, layout, world: str) -> Any:
    impl = get_impl(name)
    return impl.DeviceMesh("cpu", layout.grid())


@functools.lru_cache(maxsize=_MESHES_KEPT)
def _named_mesh(name: str, layout, names: tuple, world: str) -> Any:
    impl = get_impl(name)
    return impl.DeviceMesh("cpu", layout.grid(), mesh_dim_names=names)


@functools.lru_cache(maxsize=2)
def get_impl(name: str = "dtensor") -> Impl:
    """The adapter for ``"dtensor"`` or ``"torch"``."""
    if name == "dtensor":
        import dtensor

        return Impl("dtensor", dtensor.DeviceMesh, dtensor.DTensor, dtensor.Shard,
                    dtensor.Replicate, dtensor.Partial, dtensor.distribute_tensor,
                    sub_meshes=True)
    if name == "torch":
        from torch.distributed import tensor as tdt
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.placement_types import Partial as TPartial

        return Impl("torch", DeviceMesh, tdt.DTensor, tdt.Shard, tdt.Replicate,
                    TPartial, tdt.distribute_tensor, sub_meshes=False,
                    mixed_partials=False)
    raise ValueError(f"get_impl: name must be one of {IMPLS}, got {name!r}")
