"""``--shuffle SEED``: run the collected tests in a seeded random order.

Order dependence (a test that passes only after another one warmed a cache,
built a group, or left a seed behind) should show up in CI, not on a user's
machine. Modules are shuffled, then the tests within each module, so module
fixtures are still set up once per module. The order is a pure function of
the seed and the collected ids: every rank of a torchrun world computes the
same order (the service checks it agrees before running anything), and the
same seed replays a failing order.

Example::

    pytest tests/ --shuffle 7
    torchrun --nproc_per_node=4 -m pytest tests/ --shuffle 7
"""

from __future__ import annotations

import random

import pytest

__all__ = ["shuffled"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("launch").addoption(
        "--shuffle", type=int, default=None, metavar="SEED",
        help="run tests in a seeded random order (modules, then tests within "
             "each); the same SEED gives the same order on every rank and run")


def shuffled(items: list, seed: int, module_of=lambda item: item.nodeid.split("::")[0]) -> list:
    """``items`` reordered: modules shuffled, then items within each module.

    Example:
        >>> shuffled(["a.py::x", "a.py::y", "b.py::z"], 1, lambda i: i[:4])
        ['b.py::z', 'a.py::y', 'a.py::x']
    """
    rng = random.Random(seed)
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(module_of(item), []).append(item)
    modules = list(groups)
    rng.shuffle(modules)
    out: list = []
    for m in modules:
        members = groups[m]
        rng.shuffle(members)
        out.extend(members)
    return out


# Before the service's own hooks (e.g. --dist-start-after), which then see
# the shuffled order, so a resume command replays it.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    seed = config.getoption("shuffle", None)
    if seed is not None:
        items[:] = shuffled(items, seed)


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = config.getoption("shuffle", None)
    if seed is None:
        return None
    return f"launch: tests in shuffled order, seed {seed} (--shuffle {seed} replays it)"
