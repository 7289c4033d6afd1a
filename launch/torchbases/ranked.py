"""A test class of a process base, made into one rank of the running world.

The bases' own harness spawns a world per test (``MultiProcessTestCase``)
or per class (``MultiProcContinuousTest``) and runs each method in the
spawned processes. Here the process already is a rank of a persistent world,
so ``ranked(cls)`` is a subclass that skips the spawning and answers as that
rank: ``rank`` is the rank in the test's world, ``file_name`` one path that
every rank of the test shares, ``pg`` the world's group. While a method runs,
``pg_bound_to_world()`` makes ``init_process_group`` a no-op that checks it
matches the running world and ``destroy_process_group`` of the default group
a no-op (the world outlives the test), so ``init_pg`` / ``destroy_pg`` /
``@with_comms`` bind to the world. ``exit_mapped`` turns a ``sys.exit`` in a
rank into the outcome the base's harness gives that exit code.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import tempfile
import unittest
from collections.abc import Callable, Iterator
from typing import Any

from launch.torchbases.kinds import is_continuous, skip_exit_codes

_RANKED: dict[type, type] = {}
_FILE_ENV = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "LAUNCH_PREFIX",
             "LAUNCH_WORLD_ID")


def shared_file_name(nodeid: str) -> str:
    """A path that every rank of this test computes alike (the world's
    rendezvous and the test id), and no other test or world uses."""
    import torch.distributed as dist

    world = "|".join(os.environ.get(k, "") for k in _FILE_ENV)
    key = f"{world}|{dist.get_world_size()}|{nodeid}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return os.path.join(tempfile.gettempdir(), f"launch-torchbase-{digest}")


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _world_rank(self: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _ignore(self: Any, value: Any) -> None:
    # NOTE: the base's setUp assigns MAIN_PROCESS_RANK (-1) and a temporary
    # file of its own; the rank's values stay. The base's file is removed.
    if isinstance(value, str) and value != getattr(self, "_launch_file", value):
        with contextlib.suppress(OSError):
            os.remove(value)


def _file_name(self: Any) -> str:
    return self._launch_file


def _default_group(self: Any) -> Any:
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_group()


def _destroy_pg(self: Any, device_id: int | None = None) -> None:
    # NOTE: DTensorTestBase.destroy_pg waits in a barrier for every rank before
    # ending the group; a rank whose body raised skips it (``with_comms``), so
    # under a persistent world the others would wait there for good. The group
    # is the world and outlives the test: nothing to wait for.
    import torch.distributed as dist

    dist.destroy_process_group()  # a no-op on the world (pg_bound_to_world)


def _base_destroy_pg() -> Any:
    import sys

    from launch.torchbases.kinds import DTENSOR_MODULE

    base = getattr(sys.modules.get(DTENSOR_MODULE), "DTensorTestBase", None)
    return getattr(base, "destroy_pg", None)


def ranked(cls: type, world_size: int) -> type:
    """``cls`` as one rank of the running world (cached per class).

    Same name, module and qualified name, so ``self.id()`` and the test ids
    the base's tables use (``TIMEOUT_OVERRIDE``) are the original's."""
    sub = _RANKED.get(cls)
    if sub is not None:
        return sub
    ns: dict[str, Any] = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "rank": property(_world_rank, _ignore),
        "file_name": property(_file_name, _ignore),
        "join_or_run": lambda self, fn: fn,  # no join: this process is the rank
        "_worker_run_main_wait": lambda self, fn: fn,
        "_spawn_processes": staticmethod(_noop),
        "_start_processes": staticmethod(_noop),
    }
    base_destroy = _base_destroy_pg()
    if base_destroy is not None and getattr(cls, "destroy_pg", None) is base_destroy:
        ns["destroy_pg"] = _destroy_pg  # the class's own override is kept
    if is_continuous(cls):
        ns.update({
            "_ensure_processes_spawned": classmethod(_noop),
            "task_queues": [], "completion_queues": [], "processes": [],
            "poison_pill": False,  # one failure never skips the rest of the class
            "pg": property(_default_group),
        })
        if not isinstance(getattr(cls, "world_size", None), property):
            ns["world_size"] = world_size
    sub = _RANKED[cls] = type(cls.__name__, (cls,), ns)
    return sub


def _matches_world(backend: Any, world: str) -> bool:
    """Whether a requested backend string is served by the world's backend
    (``"gloo"``, ``"cpu:gloo,cuda:nccl"`` on a Gloo world, ...)."""
    if backend is None:
        return True
    text = str(backend).lower()
    if text in ("undefined", ""):
        return True
    return bool(_backend_names(text) & _backend_names(world.lower()))


def _backend_names(text: str) -> set[str]:
    """``"cpu:gloo,cuda:nccl"`` -> {"gloo", "nccl"}; ``"gloo"`` -> {"gloo"}."""
    return {part.rpartition(":")[2].strip() for part in text.split(",")}


@contextlib.contextmanager
def pg_bound_to_world() -> Iterator[None]:
    """While a method runs: joining the default group binds to the running
    world, destroying it leaves the world up; after it, the environment is
    the one it started with."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    orig_init, orig_destroy = c10d.init_process_group, c10d.destroy_process_group

    @functools.wraps(orig_init)
    def init(backend: Any = None, init_method: Any = None, timeout: Any = None,
             world_size: int = -1, rank: int = -1, store: Any = None,
             *args: Any, **kwargs: Any) -> None:
        if not c10d.is_initialized():
            return orig_init(backend, init_method, timeout, world_size, rank, store,
                             *args, **kwargs)
        have, me, world = dist.get_world_size(), dist.get_rank(), str(dist.get_backend())
        if world_size not in (-1, have) or rank not in (-1, me):
            raise unittest.SkipTest(
                f"launch: the test joins a process group of world_size={world_size}, "
                f"rank={rank}; the running world has {have} ranks and this is rank {me} "
                "(a test must use its class's world_size)")
        if not _matches_world(backend, world):
            raise unittest.SkipTest(
                f"launch: the test asks for backend {backend!r}; the running world "
                f"uses {world!r} (choose it with --dist-backend)")
        return None

    @functools.wraps(orig_destroy)
    def destroy(group: Any = None, *args: Any, **kwargs: Any) -> None:
        if group is None or group is c10d.GroupMember.WORLD or (
                c10d.is_initialized() and group is c10d._get_default_group()):
            return None  # the world outlives the test
        return orig_destroy(group, *args, **kwargs)

    saved = [(m, n, getattr(m, n)) for m in (c10d, dist)
             for n in ("init_process_group", "destroy_process_group")]
    env = dict(os.environ)  # a spawned rank's environment dies with it; this one stays
    for m, n, _ in saved:
        setattr(m, n, init if n == "init_process_group" else destroy)
    try:
        yield
    finally:
        for m, n, f in saved:
            setattr(m, n, f)
        if os.environ != env:
            os.environ.clear()
            os.environ.update(env)
        _forget_rng_tracker()


def _forget_rng_tracker() -> None:
    """PyTorch's DTensor keeps its RNG tracker in a module global; a spawned
    world starts every test without one, so does this one."""
    import sys

    rnd = sys.modules.get("torch.distributed.tensor._random")
    if rnd is not None and getattr(rnd, "_rng_tracker", None) is not None:
        rnd._rng_tracker = None


def _same_test(a: Any, b: Any) -> bool:
    def core(f: Any) -> Any:
        f = getattr(f, "__func__", f)
        while hasattr(f, "__wrapped__"):
            f = f.__wrapped__
        return f

    return core(a) is core(b)


def expected_exit(testcase: Any, method: Any) -> tuple[int | None, bool]:
    """(expected exit code or None for 0, whether any code is accepted),
    from the base's ``special_return_code_checks`` / ``skip_return_code_checks``."""
    for fn in getattr(testcase, "skip_return_code_checks", None) or ():
        if _same_test(fn, method):
            return None, True
    for fn, code in (getattr(testcase, "special_return_code_checks", None) or {}).items():
        if _same_test(fn, method):
            return int(code), False
    return None, False


def exit_mapped(testcase: Any, method: Callable[[], Any]) -> Callable[[], Any]:
    """``method`` with ``sys.exit(code)`` in this rank mapped as the base's
    harness maps a process's exit code: a ``TEST_SKIPS`` code is a skip with
    its message; the expected code (0, or the test's
    ``special_return_code_checks`` entry) passes; any other code fails. A
    test that expects death by a signal (a negative code) is skipped with the
    reason: here the rank is not a throwaway process."""

    @functools.wraps(method)
    def run() -> Any:
        want, anything = expected_exit(testcase, method)
        if want is not None and want < 0:
            raise unittest.SkipTest(
                f"launch: the test expects its rank to die by signal {-want}; the "
                "service's ranks are a persistent world (run it with -p no:launch.plugin)")
        try:
            return method()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            skips = skip_exit_codes()
            if code in skips and want != code:
                raise unittest.SkipTest(skips[code]) from None
            # NOTE: the base's harness compares rank 0's code only; the other
            # ranks pass with the expected code or a clean exit.
            if anything or code == (want or 0) or (testcase.rank != 0 and code in (0, want)):
                return None
            raise AssertionError(
                f"launch: rank {testcase.rank} exited with code {code}; the test "
                f"expects {want or 0}") from None

    return run
