"""Placements: how a tensor is laid out along one mesh axis.

``Shard(dim)`` splits tensor dim ``dim`` into ``torch.chunk``-style pieces,
``Replicate()`` keeps a full copy on every coordinate, and ``Partial(op)``
holds pieces that must still be reduced with ``op``. They are pure values:
frozen, hashable, and they never talk to the network.

Example:
    >>> from dtensor import Shard, Replicate, Partial
    >>> str((Shard(0), Replicate(), Partial("max")))
    "(S(0), R, P(max))"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dtensor.errors import PlacementError

__all__ = [
    "ALL_REDUCE_OPS",
    "REDUCE_OPS",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "StridedShard",
    "format_placements",
    "is_linear_partial",
    "norm_partial",
    "norm_pieces_from",
    "partial_fill",
    "partial_to_replicate",
    "replicated",
]

#: Reduce ops every rule and every dtype supports (the property tests draw these).
REDUCE_OPS = ("sum", "avg", "max", "min")
#: Every reduce op a ``Partial`` placement may carry: ``REDUCE_OPS`` plus the
#: other ``torch.distributed.ReduceOp`` kinds (PyTorch's names). ``product``
#: needs a real dtype; the bitwise ones an integer or bool dtype.
ALL_REDUCE_OPS = (*REDUCE_OPS, "product", "band", "bor", "bxor")
#: Other spellings accepted (and normalised) by ``Partial``.
_ALIASES = {"prod": "product"}
# Ops where n copies of a value reduce to that value: a replicated value
# becomes partial by keeping it on every coordinate.
_IDEMPOTENT = frozenset(("avg", "max", "min", "band", "bor", "norminf"))
#: Prefix of the p-norm reduce ops (``norm_partial``): ``"norm2"``, ``"norm1"``,
#: ``"norminf"``, ``"norm0"``, ``"norm1.5"``.
NORM_PREFIX = "norm"


def norm_order(op: str) -> float | None:
    """The ``p`` of a norm reduce op (``"norm2"`` -> 2.0), None for other ops."""
    if not op.startswith(NORM_PREFIX):
        return None
    try:
        return float(op[len(NORM_PREFIX):])
    except ValueError:
        return None


def _norm_op(p) -> str | None:
    """The canonical name of the ``p``-norm reduce op, or None when ``p`` has none."""
    try:
        p = float(p)
    except (TypeError, ValueError):
        return None
    if not (p >= 0):  # NaN, negative and -inf norms have no partial form
        return None
    text = repr(p)
    return NORM_PREFIX + (text[:-2] if text.endswith(".0") else text)


class Placement:
    """Base of the placement kinds; use the subclasses."""

    # Weak-referenceable: torch.compile keys tables of graph inputs by weakref.
    __slots__ = ("__weakref__",)
    kind: ClassVar[str] = ""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False

    def __fx_repr__(self) -> tuple[str, dict]:
        """This placement as an expression in code torch.compile generates."""
        cls = type(self)
        name = f"dtensor_{cls.__name__}"
        return name + repr(self).removeprefix(cls.__name__), {name: cls}


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Tensor dim ``dim`` is split across the mesh axis (``torch.chunk`` sizes).

    Trailing coordinates may hold empty shards when the dim is not divisible.
    A negative ``dim`` is kept as given here; specs normalise it against the
    tensor's rank.
    """

    dim: int
    kind: ClassVar[str] = "shard"

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise PlacementError(
                f"Shard(dim): expected an int tensor dim, got {self.dim!r} "
                f"({type(self.dim).__name__})"
            )

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class StridedShard(Placement):
    """Tensor dim ``dim`` split across the mesh axis in interleaved rows.

    The block this axis splits is first cut into ``split_factor`` pieces
    (``torch.chunk`` sizes), each piece is cut again into one piece per
    coordinate, and coordinate ``i`` holds the ``i``-th sub-piece of every
    piece, in order. It is the layout FSDP gives a tensor that tensor
    parallelism already sharded on the same dim (PyTorch's ``_StridedShard``):
    on a ``(dp, tp)`` mesh, ``(StridedShard(0, split_factor=tp), Shard(0))``
    puts on ``(i, j)`` the ``i``-th dp piece of tp block ``j`` (see
    ``dtensor.spec.fsdp_tp_placements``). ``split_factor=1`` is ``Shard(dim)``
    and specs store it so. Row math: ``dtensor.spec.strided_runs``.

    Example:
        >>> # 8 rows, split_factor 2, mesh axis of 2: rows 0-1 and 4-5 on 0
        >>> strided_runs(8, 2, 2, 0), strided_runs(8, 2, 2, 1)
        (((0, 2), (4, 2)), ((2, 2), (6, 2)))
    """

    dim: int
    split_factor: int = 1
    kind: ClassVar[str] = "strided_shard"

    def __post_init__(self) -> None:
        for name in ("dim", "split_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise PlacementError(
                    f"StridedShard({name}): expected an int, got {v!r} ({type(v).__name__})"
                )
        if self.split_factor < 1:
            raise PlacementError(
                f"StridedShard(split_factor): expected >= 1 (the number of pieces an "
                f"inner mesh axis cut first), got {self.split_factor}"
            )

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __str__(self) -> str:
        return f"S({self.dim},sf={self.split_factor})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every coordinate of the mesh axis holds the full tensor."""

    kind: ClassVar[str] = "replicate"

    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Coordinates hold partial values; the tensor is their ``reduce_op``.

    ``reduce_op`` is one of ``ALL_REDUCE_OPS``: ``"sum"``, ``"avg"``,
    ``"max"``, ``"min"``, ``"product"`` (also spelled ``"prod"``), ``"band"``,
    ``"bor"``, ``"bxor"``; case does not matter. The name is stored in its
    canonical form, so ``Partial("prod") == Partial("product")``. A p-norm
    op (``"norm2"``, ``"norminf"``, ...; see ``norm_partial``) holds each
    coordinate's p-norm of its share: the value is the p-norm of the pieces.
    """

    reduce_op: str = "sum"
    kind: ClassVar[str] = "partial"

    def __post_init__(self) -> None:
        op = self.reduce_op
        if isinstance(op, str):
            op = op.lower()
            op = _ALIASES.get(op, op)
        if op not in ALL_REDUCE_OPS:
            norm = _norm_op(norm_order(op)) if isinstance(op, str) else None
            if norm is None:
                raise PlacementError(
                    f"Partial(reduce_op): expected one of {ALL_REDUCE_OPS} (or 'prod'), "
                    f"or a p-norm 'norm<p>' with p >= 0 or inf (e.g. 'norm2', 'norminf'), "
                    f"got {self.reduce_op!r}"
                )
            op = norm
        if op != self.reduce_op:
            object.__setattr__(self, "reduce_op", op)

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    @property
    def is_linear(self) -> bool:
        """The value is linear in the pieces (sum, avg): linear ops may act on
        each piece without reducing first. A max or min of pieces is not."""
        return self.reduce_op in ("sum", "avg")

    @property
    def is_idempotent(self) -> bool:
        """n copies of a value reduce to the value (avg, max, min, band, bor)."""
        return self.reduce_op in _IDEMPOTENT

    def identity(self):
        """The value that leaves others unchanged under ``reduce_op`` (0 for
        sum, bxor and finite p-norms, 1 for product); None for idempotent ops,
        which need none."""
        if self.reduce_op.startswith(NORM_PREFIX) and not self.is_idempotent:
            return 0
        return {"sum": 0, "bxor": 0, "product": 1}.get(self.reduce_op)

    @property
    def norm_order(self) -> float | None:
        """``p`` of a p-norm partial (``norm_partial(2).norm_order == 2.0``), else None."""
        return norm_order(self.reduce_op)

    def __str__(self) -> str:
        return f"P({self.reduce_op})"


def norm_partial(p: float) -> Partial:
    """The placement whose coordinates hold p-norms of their shares.

    The value is the p-norm of the pieces: ``(sum of piece**p) ** (1/p)``,
    the max for ``inf``, the sum of counts for ``p = 0``. Norms of sharded
    tensors take it (``torch._foreach_norm``, what ``clip_grad_norm_`` calls)
    so that a norm of norms stays local and the mesh reduces one scalar where
    the total is used. Pieces are non-negative; ``p`` is ``>= 0`` or ``inf``.

    Example:
        >>> norm_partial(2.0), norm_partial(float("inf"))
        (Partial(reduce_op='norm2'), Partial(reduce_op='norminf'))
    """
    op = _norm_op(p)
    if op is None:
        raise PlacementError(f"norm_partial(p): expected p >= 0 or inf, got {p!r}")
    return Partial(op)


def norm_pieces_from(placements, what: str, value=None) -> None:
    """Refuse to write a value straight into ``Partial("norm<p>")`` pieces
    when it may be negative: coordinate 0 keeping v and the others 0 combine
    to |v|. ``value``: a constant being written (None: values not known here,
    e.g. a random draw). A pure check of the placements and the constant, so
    every rank raises alike.

    Example:
        >>> norm_pieces_from((Replicate(),), "randn")   # no norm pieces: fine
    """
    pieces = [p for p in placements if isinstance(p, Partial) and p.norm_order is not None]
    if pieces and (value is None or value < 0):
        raise PlacementError(
            f"{what} with placements {format_placements(tuple(placements))}: the pieces of "
            f"{pieces[0]} are norms (>= 0), so "
            f"{'a negative value' if value is not None else 'values that may be negative'} "
            f"cannot be written into them; create the tensor with Replicate() on that "
            f"axis and redistribute it (the value's norms are then checked)"
        )


def is_linear_partial(p: Placement) -> bool:
    """``p`` is ``Partial(sum)`` or ``Partial(avg)`` (see ``Partial.is_linear``)."""
    return isinstance(p, Partial) and p.is_linear


_REPLICATED: list[tuple[Placement, ...]] = []


def replicated(mesh) -> tuple[Placement, ...]:
    """``(Replicate(),) * n`` for a mesh (or a number of mesh axes ``n``).

    Example:
        >>> replicated(2)
        (Replicate(), Replicate())
    """
    n = mesh if isinstance(mesh, int) else mesh.ndim
    while len(_REPLICATED) <= n:
        _REPLICATED.append((Replicate(),) * len(_REPLICATED))
    return _REPLICATED[n]


def partial_to_replicate(placements) -> tuple[Placement, ...]:
    """The placements with every ``Partial`` axis reduced to ``Replicate``.

    Example:
        >>> format_placements(partial_to_replicate((Shard(0), Partial())))
        '(S(0), R)'
    """
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def partial_fill(placements, coord):
    """What this coordinate holds in place of a value every coordinate has,
    so that the placements' Partial axes reduce to that value: ``None`` (keep
    the value) or an identity to fill with.

    Partial axes reduce in axis order, so a coordinate off 0 on the lowest
    such axis that is not idempotent holds that axis's identity (0 for sum
    and bxor, 1 for product); idempotent ops (avg, max, min, band, bor) keep
    the value everywhere.

    Example:
        >>> partial_fill((Partial("sum"), Partial("product")), (0, 1))
        1
    """
    for axis, p in enumerate(placements):
        if isinstance(p, Partial) and coord[axis] != 0 and not p.is_idempotent:
            return p.identity()
    return None


def format_placements(placements: tuple[Placement, ...]) -> str:
    """Compact form of a placement tuple, e.g. ``(S(0), R)``."""
    return "(" + ", ".join(str(p) for p in placements) + ")"
