"""Timing helpers of the overhead benchmarks (``bench/overhead.py``): rounds
of calls timed side by side, instruction counts where perf events exist,
and the line that names the machine a table was measured on.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

# Statistic over rounds: the median (default), or the minimum (--stat min),
# which on a loaded machine estimates the cost of an undisturbed round.
_STAT: list[Callable[[list[float]], float]] = [statistics.median]


def _timeit(fn: Callable[[], object], number: int, repeat: int = 21) -> float:
    """Median µs per call over ``repeat`` rounds of ``number`` calls."""
    return _timeit_side_by_side({"fn": fn}, number, repeat)["fn"]


def _timeit_side_by_side(
    fns: dict[str, Callable[[], object]],
    number: int,
    repeat: int = 21,
    sync: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Median µs per call of each function, rounds interleaved.

    Every round times each function for ``number`` calls in turn, starting
    with a different one each round, so a burst of load from other processes
    on a shared machine hits all of them alike and the ratios stay meaningful.
    ``sync`` runs untimed before each timed block.
    """
    for fn in fns.values():
        for _ in range(max(10, number // 10)):
            fn()
    rounds: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for i in range(repeat):
        # Rotate who goes first (deterministic: every rank runs the same order).
        for name, fn in order[i % len(order):] + order[: i % len(order)]:
            if sync is not None:
                sync()  # e.g. a barrier: no rank's lag is charged to the next function
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            rounds[name].append((time.perf_counter() - t0) / number * 1e6)
    return {name: _STAT[0](r) for name, r in rounds.items()}


_COUNTER_OK: list[bool] = []


def _instructions(fn: Callable[[], object]) -> int | None:
    """Instructions for one call, or None where perf events are unavailable."""
    ic = torch._C._instruction_counter
    if not _COUNTER_OK:
        probe = ic.start()  # prints one complaint where unsupported
        _COUNTER_OK.append(probe != -1)
        if probe != -1:
            ic.end(probe)
    if not _COUNTER_OK[0]:
        return None
    fn()
    start = ic.start()
    fn()
    return ic.end(start)


def _stat_name() -> str:
    return "min-of-rounds" if _STAT[0] is min else "median"


def _machine() -> str:
    import platform

    return (
        f"{platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )
