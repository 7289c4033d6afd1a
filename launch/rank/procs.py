"""Ending a launched world completely: torchrun and every rank process of it.

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
