"""What every mode shares: the ``World`` a test sees, the markers and the
environment keys that tie a parent pytest to the worlds it launches.

A leaf module (pytest only): the plugin and all three modes import it, it
imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import pytest

SERVER_ENV = "LAUNCH_SERVER"  # host:port of the parent's store (server mode)
PREFIX_ENV = "LAUNCH_PREFIX"  # the world's key prefix in that store
LOG_ENV = "LAUNCH_LOG_DIR"  # where server ranks write their logs
TIMEOUT_KEY = pytest.StashKey[float]()  # an item's watchdog seconds, set at collection

MARKERS = (
    "world_size(n): run this test on a world of n ranks (a sub-world under a larger world)",
    "dist_timeout(seconds): hang watchdog for this distributed test, on every rank at once",
    "cuda: needs a CUDA device per rank; skipped with a reason where there is none",
)


@dataclass(frozen=True)
class World:
    """What a test sees of its world.

    Args:
        rank: this process's rank in the test's world (0 in a single process).
        size: the test's world size (its ``world_size`` marker, else the world).
        ranks: the test's ranks, ``tuple(range(size))``.
        group: the test's whole world: ``dist.group.WORLD`` while the test
            runs (a sub-world's own default group under a larger world);
            ``None`` without a process group.

    Example::

        @pytest.mark.world_size(2)
        def test_sum(world):
            t = torch.ones(1)
            dist.all_reduce(t)                  # the 2-rank world, whatever N
            assert t.item() == world.size == dist.get_world_size()
    """

    rank: int
    size: int
    ranks: tuple[int, ...]
    group: Any


@runtime_checkable
class Mode(Protocol):
    """What the plugin asks of the mode object it registers as ``launch-mode``
    (one per session: lockstep, server, parent or simulated).

    ``name`` is the mode's name (``"lockstep"``, ``"server"``, ``"parent"``,
    ``"simulated"``), for messages and for plugins that work in some modes
    only. ``ranks_here`` says whether this process is itself a rank that runs
    every collected test (lockstep, server): then every item is distributed
    (its timeout belongs to the watchdog) and CUDA is checked per local rank.
    ``store`` is a c10d store every rank process of the session reaches
    (None where the ranks are threads of this process, or none is here).
    ``world_for(n)`` is the ``world`` fixture's value for a test of
    ``world_size(n)`` (None: unmarked) in this process. ``run(item, n)`` runs
    one item's setup, call and teardown on a world of ``n`` ranks (None: the
    item's own ``world_size``, else the whole world), agreed as the mode
    agrees, and returns this process's reports without logging them; the
    item's own fixtures are torn down, module and session ones stay up. Where
    ranks are processes, every rank makes the same calls in the same order.

    Example (a plugin that runs an item once more, in any mode)::

        mode = launch.plugin.mode_of(config)
        reports = mode.run(item, world_size_of(item))
        failed = [r for r in reports if r.failed]
    """

    name: str
    ranks_here: bool
    store: Any

    def world_for(self, n: int | None) -> World: ...

    def run(self, item: pytest.Item, n: int | None) -> list[pytest.TestReport]: ...


LOCAL_WORLD = World(0, 1, (0,), None)  # the ``world`` of a test in one plain process


def world_size_of(item: pytest.Item) -> int | None:
    """The ``world_size`` marker's n, or None for an unmarked test."""
    m = item.get_closest_marker("world_size")
    if m is None:
        return None
    n = m.args[0] if m.args else m.kwargs.get("n")
    if not isinstance(n, int) or n < 1:
        raise pytest.UsageError(
            f"{item.nodeid}: world_size marker needs a positive int, got {n!r}; "
            "write @pytest.mark.world_size(2)")
    return n


def marked_timeout(item: pytest.Item) -> float | None:
    """Seconds from ``dist_timeout(s)``, else from the legacy ``timeout(s)``
    (pytest-timeout's marker name; still read, see ``docs/test-service.md``)."""
    for name in ("dist_timeout", "timeout"):
        m = item.get_closest_marker(name)
        if m is not None:
            value = m.args[0] if m.args else m.kwargs.get("seconds", m.kwargs.get("timeout"))
            if value is None:
                continue
            return float(value)
    return None


def timeout_of(item: pytest.Item, default: float) -> float:
    """The watchdog seconds of ``item`` (fixed at collection), else ``default``."""
    t = item.stash.get(TIMEOUT_KEY, None)
    if t is None:
        t = marked_timeout(item)
    return default if t is None or t <= 0 else t


def claim_timeouts(config: pytest.Config, items: list[pytest.Item], distributed: Any) -> None:
    """Fix each distributed item's watchdog seconds, and keep pytest-timeout
    off those items: its timer fires on one rank only (mid-collective, the
    others then hang), while our watchdog stops every rank of the test together.
    ``distributed(item)`` says whether an item runs on several ranks here."""
    other = config.pluginmanager.has_plugin("timeout")
    for item in items:
        if not distributed(item):
            continue
        t = marked_timeout(item)
        if t is not None and t > 0:
            item.stash[TIMEOUT_KEY] = t
        elif other and config.getoption("timeout", None):
            item.stash[TIMEOUT_KEY] = float(config.getoption("timeout"))
        if other:
            # NOTE: pytest-timeout reads the closest `timeout` marker; 0 turns it off.
            item.add_marker(pytest.mark.timeout(0), append=False)
