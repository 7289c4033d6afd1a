"""Debug helpers: count the collectives the runtime issues.

Example:
    >>> with CommCounter() as c:
    ...     y = x.redistribute(mesh, [Replicate()])
    >>> c.counts
    {'all_gather': 1}
    >>> c.total
    1
"""

from __future__ import annotations

from collections import Counter

from dtensor import _comm

__all__ = ["CommCounter"]


class CommCounter:
    """Counts collectives by kind (``all_gather``, ``all_reduce``, ``broadcast``)."""

    def __init__(self) -> None:
        self._counter: Counter = Counter()

    def __enter__(self) -> CommCounter:
        _comm.push_counter(self._counter)
        return self

    def __exit__(self, *exc) -> None:
        _comm.pop_counter(self._counter)

    @property
    def counts(self) -> dict[str, int]:
        return dict(self._counter)

    @property
    def total(self) -> int:
        return sum(self._counter.values())

    def __getitem__(self, kind: str) -> int:
        return self._counter[kind]
