"""Drawn cases and their shrinking without Hypothesis' engine, in lockstep.

A simulated world (``pytest --dist-sim``) runs its ranks as threads of one
process and refuses a Hypothesis run started inside a test body: one engine
per rank thread would draw different examples on different ranks. The
``verify_*`` calls there draw their cases here instead: case ``i`` from a
``ConjectureData`` seeded ``base_seed + i`` (the same choices on every rank),
and a failing case is shrunk by a small deterministic shrinker over its
choice sequence. Every attempt is a choice sequence replayed on every rank;
the ranks agree on each verdict (one all-reduce), so they take the same
path and end on the same smallest case. Passes, until none helps or the
budget is spent: delete runs of choices (shorter lists), then lower each
choice towards its simplest value (Hypothesis' own order of choices:
index 0 is the simplest; a binary search on the index). A candidate is
kept only if it is smaller in shortlex order of choice indices, so it ends.

Example (the form ``verify_rule`` takes in a simulated world)::

    run_drawn(example, max_examples=100, base_seed=1234)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from dtensor.testing.rule_case import RuleCounterexample, agree_failed, first_message

__all__ = ["MAX_SHRINKS", "run_drawn"]

MAX_SHRINKS = 300  # replayed candidates at most, per failing case
_STEPS_PER_CHOICE = 16  # binary-search steps when lowering one choice


class _Draws:
    """``data.draw`` over one ConjectureData (the ``st.data()`` interface)."""

    def __init__(self, cd: Any) -> None:
        self.cd = cd

    def draw(self, strategy: Any, label: Any = None) -> Any:
        return self.cd.draw(strategy)


def _attempt(example: Callable[[Any], None], cd: Any
             ) -> tuple[bool, AssertionError | None]:
    """Run one case: (valid, this rank's failure). A case single device
    refuses (``reject()``) or that runs out of choices is not valid."""
    from hypothesis.control import BuildContext
    from hypothesis.errors import StopTest, UnsatisfiedAssumption

    try:
        with BuildContext(cd, is_final=True, wrapped_test=example):
            example(_Draws(cd))
    except (UnsatisfiedAssumption, StopTest):
        return False, None
    except AssertionError as e:
        return True, e
    return True, None


def _key(nodes: Sequence[Any]) -> tuple:
    from hypothesis.internal.conjecture.choice import choice_to_index

    return (len(nodes), tuple(choice_to_index(n.value, n.constraints) for n in nodes))


class _Shrinker:
    """Shrinks one failing case; ``best`` is the smallest failing one so far."""

    def __init__(self, example: Callable[[Any], None], nodes: Sequence[Any],
                 err: AssertionError | None, budget: int) -> None:
        self.example, self.budget, self.tried = example, budget, 0
        self.best, self.err = tuple(nodes), err

    def fails(self, choices: Sequence[Any]) -> bool:
        """Replay ``choices`` (the rest simplest); keep it if it fails agreed
        and is smaller. Collective: every rank calls it with the same."""
        from hypothesis.internal.conjecture.choice import ChoiceTemplate
        from hypothesis.internal.conjecture.data import ConjectureData

        if self.tried >= self.budget:
            return False
        self.tried += 1
        cd = ConjectureData.for_choices([*choices, ChoiceTemplate("simplest", count=None)])
        valid, err = _attempt(self.example, cd)
        # NOTE: ranks agree before looking at the candidate's size, so a rank
        # whose own run failed and one whose did not take the same branch.
        if not agree_failed(err is not None) or not valid:
            return False
        nodes = tuple(cd.nodes)
        if _key(nodes) >= _key(self.best):
            return False
        self.best, self.err = nodes, err
        return True

    def run(self) -> None:
        while self.tried < self.budget:
            before = _key(self.best)
            self._delete()
            self._lower()
            if _key(self.best) == before:
                return

    def _delete(self) -> None:
        for k in (8, 4, 2, 1):
            i = len(self.best) - k
            while i >= 0 and self.tried < self.budget:
                values = [n.value for n in self.best]
                self.fails(values[:i] + values[i + k:])
                i -= 1
                i = min(i, len(self.best) - k)

    def _lower(self) -> None:
        from hypothesis.internal.conjecture.choice import (
            ChoiceTooLarge,
            choice_from_index,
            choice_to_index,
        )

        i = 0
        while i < len(self.best) and self.tried < self.budget:
            node = self.best[i]
            if node.was_forced:
                i += 1
                continue
            hi = choice_to_index(node.value, node.constraints)
            lo = -1  # the largest index known not to fail (none yet)
            # the few simplest values first (for floats: 0, 1, 2, ...; the
            # order of indices is not the order of values), then a binary search
            firsts = [0, 1, 2, 3]
            for _ in range(_STEPS_PER_CHOICE):
                if hi - lo <= 1 or self.tried >= self.budget:
                    break
                firsts = [f for f in firsts if lo < f < hi]
                mid = firsts.pop(0) if firsts else (lo + hi) // 2
                try:
                    value = choice_from_index(mid, node.type, node.constraints)
                except ChoiceTooLarge:
                    break
                values = [n.value for n in self.best]
                values[i] = value
                if self.fails(values):
                    if i >= len(self.best) or self.best[i].type != node.type:
                        break  # the case changed shape: the next pass looks again
                    node = self.best[i]
                    hi = choice_to_index(node.value, node.constraints)
                else:
                    lo = mid
            i += 1


def run_drawn(example: Callable[[Any], None], max_examples: int, base_seed: int,
              max_shrinks: int = MAX_SHRINKS,
              error: type[AssertionError] = RuleCounterexample) -> None:
    """Run ``example(data)`` on ``max_examples`` cases drawn from seeds; shrink
    the first failing one; raise ``error`` with the lowest failing rank's
    message for the smallest case, on every rank."""
    from hypothesis.internal.conjecture.data import ConjectureData

    for i in range(max_examples):
        cd = ConjectureData(random=random.Random(base_seed + i))
        valid, err = _attempt(example, cd)
        if not agree_failed(err is not None) or not valid:
            continue
        shrinker = _Shrinker(example, cd.nodes, err, max_shrinks)
        shrinker.run()
        msg = first_message(shrinker.err)
        done = ("budget spent" if shrinker.tried >= max_shrinks else "no smaller case fails")
        raise error(
            f"{msg}\n(case {i + 1} of {max_examples}, drawn from seeds in a simulated "
            f"world and shrunk there: {shrinker.tried} smaller candidates tried, {done})")
