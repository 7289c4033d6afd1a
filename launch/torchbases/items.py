"""The pytest collector and item for classes of PyTorch's distributed bases.

A class of a process base becomes a ``TorchBaseClass`` whose methods are
``TorchBaseMethod`` items marked ``world_size(n)``, n the class's own
``world_size``: the service runs them on the ranks of a persistent world
like any world test (a sub-world under a larger torchrun world, a skip with
the reason under a smaller one). On a rank, the item's instance is the
``ranked`` class and the method runs with the process group bound to the
world. Classes of the in-process bases run once: in the process itself from
plain pytest, on rank 0 (a 1-rank sub-world, its verdict agreed) under
torchrun, with c10d holding a world of their own (``inproc``).
"""

from __future__ import annotations

import os
import unittest
from collections.abc import Iterable
from typing import Any

import pytest
from _pytest.unittest import TestCaseFunction, UnitTestCase

from launch.torchbases import kinds
from launch.world import SERVER_ENV, marked_timeout

OWN = "own"  # --dist-torch-bases own: the bases' own harness runs them


def where(config: pytest.Config) -> str:
    """How this process runs these classes: ``"rank"`` (it is a rank of a
    world: lockstep or server), ``"parent"`` (plain pytest / an xdist
    worker: worlds are launched), ``"own"`` (the bases' own harness: the
    option, a simulated-world session, or no service mode)."""
    from launch.plugin import mode_of

    if config.getoption("dist_torch_bases", None) == OWN:
        return OWN
    mode = mode_of(config)
    if mode is None or config.getoption("dist_sim", False):
        return OWN
    return "rank" if mode.ranks_here else "parent"


class TorchBaseClass(UnitTestCase):
    """A ``unittest`` class collector whose items run on the service's worlds."""

    kind: str = kinds.PROCS

    def collect(self) -> Iterable[pytest.Item | pytest.Collector]:
        cls = self.obj
        run = where(self.config)
        n: int | None = None
        skip: str | None = None
        if self.kind == kinds.PROCS and run != OWN:
            try:
                n = kinds.world_size_of_class(cls)
            except unittest.SkipTest as e:
                skip = f"launch: {cls.__qualname__}: {e}"
        for x in super().collect():
            if not isinstance(x, TestCaseFunction):
                yield x
                continue
            item = TorchBaseMethod.from_parent(self, name=x.name)
            item.setup_for(self.kind, run, n, skip)
            yield item


class TorchBaseMethod(TestCaseFunction):
    """One test method of a distributed base's class, as a service item."""

    kind: str = kinds.PROCS
    run_as: str = OWN
    n: int = 1

    def setup_for(self, kind: str, run_as: str, n: int | None, skip: str | None) -> None:
        """Mark this item for the way the session runs it (see the module)."""
        self.kind, self.run_as, self.n = kind, run_as, n or 1
        cls = self.parent.obj
        # pytest made the instance while building the item, before this
        # choice; make it again (a rank's is the ranked class)
        self.__dict__.pop("_obj", None)
        self.__dict__.pop("_instance", None)
        assert self.instance is not None
        if run_as == OWN:
            return
        if kind == kinds.INPROC:
            if run_as == "rank" and not os.environ.get(SERVER_ENV):
                # under torchrun every rank runs every test: once, on rank 0
                self.add_marker(pytest.mark.world_size(1))
            return
        if skip is not None:
            self.add_marker(pytest.mark.skip(reason=skip))
            return
        self.add_marker(pytest.mark.world_size(self.n))
        t = kinds.timeout_override(self.name)
        if t is not None and marked_timeout(self) is None:
            self.add_marker(pytest.mark.dist_timeout(t))
        why = kinds.unhonoured(cls)
        if why is not None:
            self.add_marker(pytest.mark.skip(reason=why))

    @property
    def on_rank(self) -> bool:
        """Whether this process runs the method as one rank of its world."""
        return self.kind == kinds.PROCS and self.run_as == "rank"

    @property
    def in_own_world(self) -> bool:
        """Whether c10d must hold the in-process tests' own world meanwhile."""
        return self.kind == kinds.INPROC and self.run_as == "rank"

    def setup(self) -> None:
        if self.run_as == "parent" and where(self.config) == "rank":
            # a rank forked from the parent that collected this item
            # (launch.modes.forked): the instance is made again, as the ranked class
            self.run_as = "rank"
            self.__dict__.pop("_obj", None)
            self.__dict__.pop("_instance", None)
        super().setup()

    def _getinstance(self) -> Any:
        if not self.on_rank:
            return super()._getinstance()
        from launch.torchbases.ranked import ranked, shared_file_name

        inst = ranked(self.parent.obj, self.n)(self.name)
        inst._launch_file = shared_file_name(self.nodeid)
        return inst

    def runtest(self) -> None:
        if not self.on_rank:
            return super().runtest()
        from launch.torchbases.ranked import exit_mapped, pg_bound_to_world

        self._obj = exit_mapped(self.instance, self.obj)
        with pg_bound_to_world():
            super().runtest()
        return None

