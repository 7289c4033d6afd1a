"""Covers: dtensor/testing/impl.py's ``once_per_value`` (a single-device
reference computed once for all ranks of a simulated world, keyed by the
operands' contents) and ``exact_split`` through it."""

from __future__ import annotations

import os

import pytest
import torch

from dtensor._rank_state import enter_rank
from dtensor.testing.impl import exact_split, once_per_value
from launch.sim.threaded import entered
from launch.sim.world import SimWorld

pytestmark = pytest.mark.skipif(
    "RANK" in os.environ, reason="a simulated world swaps this process's c10d world; "
    "not inside a rank of a real world")


def _on_ranks(n: int, fn):
    def as_rank(rank: int):
        enter_rank(rank, n)  # what the service's rank start does
        return fn(rank)

    w = SimWorld(n)
    try:
        with entered():
            outs = w.run(as_rank, 60)
    finally:
        with entered():
            w.close()
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        raise errors[0]
    return [o.value for o in outs]


def test_the_ranks_of_a_simulated_world_share_one_answer_per_content() -> None:
    calls = []

    def body(rank: int):
        x = torch.arange(4.0)
        y = x + 1  # other contents: its own answer
        a = once_per_value(("double", "shared"), (x,), lambda: calls.append(rank) or x * 2)
        b = once_per_value(("double", "shared"), (y,), lambda: calls.append(rank) or y * 2)
        c = once_per_value(("triple", "shared"), (x,), lambda: calls.append(rank) or x * 3)
        return a, b, c

    outs = _on_ranks(8, body)
    assert len(calls) == 3, f"computed {len(calls)} times for 3 distinct keys over 8 ranks"
    for a, b, c in outs:
        assert a is outs[0][0] and b is outs[0][1] and c is outs[0][2]
        assert torch.equal(a, torch.arange(4.0) * 2)
        assert torch.equal(b, (torch.arange(4.0) + 1) * 2)
        assert torch.equal(c, torch.arange(4.0) * 3)


def test_a_tensor_that_needs_grad_is_computed_on_every_rank() -> None:
    calls = []

    def body(rank: int):
        x = torch.arange(3.0, requires_grad=True)
        return once_per_value(("sum", "grad"), (x,), lambda: calls.append(rank) or x.sum())

    outs = _on_ranks(4, body)
    assert sorted(calls) == [0, 1, 2, 3]
    assert all(o.item() == 3.0 for o in outs)


def test_outside_a_simulated_world_every_call_computes() -> None:
    calls = []
    x = torch.arange(4.0)
    for _ in range(2):
        once_per_value(("double", "alone"), (x,), lambda: calls.append(1) or x * 2)
    assert len(calls) == 2


def test_exact_split_answers_by_content_on_every_rank() -> None:
    def body(rank: int):
        whole = torch.tensor([1.0, 2.0, -3.0])
        return exact_split(whole), exact_split(whole / 4), exact_split(whole + 100)

    assert _on_ranks(4, body) == [(True, False, False)] * 4


def test_an_unhashable_key_is_named_on_every_rank() -> None:
    def body(rank: int):
        try:
            once_per_value(("mul", [2]), (torch.ones(2),), lambda: None)
        except TypeError as e:
            return str(e)
        return "no error"

    msgs = _on_ranks(4, body)
    assert all("must be hashable" in m and "('mul', [2])" in m for m in msgs), msgs
