"""Covers: dtensor/testing/partial_inputs.py: random Partial pieces reduce to
the value for every reduce op, nested and mixed over mesh axes in either
order, in every dtype; the extreme is held by the drawn coordinate; and the
pieces are not the canonical layout, so a rule keeping a Partial through a
non-linear op is caught where the canonical layout hides it."""

from __future__ import annotations

import itertools

import pytest
import torch

from dtensor import Partial, Replicate, Shard
from dtensor.testing.partial_inputs import PartialSplit, piece

REDUCE = {
    "sum": lambda ts: torch.stack(ts).sum(0),
    "avg": lambda ts: torch.stack(ts).double().mean(0),
    "max": lambda ts: torch.stack(ts).amax(0),
    "min": lambda ts: torch.stack(ts).amin(0),
}


def _pieces(x, mesh_shape, ps, split):
    return {c: piece(x, mesh_shape, ps, c, split)
            for c in itertools.product(*(range(n) for n in mesh_shape))}


@pytest.mark.parametrize("op", sorted(REDUCE))
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.int64, torch.bfloat16])
def test_pieces_reduce_to_the_value(op, dtype) -> None:
    x = (torch.arange(12) - 5).reshape(3, 4).to(dtype)
    if op == "avg" and not dtype.is_floating_point:
        x = x * 1  # an integer mean of integer pieces: exact, offsets sum to 0
    for holder in range(3):
        pieces = _pieces(x, (3,), (Partial(op),), PartialSplit((holder,), 7))
        got = REDUCE[op]([pieces[(c,)] for c in range(3)])
        assert torch.equal(got.to(x.dtype), x), (op, dtype, holder)
        others = [pieces[(c,)] for c in range(3) if c != holder]
        assert any(not torch.equal(o, x) and bool(o.ne(0).any()) for o in others), \
            "pieces must not be the canonical layout"


def test_float_pieces_are_random_and_reduce_within_rounding() -> None:
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    for op in REDUCE:
        pieces = _pieces(x, (4,), (Partial(op),), PartialSplit((2,), 3))
        got = REDUCE[op]([pieces[(c,)] for c in range(4)]).to(x.dtype)
        torch.testing.assert_close(got, x, rtol=1e-5, atol=1e-5)
    split = PartialSplit((2,), 3)
    maxes = _pieces(x, (4,), (Partial("max"),), split)
    held = torch.stack([maxes[(c,)] == x for c in range(4)])
    assert bool((held.sum(0) >= 1).all())  # every element's extreme is on some coordinate
    assert bool((maxes[(0,)] < x).any())
    # ... on coordinates that vary by element, and by operand of one call: a
    # rule adding max pieces of two operands elementwise must go wrong
    assert all(bool(h.any()) and not bool(h.all()) for h in held)
    other = _pieces(x, (4,), (Partial("max"),), split.for_operand(1))
    assert not torch.equal(held, torch.stack([other[(c,)] == x for c in range(4)]))
    summed = REDUCE["max"]([maxes[(c,)] + other[(c,)] for c in range(4)])
    assert bool((summed < 2 * x).any())


@pytest.mark.parametrize("ops", list(itertools.product(sorted(REDUCE), repeat=2)))
def test_nested_mixed_partials_reduce_in_either_order(ops) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64)
    ps = (Partial(ops[0]), Partial(ops[1]))
    p = _pieces(x, (2, 3), ps, PartialSplit((1, 2), 11))
    inner_first = REDUCE[ops[0]]([REDUCE[ops[1]]([p[(i, j)] for j in range(3)])
                                  for i in range(2)])
    outer_first = REDUCE[ops[1]]([REDUCE[ops[0]]([p[(i, j)] for i in range(2)])
                                  for j in range(3)])
    torch.testing.assert_close(inner_first, x)
    torch.testing.assert_close(outer_first, x)


def test_blocks_follow_shards_beside_partials() -> None:
    x = torch.arange(10.0).reshape(5, 2)
    ps = (Shard(0), Partial("sum"))
    p = _pieces(x, (2, 2), ps, PartialSplit((0, 1), 5))
    assert p[(0, 0)].shape == (3, 2) and p[(1, 1)].shape == (2, 2)
    torch.testing.assert_close(p[(1, 0)] + p[(1, 1)], x[3:])
    assert piece(x, (2,), (Replicate(),), None, PartialSplit((0,), 0)).numel() == 0


def test_random_pieces_catch_what_the_canonical_layout_hides() -> None:
    # relu kept through Partial(sum): right on (x, 0), wrong on random pieces.
    x = torch.tensor([3.0, -2.0, 1.0])
    canonical = [x, torch.zeros_like(x)]
    assert torch.equal(sum(torch.relu(t) for t in canonical), torch.relu(x))
    p = _pieces(x, (2,), (Partial("sum"),), PartialSplit((1,), 0))
    assert not torch.equal(torch.relu(p[(0,)]) + torch.relu(p[(1,)]), torch.relu(x))
