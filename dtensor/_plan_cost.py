"""What a redistribute step costs on the wire, and the cheapest sequence of steps.

Pure layout math for ``dtensor.redistribute``: no tensors, no communication.

Cost model: elements one rank receives under ring algorithms, for the block
held at mesh coordinate 0, which is the largest block at every nesting level
(``torch.chunk`` pieces are ``ceil``-sized, trailing ones shorter), hence what
a padded collective moves. It mirrors what ``redistribute.execute`` sends:

- ``reduce`` (all-reduce of the block): ``2 (n-1)/n * numel``;
- ``reduce_scatter``: the cut dim is padded to ``n * ceil(len / n)``, then
  ``(n-1)/n`` of that buffer;
- ``gather``: every rank contributes the (padded) piece rank 0 holds:
  ``(n-1) * numel``;
- ``slice`` and ``to_partial`` are local: 0. Axes of size 1 cost 0.
- consecutive ``reduce`` steps of one op (``reduce_runs``) are one all-reduce
  over all their ranks: ``2 (N-1)/N * numel``, N the product of their sizes.

``cheapest_moves`` searches the orderings of the moves the executor
supports (Dijkstra over placement states); the planner compares its answer
with its fixed phase ordering and keeps the cheaper (see
``redistribute._plan``). Example, 2x2 mesh, 8x8 tensor::

    >>> cheapest_moves((Partial(), Shard(0)), (Shard(0), Shard(1)), (2, 2), (8, 8), False)
    ((1, 'gather', Replicate()), (1, 'slice', Shard(dim=1)),
     (0, 'reduce_scatter', Shard(dim=0)))
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

from dtensor.placement import Partial, Placement, Replicate, Shard

__all__ = [
    "can_cut", "cheapest_moves", "even_shape", "move_cost", "plan_cost", "reduce_runs",
]

Move = tuple[int, str, Placement]  # (mesh axis, step kind, placement after)

# The search runs on placement codes (hashing dataclasses dominated it): a
# shard is its dim, Replicate is _R, any Partial is _P (reductions take their
# op from the source placement when the steps are built).
_R, _P = -1, -2


def _code(p: Placement) -> int:
    if isinstance(p, Shard):
        return p.dim
    return _R if isinstance(p, Replicate) else _P


def _cut_ok(cur: Sequence[int], dst: Sequence[int], axis: int, dim: int) -> bool:
    for a, p in enumerate(cur):
        if a < axis and (p == dim) != (dst[a] == dim):
            return False
        if a > axis and p == dim:
            return False
    return True


def can_cut(cur: Sequence[Placement], dst: Sequence[Placement], axis: int, dim: int) -> bool:
    """Whether ``axis`` can take its target ``Shard(dim)`` now (slice or reduce-scatter).

    Nested shards split ``dim`` outer axis first, so cutting ``axis``'s piece
    now is only the final layout when the axes already sharding ``dim`` before
    it are exactly the target's (they stay put) and no axis after it shards
    ``dim`` yet (its piece would be cut from the wrong block).
    """
    return _cut_ok([_code(p) for p in cur], [_code(p) for p in dst], axis, dim)


def even_shape(
    src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    """A global shape every nesting of ``mesh_shape`` splits evenly.

    Used when the planner is not told the shape: on even shapes every block
    is ``numel / (product of its shard axes)``, so the costs of two plans
    compare the same way for every even shape.
    """
    dims = [p.dim for p in (*src, *dst) if isinstance(p, Shard)]
    return (math.prod(mesh_shape),) * (max(dims, default=0) + 1)


def _block(global_shape: Sequence[int], mesh_shape: Sequence[int], codes) -> list[int]:
    """Shape of coordinate 0's block: ceil pieces, outer axis first."""
    block = list(global_shape)
    for axis, d in enumerate(codes):
        if d >= 0:
            block[d] = -(-block[d] // mesh_shape[axis])
    return block


def _cost(block: list[int], numel: int, n: int, kind: str, dim: int) -> float:
    if n == 1 or kind in ("slice", "to_partial"):
        return 0.0
    if kind == "reduce":
        return 2 * (n - 1) / n * numel
    if kind == "gather":
        return float((n - 1) * numel)
    if kind == "reduce_scatter":
        length = block[dim]
        return 0.0 if length == 0 else float((n - 1) * -(-length // n) * (numel // length))
    raise AssertionError(kind)


def move_cost(
    before: Sequence[Placement],
    axis: int,
    kind: str,
    new: Placement,
    mesh_shape: Sequence[int],
    global_shape: Sequence[int],
) -> float:
    """Elements coordinate 0 receives for one step (see the module docstring)."""
    block = _block(global_shape, mesh_shape, [_code(p) for p in before])
    return _cost(block, math.prod(block), mesh_shape[axis], kind, _code(new))


def reduce_runs(steps) -> dict[int, int]:
    """``{first: end}`` for each run of two or more consecutive ``reduce`` steps
    with one reduce op: ``steps[first:end]`` run as one all-reduce over the
    group spanning their mesh axes (what a flattened mesh's group does in
    PyTorch), one collective instead of one per axis, for the bytes of one
    all-reduce over all their ranks."""
    runs, i = {}, 0
    while i < len(steps):
        j = i
        while (j < len(steps) and steps[j].kind == "reduce"
               and steps[j].src.reduce_op == steps[i].src.reduce_op):
            j += 1
        if j - i >= 2:
            runs[i] = j
        i = max(j, i + 1)
    return runs


def plan_cost(steps, mesh_shape: Sequence[int], global_shape: Sequence[int]) -> float:
    """Total ``move_cost`` of ``redistribute.Step`` values, in elements (a
    ``reduce_runs`` run priced as its one all-reduce)."""
    total, runs, i = 0.0, reduce_runs(steps), 0
    while i < len(steps):
        s = steps[i]
        end = runs.get(i)
        if end is None:
            total += move_cost(s.before, s.axis, s.kind, s.dst, mesh_shape, global_shape)
            i += 1
            continue
        block = _block(global_shape, mesh_shape, [_code(p) for p in s.before])
        n = math.prod(mesh_shape[t.axis] for t in steps[i:end])
        total += _cost(block, math.prod(block), n, "reduce", _R)
        i = end
    return total


def _moves(cur: tuple, target: tuple, pending: frozenset, in_axis_order: bool, ndim: int):
    """Every single step the executor can run from ``cur`` toward ``target``."""
    for axis, p in enumerate(cur):
        t = target[axis]
        inner = cur[axis + 1:]
        if p >= 0:
            # Only the innermost shard of a dim can be gathered in place.
            if p not in inner:
                yield axis, "gather", _R
        elif p == _R:
            if t >= 0 and _cut_ok(cur, target, axis, t):
                yield axis, "slice", t
        elif axis in pending:
            if in_axis_order and any(cur[a] == _P for a in pending if a < axis):
                continue  # non-commuting reductions run in axis order
            yield axis, "reduce", _R
            for dim in range(ndim):
                # Any dim no inner axis shards can be cut, target or not: a
                # reduce-scatter then a gather move what one all-reduce does,
                # and every step in between moves 1/n of the data.
                if dim not in inner:
                    yield axis, "reduce_scatter", dim


def cheapest_moves(
    src: tuple,
    target: tuple,
    mesh_shape: tuple,
    global_shape: tuple,
    in_axis_order: bool,
    budget: float = math.inf,
) -> tuple[Move, ...] | None:
    """Cheapest sequence of moves from ``src`` to ``target`` costing under ``budget``.

    None when no such sequence exists. The budget (what the caller already
    has) prunes the search: a plan whose phase order is free explores nothing.

    ``target`` holds no ``Partial`` other than those ``src`` keeps unchanged
    (the planner turns Replicate into Partial afterwards, for free).
    Partial axes of ``src`` that differ from ``target`` are reduced once each;
    ``in_axis_order`` forces those reductions into axis order (mixed reduce
    ops do not commute). Ties go to the path found first, fewer steps first.
    """
    if budget <= 0:
        return None
    pending = frozenset(
        a for a, (s, t) in enumerate(zip(src, target, strict=True))
        if isinstance(s, Partial) and s != t
    )
    start, goal = tuple(map(_code, src)), tuple(map(_code, target))
    ndim = len(global_shape)
    tie = itertools.count()
    best = {start: 0.0}
    heap: list = [(0.0, 0, next(tie), start, ())]
    while heap:
        cost, _, _, cur, path = heapq.heappop(heap)
        if cur == goal:
            return tuple((a, k, Replicate() if c == _R else Shard(c)) for a, k, c in path)
        if cost > best[cur]:
            continue
        block = _block(global_shape, mesh_shape, cur)
        numel = math.prod(block)
        for axis, kind, new in _moves(cur, goal, pending, in_axis_order, ndim):
            nxt = (*cur[:axis], new, *cur[axis + 1:])
            c = cost + _cost(block, numel, mesh_shape[axis], kind, new)
            if c < budget and c < best.get(nxt, math.inf):
                best[nxt] = c
                heapq.heappush(heap, (c, len(path) + 1, next(tie), nxt, (*path, (axis, kind, new))))
    return None
