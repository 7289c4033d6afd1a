"""What the compile tests share (importable by name: ``tests/`` is on
``sys.path`` while its tests run): a fresh compiler per test and a structural
comparison of compiled and eager results.

Example:
    >>> from _compile_checks import assert_same, fresh_compiler  # noqa: F401
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from dtensor import DTensor

__all__ = ["assert_same", "fresh_compiler"]


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Autouse where imported: every test compiles from a reset Dynamo."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(compile_threads=1):  # no worker pool on 2 cores
        yield
    torch._dynamo.reset()


def assert_same(got, want) -> None:
    """Same structure; DTensors with equal placements, shapes and local blocks."""
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
        return
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, DTensor):
        assert got.placements == want.placements and got.shape == want.shape
        got, want = got.to_local(), want.to_local()
    torch.testing.assert_close(got, want)
