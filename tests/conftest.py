"""Fixtures shared by the tests of this folder (the service's own live in
``launch``; the property suite's in ``tests/properties/conftest.py``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

_WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def pytest_collection_modifyitems(config, items):
    """The quick tier (``pytest tests/ -m quick``): one test per file, the
    one(s) a file names in ``QUICK = "test_name"`` (or a tuple of names), else
    its first test not marked ``slow``. Every file is still imported, so every
    module the suite imports is loaded; ``tests/test_quick_tier_coverage.py``
    checks that the tier reaches every module of ``dtensor/`` and ``launch/``."""
    chosen: dict[str, list[pytest.Item]] = {}
    for item in items:
        if item.get_closest_marker("slow"):
            continue
        path = str(item.path)
        want = getattr(getattr(item, "module", None), "QUICK", None)
        name = getattr(item, "originalname", None) or item.name
        if want is None:
            chosen.setdefault(path, [item])
        elif name in ((want,) if isinstance(want, str) else want):
            if not any((getattr(i, "originalname", None) or i.name) == name
                       for i in chosen.get(path, ())):
                chosen.setdefault(path, []).append(item)
    for picked in chosen.values():
        for item in picked:
            item.add_marker(pytest.mark.quick)


@pytest.fixture
def fresh_process():
    """``fresh_process(script)`` runs ``python -c script PORT`` in a new
    interpreter (nothing imported yet; PORT is free for a 1-rank world's
    ``init_method``) and returns the ``CompletedProcess``. Skipped under
    torchrun: every rank would start one.

    Example:
        >>> p = fresh_process("import sys; print(sys.argv[1].isdigit())")
        >>> p.stdout
        'True\\n'
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        pytest.skip("self-test starts its own process; run it with plain pytest")

    def run(script: str, timeout: float = 300) -> subprocess.CompletedProcess:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in _WORLD_ENV}
        return subprocess.run([sys.executable, "-c", script, str(port)], capture_output=True,
                              text=True, timeout=timeout, env=env)

    return run


@pytest.fixture
def line_mesh():
    """``line_mesh(n)``: a 1-D CPU mesh over ranks ``0 .. n-1`` of the test's
    world (all of them when ``n`` is left out). The mesh is built where the
    test calls it, on each rank: fixtures of a simulated world run on no rank.

    Example:
        >>> @pytest.mark.world_size(2)
        ... def test_halves(line_mesh):
        ...     assert line_mesh().size() == 2 and line_mesh(1).size() == 1
    """

    def make(n: int | None = None):
        import torch.distributed as dist

        from dtensor import DeviceMesh

        return DeviceMesh("cpu", list(range(dist.get_world_size() if n is None else n)))

    return make


@pytest.fixture
def shared_dir():
    """``with shared_dir() as path:`` a fresh directory every rank of the
    test's world sees. The world's first rank makes it and sends its path to
    the others; on leaving, every rank waits for the others, then the first
    rank removes it. Call it in the test body, on every rank of the world.

    Example:
        >>> @pytest.mark.world_size(2)
        ... def test_save(world, shared_dir):
        ...     with shared_dir() as path:
        ...         torch.save(world.rank, f"{path}/{world.rank}.pt")
    """

    @contextlib.contextmanager
    def make(prefix: str = "dtensor-test-"):
        import torch
        import torch.distributed as dist

        buf = torch.zeros(512, dtype=torch.uint8)
        if dist.get_rank() == 0:
            made = tempfile.mkdtemp(prefix=prefix).encode()
            buf[: len(made)] = torch.tensor(list(made), dtype=torch.uint8)
        dist.broadcast(buf, src=0)
        path = bytes(buf[buf != 0].tolist()).decode()
        try:
            yield path
        finally:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(path, ignore_errors=True)

    return make


@pytest.fixture
def user_repo(tmp_path):
    """An empty folder standing for a user's own repository: outside this
    one, no conftest, no pytest configuration; the project reaches it only as
    installed (its ``pytest11`` entry points). Run commands there with
    ``_user_repo.run_in``. Skipped under torchrun: every rank would start
    the child's worlds.

    Example:
        >>> def test_help(user_repo):
        ...     assert run_in(user_repo, "-m", "launch", "--help").returncode == 0
    """
    if "RANK" in os.environ:
        pytest.skip("self-test starts its own worlds; run it with plain pytest")
    # Asked from the user's folder: in this repository's root a stale
    # dtensor.egg-info from an old build can shadow the installed metadata.
    names = subprocess.run(
        [sys.executable, "-c", "from importlib.metadata import entry_points; "
         "print(sorted(e.value for e in entry_points(group='pytest11')))"],
        cwd=tmp_path, capture_output=True, text=True).stdout
    assert "'launch.plugin'" in names and "'launch.fuzz.replay'" in names, (
        f"the project's pytest11 entry points are not installed ({names}): "
        "pip install -e '.[test]'")
    return tmp_path
