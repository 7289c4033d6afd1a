"""Ending a launched world completely: torchrun and every rank process of it;
``ForkedRanks``, the handle of a world whose ranks the parent forked.

torchrun starts each rank in a session of its own (``start_new_session``), so
killing torchrun does not end its ranks: a rank wedged in C++ or still
importing outlives it and keeps CPU, ports and store connections while the
next world starts beside it. The parent therefore finds a world's processes
itself, by the tag it gave them (``LAUNCH_WORLD_ID=<run id>/<prefix>`` in their
environment, unique per parent and world), and kills what is left once
torchrun is gone. Linux ``/proc`` only; elsewhere it ends torchrun alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

WORLD_ID_ENV = "LAUNCH_WORLD_ID"  # set by the parent on torchrun and so on every rank


def world_pids(world_id: str) -> list[int]:
    """Live processes whose environment carries ``LAUNCH_WORLD_ID=world_id``."""
    tag = f"{WORLD_ID_ENV}={world_id}".encode()
    found = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for d in proc.iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if tag in (d / "environ").read_bytes().split(b"\0") and _alive(d):
                found.append(int(d.name))
        except OSError:
            continue
    return found


def _alive(d: Path) -> bool:
    try:
        return (d / "stat").read_text().split(") ", 1)[1][0] not in "ZX"
    except (OSError, IndexError):
        return False


def end_world(proc: subprocess.Popen, world_id: str, grace: float) -> list[int]:
    """Stop torchrun the way it expects (SIGTERM: it stops its ranks), wait up
    to ``grace`` s, kill it if needed, then SIGKILL any rank process of the
    world still alive and wait for them to go. Returns the pids killed so."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    killed = world_pids(world_id)
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    left, end = killed, time.monotonic() + 10
    while left and time.monotonic() < end:
        left = [p for p in left if _alive(Path(f"/proc/{p}"))]
        time.sleep(0.05)
    return killed


class ForkedRanks:
    """The rank processes of a world forked by the parent
    (``launch.modes.forked``), behind the part of ``subprocess.Popen`` the
    parent uses for torchrun: ``poll``, ``wait``, ``terminate``, ``kill``,
    ``returncode``. As torchrun does, once one rank exits with a non-zero code
    the others get SIGTERM (each dumps its stacks to its log), and SIGKILL
    ``grace`` seconds later; the world's code is the first non-zero one, else
    0. Each rank's exit is written to ``log``."""

    def __init__(self, pids: list[int], log: Path, grace: float = 5.0) -> None:
        import threading

        self.pids = list(pids)
        self.args = f"forked ranks {self.pids}"
        self.codes: dict[int, int] = {}
        self.returncode: int | None = None
        self.log, self.grace = log, grace
        self._failed_at: float | None = None
        self._first_bad: int | None = None  # the first non-zero code, in exit order
        self._lock = threading.Lock()
        with open(log, "a") as f:
            f.write(f"launch: forked {len(pids)} ranks: pids {self.pids}\n")

    def _live(self) -> list[int]:
        return [p for p in self.pids if p not in self.codes]

    def _reap(self) -> None:
        for r, pid in enumerate(self.pids):
            if pid in self.codes:
                continue
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its code is lost
                got, status = pid, 0
            if got == 0:
                continue
            code = os.waitstatus_to_exitcode(status)
            self.codes[pid] = code
            with open(self.log, "a") as f:
                f.write(f"launch: rank {r} (pid {pid}) exited with code {code}\n")
            if code != 0 and self._failed_at is None:
                self._failed_at = time.monotonic()
                self._first_bad = code
                self._signal(signal.SIGTERM)
        if self._failed_at is not None and time.monotonic() > self._failed_at + self.grace:
            self._signal(signal.SIGKILL)
        if not self._live():
            self.returncode = self._first_bad or 0

    def _signal(self, sig: int) -> None:
        for pid in self._live():
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                self._reap()
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def terminate(self) -> None:
        with self._lock:
            self._signal(signal.SIGTERM)

    def kill(self) -> None:
        with self._lock:
            self._signal(signal.SIGKILL)
