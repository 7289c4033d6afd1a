"""Property suite plumbing: every property runs on a 2-rank and a 4-rank world.

A test that takes ``n_ranks`` is parametrized with ``world_size(2)`` and
``world_size(4)`` variants (a 2-rank world skips the 4-rank variant). The
lockstep Hypothesis plugin (``launch.hypothesis_lockstep``) provides the
``impl`` fixture and keeps the ranks' examples identical.
"""

from __future__ import annotations

import pytest

WORLD_SIZES = (2, 4)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "n_ranks" in metafunc.fixturenames:
        metafunc.parametrize("n_ranks", [
            pytest.param(n, marks=pytest.mark.world_size(n), id=f"{n}ranks")
            for n in WORLD_SIZES
        ])
