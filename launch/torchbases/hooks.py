"""The pytest hooks that hand classes of PyTorch's distributed bases to the
service (loaded with ``launch.plugin``; ``-p no:launch.plugin`` leaves them
to their own harness, and so does ``--dist-torch-bases=own``)."""

from __future__ import annotations

import sys
import unittest
from collections.abc import Generator
from typing import Any

import pytest

from launch.torchbases import kinds


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("launch")
    g.addoption("--dist-torch-bases", choices=("service", "own"), default="service",
                help="classes of torch.testing._internal's distributed bases: run on the "
                     "service's worlds (default) or by the bases' own harness")


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: Any) -> Any:
    # NOTE: cheap for every other object: the bases are only looked at once
    # the module defining them is loaded (a derived class imported it).
    if kinds.DIST_MODULE not in sys.modules or not isinstance(obj, type):
        return None
    if not issubclass(obj, unittest.TestCase):
        return None
    import inspect

    kind = kinds.kind_of(obj)
    if kind is None or inspect.isabstract(obj):
        return None
    from launch.torchbases.items import TorchBaseClass

    node = TorchBaseClass.from_parent(collector, name=name, obj=obj)
    node.kind = kind
    return node


def _own_world(item: pytest.Item) -> bool:
    return bool(getattr(item, "in_own_world", False))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, Any]:
    if not _own_world(item):
        return (yield)
    from launch.torchbases.inproc import own_world

    with own_world():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    if not _own_world(item):
        return (yield)
    from launch.torchbases.inproc import own_world

    with own_world():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, Any, Any]:
    if not _own_world(item):
        return (yield)
    from launch.torchbases.inproc import own_world

    with own_world():
        return (yield)
