"""The pytest plugin: options, markers, the ``world`` fixture.

It stays cheap to import: ``torch`` and ``torch.distributed`` are imported
inside hooks only. The work is done by one of three mode objects, picked in
``pytest_configure``:

- lockstep (``launch.lockstep``): this process is a rank started by torchrun;
  every rank runs the same tests and agrees on each outcome.
- server (``launch.server``): this process is a rank of a world that a parent
  pytest launched; it runs the tests the parent sends.
- parent (``launch.parent``): plain ``pytest``; ``world_size``-marked tests run
  in worlds launched through ``torch.distributed.run``, one per world size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest

SERVER_ENV = "LAUNCH_SERVER"  # host:port:prefix of the parent's store


@dataclass(frozen=True)
class World:
    """What a test sees of its world.

    Args:
        rank: this process's rank in the world (0 in a single process).
        size: the test's world size (its ``world_size`` marker, else the world).
        ranks: the global ranks running the test, ``tuple(range(size))``.
        group: a process group of exactly ``ranks``; ``dist.group.WORLD`` when
            they are the whole world; ``None`` without a process group.

    Example::

        @pytest.mark.world_size(2)
        def test_sum(world):
            t = torch.ones(1)
            dist.all_reduce(t, group=world.group)
            assert t.item() == world.size
    """

    rank: int
    size: int
    ranks: tuple[int, ...]
    group: Any


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("launch", "distributed test service (launch)")
    g.addoption("--dist-backend", default=None,
                help="process group backend (default: nccl with enough GPUs, else gloo)")
    g.addoption("--dist-timeout", type=float, default=120.0,
                help="per-test hang watchdog in seconds (marker timeout(s) overrides)")
    g.addoption("--dist-seed", type=int, default=0,
                help="seed set on every rank before every distributed test")
    g.addoption("--dist-log-dir", default=None,
                help="folder for per-rank logs (default: <rootdir>/.launch-logs)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "world_size(n): run this test on a world of n ranks")
    config.addinivalue_line(
        "markers", "timeout(seconds): per-test hang watchdog for distributed tests")
    if os.environ.get(SERVER_ENV):
        from launch.server import Server

        mode: object = Server(config)
    elif _under_torchrun():
        from launch.lockstep import Lockstep

        mode = Lockstep(config)
    else:
        if _is_xdist_controller(config):
            return
        from launch.parent import Parent

        mode = Parent(config)
    config.pluginmanager.register(mode, "launch-mode")


def _under_torchrun() -> bool:
    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env
                                            and "MASTER_ADDR" in env)


def _is_xdist_controller(config: pytest.Config) -> bool:
    # The xdist controller runs no tests; its workers each get a Parent.
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(
        config, "workerinput")


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


def timeout_of(item: pytest.Item, default: float) -> float:
    """The ``timeout`` marker's seconds, else ``default``."""
    m = item.get_closest_marker("timeout")
    if m is None:
        return default
    return float(m.args[0] if m.args else m.kwargs["seconds"])


@pytest.fixture
def world(request: pytest.FixtureRequest) -> World:
    """This rank's view of the test's world (see ``World``)."""
    mode = request.config.pluginmanager.get_plugin("launch-mode")
    n = world_size_of(request.node) if isinstance(request.node, pytest.Item) else None
    if mode is None or not hasattr(mode, "world_for"):
        return World(0, 1, (0,), None)
    return mode.world_for(n)
