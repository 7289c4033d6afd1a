"""Which property runs next, and for how many examples (pure; no I/O).

A fuzzing session runs in *slices*: one property, a few seconds of examples,
on every rank at once. Rank 0 asks the scheduler for the next slice and tells
the other ranks. The scheduler spends time where it still buys something:

- every property gets a first slice before any gets a second;
- a *floor*: no live property falls below ``floor`` of its fair share of the
  time spent so far (fair share = time / live properties);
- above the floor, the property with the best recent yield wins, where the
  yield is discoveries (new coverage arcs of the runtime plus new input
  classes) per second over its last ``window`` slices, with a prior of one
  discovery so a property that has run little is still tried;
- a property that failed, or that cannot run here, is done for the session
  (its minimal example is in the database; Hypothesis would replay it first
  and fail again at once).

The estimate follows HypoFuzz's idea (behaviours found per second of fuzzing
a target); the rule and code are ours.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["PropStats", "Scheduler", "Slice"]


@dataclass
class PropStats:
    """What one property has done so far (all sessions that share a state)."""

    nodeid: str
    examples: int = 0
    seconds: float = 0.0
    slices: int = 0
    discoveries: int = 0  # new arcs + new input classes, summed over slices
    failed: bool = False
    skipped: str = ""  # why it cannot run here ("" if it can)
    recent: list[list[float]] = field(default_factory=list)  # [examples, seconds, new]

    @property
    def live(self) -> bool:
        return not self.failed and not self.skipped

    def rate(self) -> float:
        """Examples per second so far (0 before the first slice)."""
        return self.examples / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Slice:
    nodeid: str
    examples: int
    why: str  # "first", "floor" or "yield"


class Scheduler:
    """Pick slices from properties' statistics.

    Args:
        nodeids: the properties, in collection order (the tie-break order).
        slice_seconds: the target length of a slice.
        floor: fraction of the fair share below which a property is starved.
        window: slices that make up a property's recent yield.
    """

    def __init__(self, nodeids: list[str], *, slice_seconds: float = 8.0,
                 floor: float = 0.25, window: int = 3, first_examples: int = 10,
                 min_examples: int = 5, max_examples: int = 1000) -> None:
        if not 0 <= floor <= 1:
            raise ValueError(f"floor must be in [0, 1]; got {floor}")
        self.props = {n: PropStats(n) for n in nodeids}
        self.order = list(nodeids)
        self.slice_seconds, self.floor, self.window = slice_seconds, floor, window
        self.first_examples = first_examples
        self.min_examples, self.max_examples = min_examples, max_examples

    # -- feedback ------------------------------------------------------------
    def record(self, nodeid: str, examples: int, seconds: float, new: int,
               failed: bool = False) -> None:
        """One slice of ``nodeid`` ran ``examples`` in ``seconds`` and found
        ``new`` discoveries (new arcs + new input classes)."""
        p = self.props[nodeid]
        p.examples += examples
        p.seconds += seconds
        p.slices += 1
        p.discoveries += new
        p.failed = p.failed or failed
        p.recent = [*p.recent, [examples, seconds, new]][-self.window:]

    def skip(self, nodeid: str, why: str) -> None:
        self.props[nodeid].skipped = why or "skipped"

    # -- decisions -----------------------------------------------------------
    def score(self, p: PropStats) -> float:
        """Recent discoveries per second, with a prior of one discovery."""
        new = sum(r[2] for r in p.recent)
        secs = sum(r[1] for r in p.recent)
        return (new + 1.0) / (secs + self.slice_seconds)

    def choose(self, remaining: float | None = None) -> Slice | None:
        """The next slice; None when no property is left to run."""
        live = [self.props[n] for n in self.order if self.props[n].live]
        if not live:
            return None
        fresh = [p for p in live if p.slices == 0]
        if fresh:
            return Slice(fresh[0].nodeid, self.first_examples, "first")
        spent = sum(p.seconds for p in live)
        fair = spent / len(live)
        starved = [p for p in live if p.seconds < self.floor * fair]
        if starved:
            p = min(starved, key=lambda q: (q.seconds / fair, self.order.index(q.nodeid)))
            return Slice(p.nodeid, self.examples_for(p, remaining), "floor")
        p = max(live, key=lambda q: (self.score(q), -q.seconds))
        return Slice(p.nodeid, self.examples_for(p, remaining), "yield")

    def examples_for(self, p: PropStats, remaining: float | None = None) -> int:
        """Examples that fill about one slice at the property's measured rate."""
        secs = self.slice_seconds if remaining is None else max(
            0.5, min(self.slice_seconds, remaining))
        n = round(p.rate() * secs) if p.rate() > 0 else self.first_examples
        return max(self.min_examples, min(self.max_examples, n))

    # -- persistence ---------------------------------------------------------
    def dump(self) -> list[dict[str, Any]]:
        return [asdict(self.props[n]) for n in self.order]

    def load(self, rows: list[dict[str, Any]]) -> None:
        """Continue from an earlier state: known properties keep their
        statistics; a property that failed before stays done. New properties
        start fresh, unknown rows are kept out."""
        for row in rows:
            if row.get("nodeid") in self.props:
                keep = {k: v for k, v in row.items() if k in PropStats.__dataclass_fields__}
                keep["skipped"] = ""  # re-judged in this world
                self.props[row["nodeid"]] = PropStats(**keep)
