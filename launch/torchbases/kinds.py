"""Which of PyTorch's distributed test bases a class derives from, the world
size it asks for, and what about it a persistent world cannot honour.

Classes are recognised by ``issubclass`` against the bases themselves,
imported only when the module that defines them is already loaded (a class
derived from a base has imported it): a repository that never imports
``torch.testing._internal`` pays nothing.
"""

from __future__ import annotations

import inspect
import sys
import unittest
from typing import Any

DIST_MODULE = "torch.testing._internal.common_distributed"
DTENSOR_MODULE = "torch.testing._internal.distributed._tensor.common_dtensor"

PROCS = "procs"  # one rank per process: runs on the ranks of a world
INPROC = "inproc"  # threads or LocalTensorMode in one process: runs once

_LOCAL_BASES = ("LocalDTensorTestBase", "LocalDTensorOpTestBase",
                "LocalDTensorContinuousTestBase")


def _bases() -> tuple[tuple[type, ...], tuple[type, ...], type | None]:
    """(process bases, in-process bases, MultiProcContinuousTest)."""
    cd = sys.modules.get(DIST_MODULE)
    if cd is None:
        return (), (), None
    procs = tuple(getattr(cd, n) for n in ("MultiProcessTestCase", "MultiProcContinuousTest")
                  if hasattr(cd, n))
    inproc: list[type] = [cd.MultiThreadedTestCase] if hasattr(cd, "MultiThreadedTestCase") else []
    dt = sys.modules.get(DTENSOR_MODULE)
    if dt is not None:
        inproc += [getattr(dt, n) for n in _LOCAL_BASES if hasattr(dt, n)]
    return procs, tuple(inproc), getattr(cd, "MultiProcContinuousTest", None)


def kind_of(cls: Any) -> str | None:
    """``PROCS``, ``INPROC`` or None (not derived from a distributed base).

    Example::

        class T(DTensorTestBase): ...
        kind_of(T)  # "procs"
    """
    if not isinstance(cls, type) or not issubclass(cls, unittest.TestCase):
        return None
    procs, inproc, _ = _bases()
    if inproc and issubclass(cls, inproc):
        return INPROC
    if procs and issubclass(cls, procs):
        return PROCS
    return None


def is_continuous(cls: type) -> bool:
    """Whether ``cls`` derives from ``MultiProcContinuousTest`` (one world per class)."""
    cont = _bases()[2]
    return cont is not None and issubclass(cls, cont)


def world_size_of_class(cls: type) -> int:
    """The class's ``world_size``, evaluated as its base's harness does.

    A property is read from an instance that skipped ``__init__`` (the base
    does the same for ``MultiProcContinuousTest``); ``-2`` (unset, continuous
    bases) means the device count of the class's device type. Raises
    ``unittest.SkipTest`` where the base would skip (no such devices)."""
    attr = inspect.getattr_static(cls, "world_size", None)
    if isinstance(attr, property):
        n = attr.fget(object.__new__(cls))
    else:
        n = getattr(cls, "world_size", None)
    if n == -2 and is_continuous(cls):
        import torch

        n = torch.get_device_module(_device_type(cls)).device_count()
        if n == 0:
            raise unittest.SkipTest(f"No {_device_type(cls)} devices available")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{cls.__qualname__}.world_size is {n!r}; expected a positive int "
                         "(a class attribute or a property, as the base reads it)")
    return n


def _device_type(cls: type) -> str:
    attr = inspect.getattr_static(cls, "device_type", None)
    if isinstance(attr, classmethod):
        return attr.__func__(cls)
    if isinstance(attr, property):
        return attr.fget(cls)
    if callable(attr):
        return attr()
    return str(attr) if attr is not None else "cpu"


# The parts of the bases' own harness that spawn, join and judge processes:
# a class that overrides one relies on processes the service does not spawn.
HARNESS = ("_spawn_processes", "_start_processes", "_join_processes",
           "_check_return_codes", "_get_timedout_process_traceback", "run_test", "_run",
           "join_or_run", "_worker_loop", "_run_test_given_id", "_worker_run_main_wait",
           "_ensure_processes_spawned")


def unhonoured(cls: type) -> str | None:
    """Why the methods of ``cls`` cannot run on a persistent world, or None.

    A class (or a base of it outside ``torch.testing``) that overrides a part
    of the bases' harness, say ``_check_return_codes`` to read every spawned
    process's exit code from ``self.processes``, has no such processes here.
    ``setUp`` calling ``self._spawn_processes()`` is the ordinary idiom, not
    an override."""
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch.testing."):
            break
        for name in HARNESS:
            if name in vars(klass):
                return (f"launch: {klass.__qualname__} overrides {name} of its base's "
                        "harness, which spawns and judges processes per test; the "
                        "service runs it on a persistent world with no such processes "
                        "(run it with -p no:launch.plugin)")
    return None


def timeout_override(name: str) -> float | None:
    """The base's per-test timeout for method ``name`` when the test module
    set one (``common_distributed.TIMEOUT_OVERRIDE``), else None."""
    cd = sys.modules.get(DIST_MODULE)
    table = getattr(cd, "TIMEOUT_OVERRIDE", None) or {}
    t = table.get(name)
    return float(t) if t else None


def skip_exit_codes() -> dict[int, str]:
    """The bases' skip exit codes (``TEST_SKIPS``): code -> message."""
    cd = sys.modules.get(DIST_MODULE)
    return {s.exit_code: s.message for s in getattr(cd, "TEST_SKIPS", {}).values()}
