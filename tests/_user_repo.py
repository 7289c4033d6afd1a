"""Commands run in a user's repository: a temporary folder outside this one,
with the project installed in this venv and nothing of this repository's
configuration (the ``user_repo`` fixture in ``tests/conftest.py`` makes one).
Importable by name: ``tests/`` is on ``sys.path`` while its tests run.

Example:
    >>> p = run_in(user_repo, "-m", "pytest", "-q", "test_x.py")
    >>> p.returncode, p.stdout  # output and errors merged
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# What this run's own pytest, test service or world set in the environment:
# a child run starts as from a user's shell, not from inside this run.
_OURS = ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")
_OURS_PREFIX = ("PYTEST_", "LAUNCH_")


def user_env(repo: Path, **extra: str) -> dict[str, str]:
    """This process's environment as a user's shell would have it, one
    OpenMP thread a process (many ranks share 2 cores), ``STAMPS_DIR=repo``."""
    env = {k: v for k, v in os.environ.items()
           if k not in _OURS and not k.startswith(_OURS_PREFIX)}
    env.update(OMP_NUM_THREADS="1", STAMPS_DIR=str(repo), **extra)
    return env


def processes_in(folder: Path, wait: float = 10.0) -> list[str]:
    """Live processes whose working directory is ``folder`` (the run's own:
    torchrun, its ranks, worlds), after waiting up to ``wait`` s for them to go."""
    end = time.monotonic() + wait
    while True:
        found = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                state = (d / "stat").read_text().split(") ", 1)[1][0]
                if Path(os.readlink(d / "cwd")) == folder.resolve() and state not in "ZX":
                    found.append(f"{d.name}: {(d / 'cmdline').read_bytes()[:200]!r}")
            except (OSError, IndexError):
                continue
        if not found or time.monotonic() > end:
            return found
        time.sleep(0.2)


def run_in(repo: Path, *args: str, timeout: float = 300, env: dict | None = None,
           stop_when: str | None = None, stop: int = signal.SIGTERM,
           to_group: bool = False, after_stop: float | None = None,
           ) -> subprocess.CompletedProcess:
    """``python *args`` in ``repo`` with :func:`user_env` (``env`` added),
    output merged; fails when it leaves a process behind in ``repo``.

    ``stop_when``: once that file exists in ``repo`` (or the command ends, or
    ``timeout`` passes) send ``stop`` to the command, or with ``to_group`` to
    its whole process group as a terminal's ^C (``SIGINT``) does; then wait
    ``after_stop`` s at most for it to end.
    """
    proc = subprocess.Popen([sys.executable, *args], cwd=repo,
                            env=user_env(repo, **(env or {})), text=True,
                            start_new_session=to_group,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if stop_when is not None:
        end = time.monotonic() + timeout
        while not (repo / stop_when).exists() and proc.poll() is None \
                and time.monotonic() < end:
            time.sleep(0.1)
        if to_group:
            with contextlib.suppress(ProcessLookupError):  # the group has ended
                os.killpg(proc.pid, stop)
        else:
            proc.send_signal(stop)
    try:
        out, _ = proc.communicate(timeout=timeout if after_stop is None else after_stop)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"{args} did not end in time\n{out}") from None
    assert not processes_in(repo), f"processes left behind\n{out}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")
