"""The pytest plugin: options, markers, the ``world`` fixture.

Installed as a ``pytest11`` entry point (named ``launch.plugin``), so any
repository gets it with ``pip install``; ``-p launch.plugin`` or
``pytest_plugins = ["launch.plugin"]`` load it from a checkout (no double
registration: pytest skips a plugin already known under that name).

It stays cheap to import: ``torch`` and ``torch.distributed`` are imported
inside hooks only. The work is done by one of three mode objects, picked in
``pytest_configure``:

- lockstep (``launch.modes.lockstep``): this process is a rank started by torchrun;
  every rank runs the same tests and agrees on each outcome.
- server (``launch.modes.server``): this process is a rank of a world that a parent
  pytest launched; it runs the tests the parent sends.
- parent (``launch.modes.parent``): plain ``pytest``; ``world_size``-marked tests run
  in worlds launched through ``torch.distributed.run``, one per world size.

The modes share ``launch.world`` (the ``World`` value, markers, env keys);
none of them imports this module.
"""

from __future__ import annotations

import os

import pytest

from launch.world import (
    LOCAL_WORLD,
    MARKERS,
    SERVER_ENV,
    Mode,
    World,
    claim_timeouts,
    timeout_of,
    world_size_of,
)

RANK_PID_ENV = "LAUNCH_RANK_PID"  # set by a rank process: its pid

__all__ = ["SERVER_ENV", "Mode", "World", "mode_of", "timeout_of", "world_size",
           "world_size_of"]

# Loaded with the service wherever it is (entry point, -p, conftest):
# seeded order, and lockstep Hypothesis for every @given run inside a world
# (without it, ranks draw different examples and desync); classes of
# PyTorch's distributed test bases run on the service's worlds (torchbases).
pytest_plugins = ["launch.shuffle", "launch.hypo.lockstep", "launch.torchbases.hooks"]


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("launch", "distributed test service (launch)")
    g.addoption("--dist-backend", default=None,
                help="process group backend (default: nccl with a GPU per local rank, else gloo)")
    g.addoption("--dist-timeout", type=float, default=120.0,
                help="per-test hang watchdog in seconds (marker dist_timeout(s) overrides)")
    g.addoption("--dist-seed", type=int, default=0,
                help="seed set on every rank before every distributed test")
    g.addoption("--dist-log-dir", default=None,
                help="folder for per-rank logs (default: <rootdir>/.launch-logs)")
    g.addoption("--dist-start-after", default=None, metavar="NODEID",
                help="deselect the collected tests up to and including NODEID "
                     "(resumes a run that a hang or a dead rank stopped)")
    from launch.modes.simulated import add_options  # --dist-sim: simulated worlds

    add_options(parser)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from launch import hookspecs

    hookspecs.register(pluginmanager)


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    if not config.pluginmanager.has_plugin("timeout"):
        config.addinivalue_line(
            "markers", "timeout(seconds): deprecated alias of dist_timeout(seconds)")
    # NOTE: a pytest run inside a rank (pytester, in process or as a child)
    # inherits the torchrun env but is not a rank: it must not join the
    # world (nor, ending, os._exit the rank). It is a plain parent instead.
    owner = os.environ.get(RANK_PID_ENV)
    nested = owner is not None and owner in (str(os.getpid()), str(os.getppid()))
    mode: Mode
    if os.environ.get(SERVER_ENV) and not nested:
        from launch.modes.server import Server

        mode = Server(config)
        os.environ[RANK_PID_ENV] = str(os.getpid())
    elif _under_torchrun() and not nested:
        if config.getoption("dist_sim", False):
            raise pytest.UsageError("--dist-sim runs simulated worlds inside one process; "
                                    "run it under plain pytest, not torchrun")
        from launch.modes.lockstep import Lockstep

        mode = Lockstep(config)
        os.environ[RANK_PID_ENV] = str(os.getpid())
    else:
        if _is_xdist_controller(config):
            if config.getoption("dist_sim", False):
                from launch.modes.simulated import SimTally

                config.pluginmanager.register(SimTally(), "launch-sim-tally")
            return
        if config.getoption("dist_sim", False):
            from launch.modes.simulated import SimMode

            mode = SimMode(config)
        else:
            from launch.modes.parent import Parent

            mode = Parent(config)
    config.pluginmanager.register(mode, "launch-mode")
    if mode.name != "parent":  # a rank or a simulated world: same examples everywhere
        from launch.hypo.lockstep import pin_literal_pool

        pin_literal_pool()


def mode_of(config: pytest.Config) -> Mode | None:
    """The session's mode object (None in an xdist controller, which runs no tests)."""
    mode = config.pluginmanager.get_plugin("launch-mode")
    if mode is not None and not isinstance(mode, Mode):
        raise TypeError(f"launch-mode plugin {mode!r} does not implement launch.world.Mode")
    return mode


def _under_torchrun() -> bool:
    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env
                                            and "MASTER_ADDR" in env)


def _is_xdist_controller(config: pytest.Config) -> bool:
    # The xdist controller runs no tests; its workers each get a Parent.
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(
        config, "workerinput")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    after = config.getoption("dist_start_after")
    if after:
        ids = [i.nodeid for i in items]
        if after not in ids:
            raise pytest.UsageError(f"--dist-start-after: {after} was not collected; "
                                    "pass the test id the report printed, with the same paths")
        k = ids.index(after) + 1
        config.hook.pytest_deselected(items=items[:k])
        items[:] = items[k:]
    mode = mode_of(config)
    everywhere = mode is not None and mode.ranks_here
    claim_timeouts(config, items, lambda it: everywhere or world_size_of(it) is not None)
    if any(it.get_closest_marker("cuda") for it in items):
        why = _no_cuda_reason(everywhere)
        if why:
            for it in items:
                if it.get_closest_marker("cuda"):
                    it.add_marker(pytest.mark.skip(reason=why))


def _no_cuda_reason(ranks_here: bool) -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "needs CUDA (marked cuda): torch.cuda.is_available() is False on this host"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if ranks_here else 1
    have = torch.cuda.device_count()
    if have < local:
        return f"needs one CUDA device per local rank: {local} ranks here, {have} devices"
    return None


@pytest.fixture
def world(request: pytest.FixtureRequest) -> World:
    """This rank's view of the test's world (see ``launch.world.World``)."""
    mode = mode_of(request.config)
    n = world_size_of(request.node) if isinstance(request.node, pytest.Item) else None
    return LOCAL_WORLD if mode is None else mode.world_for(n)


def world_size(n: int) -> pytest.MarkDecorator:
    """``@world_size(2)`` is ``@pytest.mark.world_size(2)``."""
    return pytest.mark.world_size(n)
