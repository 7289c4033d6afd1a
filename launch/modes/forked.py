"""Starting a parent's world by forking the parent itself.

A world launched through ``torch.distributed.run`` costs torchrun's own start
and, per rank, a fresh interpreter that imports torch, pytest and the test
files and collects them again: seconds per rank, and on a machine with fewer
cores than ranks they queue. The parent has done all of that already, so
``start`` forks it once per rank: each child is a rank in server mode
(``launch.modes.server``) over the parent's own collected items, and joins a
process group whose rendezvous is the parent's store (under the world's
prefix). The ranks are the parent's children (``launch.rank.procs.ForkedRanks``
watches them as torchrun would: one dies, the others are stopped).

A child starts with the parent's pytest state as it was: it takes a capture,
fixture state and terminal of its own, drops what writes to the parent's
channels (junit, the xdist worker's reports), and the plugin picks its mode
again from the rank's environment (server mode; the items of PyTorch's
process bases see it when they set up). What the parent's earlier tests
left in the process (module globals) is inherited, as a rank running all
tests under torchrun would have it.

It runs only with ``LAUNCH_START=fork``; ``fork_refused`` says when it does
not (no ``os.fork``, a host with CUDA, the variable unset); the parent then
launches torchrun as before.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

START_ENV = "LAUNCH_START"  # "fork": fork the parent; anything else: torchrun


def fork_refused(config: pytest.Config) -> str | None:
    """Why this parent must launch its worlds through torchrun, or None.

    Forking is opt-in (``LAUNCH_START=fork``): the parent has threads (the
    store's, earlier worlds' clients), and a child forked while one of them
    holds a libc lock waits on it forever; seen as a rank stuck in glibc's
    resolver lock inside ``TCPStore``'s connect, its world never started."""
    if os.environ.get(START_ENV, "torchrun") != "fork":
        return f"{START_ENV} is not 'fork'"
    if not hasattr(os, "fork") or sys.platform != "linux":
        return "no os.fork here"
    torch = sys.modules.get("torch")
    # NOTE: not only an initialised CUDA: torch.cuda.device_count() and
    # is_available() (the cuda marker's check) already poison fork for CUDA.
    if torch is not None and torch.version.cuda is not None and torch.cuda.is_available():
        return "a CUDA host (a forked child cannot use CUDA)"
    return None


def start(session: pytest.Session, n: int, prefix: str, port: int, env: dict[str, str],
          log_dir: Path, world_log: Path) -> Any:
    """Fork ``n`` ranks of a world under ``prefix`` of the store at ``port``;
    returns their ``ForkedRanks`` (a ``Popen``-like handle)."""
    from launch.rank.procs import ForkedRanks

    for s in (sys.stdout, sys.stderr):
        s.flush()
    pids = []
    for r in range(n):
        pid = os.fork()
        if pid == 0:  # the rank: never returns into the parent's code
            code = 1
            try:
                code = _rank(session, r, n, prefix, port, env, log_dir)
            except BaseException:
                traceback.print_exc()
            finally:
                for s in (sys.stdout, sys.stderr):
                    try:
                        s.flush()
                    except Exception:
                        pass
                os._exit(code)
        pids.append(pid)
    return ForkedRanks(pids, world_log)


def _rank(session: pytest.Session, r: int, n: int, prefix: str, port: int,
          env: dict[str, str], log_dir: Path) -> int:
    config = session.config
    # Output from the first moment to where torchrun's --redirects would put it
    # (the parent quotes it when the rank dies).
    std = log_dir / f"{prefix}-std" / "forked" / "attempt_0" / str(r) / "stderr.log"
    std.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(std, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for k in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        os.environ.pop(k, None)
    os.environ.update(env)
    os.environ.update({"RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0",
                       "ROLE_RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
                       "ROLE_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    _own_pytest_state(session)
    _join(config, prefix, port, r, n)
    # The plugin picks this process's mode again, now from the rank's environment,
    # as in a rank torchrun started: server mode (looked up, not imported: the
    # plugin layer sits above the modes).
    pm = config.pluginmanager
    plugin = pm.get_plugin("launch.plugin")
    os.environ.pop(plugin.RANK_PID_ENV, None)  # this process is a rank, never nested
    pm.unregister(name="launch-mode")
    plugin.pytest_configure(config)
    server = pm.get_plugin("launch-mode")
    server.pytest_sessionstart(session)
    server.pytest_collection_finish(session)
    server.pytest_runtestloop(session)
    server.pytest_sessionfinish(session)
    return 0


def _join(config: pytest.Config, prefix: str, port: int, r: int, n: int) -> None:
    """The default group of this world, its rendezvous under the world's
    prefix of the parent's store (``init_process_group`` then finds it made)."""
    import torch
    import torch.distributed as dist

    # NOTE: a child forked after the parent used the OpenMP pool deadlocks on
    # its first parallel op unless it keeps to one thread.
    torch.set_num_threads(1)
    backend = config.getoption("dist_backend")
    if backend is None:
        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= n
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(r)
    raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(minutes=30))
    dist.init_process_group(backend, store=dist.PrefixStore(f"{prefix}/pg/", raw), rank=r,
                            world_size=n)


def _own_pytest_state(session: pytest.Session) -> None:
    """Detach the child from the parent's capture files, fixture values and
    report channels (the two processes share their file descriptions)."""
    from _pytest.runner import SetupState

    config = session.config
    pm = config.pluginmanager
    capman = pm.get_plugin("capturemanager")
    if capman is not None:
        # NOTE: never read or stop the inherited capture: its temporary files'
        # offsets are the parent's too. Drop it and capture into new files.
        capman._global_capturing = None
        capman.start_global_capturing()
        capman.suspend_global_capture()
    for plugin in list(pm.get_plugins()):
        # NOTE: xdist runs its worker module as execnet's __channelexec__, so the
        # class is known by name only; its reports would go down the channel.
        if type(plugin).__name__ == "WorkerInteractor":
            pm.unregister(plugin)
    # Fixtures the parent set up stay the parent's: the child starts with none.
    session._setupstate = SetupState()
    for item in session.items:
        info = getattr(item, "_fixtureinfo", None)
        for defs in (info.name2fixturedefs.values() if info is not None else ()):
            for d in defs:
                d.cached_result = None
                d._finalizers.clear()
