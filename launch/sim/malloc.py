"""glibc malloc settings for a process whose threads are simulated ranks.

A simulated world runs each rank as a thread of one process, so what glibc's
malloc keeps per thread is paid once per rank: at 1,024 ranks a few tens of
KB per thread is tens of MB. Two settings take that back:

- one arena for every thread (``one_malloc_arena``), set at run time;
- no per-thread cache of freed small blocks (glibc's tcache). glibc reads
  that setting only when a process starts, from ``GLIBC_TUNABLES``, so
  ``--dist-sim`` puts it in the environment of the processes it starts
  (xdist workers, replays, fuzzing worlds: ``without_thread_caches``), and a
  process that started without it says so once it hosts a big world
  (``thread_cache_hint``).

At 1,024 ranks one ``assert_close`` on every rank left about 58 KB per rank
thread in those caches (the process's VmRSS before and after it), and the
scenario of ``bench/sim_scale.py --sizes 1024`` peaks at 0.48 GB without
them, 0.60 GB with them (``--glibc-tcache``; 2026-11-30, commit 13338b0).
Elsewhere than glibc nothing here does anything.

Example::

    >>> env = without_thread_caches({"GLIBC_TUNABLES": "glibc.malloc.mxfast=0"})
    >>> env["GLIBC_TUNABLES"]
    'glibc.malloc.mxfast=0:glibc.malloc.tcache_count=0'
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

__all__ = ["BIG_WORLD", "TUNABLE", "one_malloc_arena", "thread_cache_hint",
           "without_thread_caches"]

TUNABLE = "glibc.malloc.tcache_count=0"
BIG_WORLD = 256  # ranks from which the hint is worth a line


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name or "libc.so" not in name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 (glibc, not musl)
    except (OSError, AttributeError):
        return None
    return libc


def one_malloc_arena() -> None:
    """Let glibc's malloc keep one arena for the threads made after this
    (called as early as a simulated run is known, and again at a world's start).

    glibc gives threads arenas of their own (up to 8 per core), each holding
    freed memory apart; a world of 1,024 rank threads spread small blocks
    over all of them: 0.60 GB peak for ``bench/sim_scale.py`` at 1,024 ranks,
    0.55 GB with one arena and no slower (the GIL lets one thread run at a
    time, so they never wait on malloc's lock).
    """
    libc = _libc()
    if libc is not None:
        libc.mallopt(-8, 1)  # M_ARENA_MAX


def _sets_tcache(tunables: str) -> bool:
    return any(t.split("=", 1)[0] == "glibc.malloc.tcache_count" for t in tunables.split(":"))


def without_thread_caches(env: dict[str, str]) -> dict[str, str]:
    """``env`` with glibc's per-thread caches off, for a process about to
    start; a ``tcache_count`` the user chose is kept."""
    have = env.get("GLIBC_TUNABLES", "")
    if _sets_tcache(have):
        return dict(env)
    return {**env, "GLIBC_TUNABLES": f"{have}:{TUNABLE}" if have else TUNABLE}


@functools.cache
def _started_with_thread_caches() -> bool:
    if _libc() is None:
        return False
    try:  # the environment this process started with, not os.environ now
        with open("/proc/self/environ", "rb") as f:
            start = f.read().split(b"\0")
    except OSError:
        start = [f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')}".encode()]
    for entry in start:
        if entry.startswith(b"GLIBC_TUNABLES="):
            return not _sets_tcache(entry.split(b"=", 1)[1].decode(errors="replace"))
    return True


def thread_cache_hint(largest: int) -> str | None:
    """A line for the session summary when this process hosted a world of
    ``largest`` ranks with glibc's per-thread caches on, else None."""
    if largest < BIG_WORLD or not _started_with_thread_caches():
        return None
    return (f"launch: each of the {largest} rank threads keeps its own cache of freed "
            f"blocks (glibc's tcache, ~60 KB a rank); start pytest with "
            f"GLIBC_TUNABLES={TUNABLE} to give that memory back (-n workers get it "
            f"by themselves)")
