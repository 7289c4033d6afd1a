"""Replay the fuzzing database first, in every later pytest run (CI too).

A pytest plugin, loaded by the root ``conftest.py``. When an example
database of fuzzing failures exists (``--fuzz-db PATH``, env
``LAUNCH_FUZZ_DB``, default ``<rootdir>/.fuzz-db`` when that folder exists),
it

- gives each ``@given`` test with stored examples that database, read-only
  and seen through the test's node id (``launch.fuzz.nodedb``: the fuzzer
  stores each parametrization apart), so it replays them in Hypothesis'
  reuse phase, before any generated example (other tests are left as they
  are);
- moves the tests that have stored examples to the front of the run, so
  a CI run fails on a stored failure first.

Worlds that a plain ``pytest`` launches inherit the path through the
environment. For GitHub CI, point Hypothesis at
``GitHubArtifactDatabase`` instead (see docs/fuzzing.md).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import pytest

from launch.fuzz.nodedb import per_node
from launch.hypo import engine

DEFAULT_DB = ".fuzz-db"
ENV = "LAUNCH_FUZZ_DB"

__all__ = ["DEFAULT_DB", "ENV", "database", "from_lockstep", "keys_of", "replay_line",
           "replay_seed", "replay_settings"]


def replay_line(nodeid: str, nproc: int, db: Path | str, env: str = "") -> str:
    """The command that replays a stored failure of ``nodeid`` from ``db``."""
    words = [w for w in shlex.split(env)] + [f"{ENV}={db}", "torchrun",
                                              f"--nproc_per_node={nproc}", "-m", "pytest",
                                              nodeid, "--hypothesis-profile=ci"]
    return "Replay: " + shlex.join(words)


def from_lockstep(line: str, nodeid: str, nproc: int, db: Path | str) -> str:
    """``replay_line`` keeping the environment and extra options of the
    lockstep plugin's seed-based ``Replay:`` line (a mutant, ``--dtensor-impl``)."""
    try:
        words = shlex.split(line.split("Replay:", 1)[-1])
    except ValueError:
        words = []
    # A simulated world's line reads "Replay: ENV pytest --dist-sim 'id' ...".
    k = next((words.index(w) for w in ("torchrun", "pytest") if w in words), len(words))
    env = [w for w in words[:k] if "=" in w and not w.startswith("-")]
    extra = [w for w in words[k:] if w.startswith("--") and not w.startswith(
        ("--nproc", "--hypothesis-profile", "--hypothesis-seed", "--dist-sim"))]
    out = replay_line(nodeid, nproc, db, shlex.join(env))
    return out + (" " + shlex.join(extra) if extra else "")


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("launch-fuzz", "fuzzing database replay (launch.fuzz)")
    g.addoption("--fuzz-db", default=None,
                help=f"example database of fuzzing failures to replay first (env {ENV}; "
                     f"default <rootdir>/{DEFAULT_DB} if it exists)")


def _path(config: pytest.Config) -> Path | str | None:
    given = config.getoption("fuzz_db", None) or os.environ.get(ENV)
    if given and given.startswith("github:"):
        return given
    path = Path(given) if given else Path(config.rootpath) / DEFAULT_DB
    return path.resolve() if path.is_dir() else None


def database(path: Path | str, *, writable: bool = False) -> Any:
    """The example database at ``path``: a folder, or ``github:OWNER/REPO[/ARTIFACT]``
    (Hypothesis' ``GitHubArtifactDatabase``: the folder a CI job uploaded as
    an artifact; always read-only)."""
    from hypothesis.database import (
        DirectoryBasedExampleDatabase,
        GitHubArtifactDatabase,
        ReadOnlyDatabase,
    )

    spec = str(path)
    if spec.startswith("github:"):
        owner, repo, *artifact = spec.removeprefix("github:").split("/")
        return ReadOnlyDatabase(GitHubArtifactDatabase(owner, repo, *artifact[:1]))
    db = DirectoryBasedExampleDatabase(spec)
    return db if writable else ReadOnlyDatabase(db)


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    path = _path(config)
    if path is None or os.environ.get("LAUNCH_FUZZ_DIR"):  # a fuzzing session has its own
        return
    os.environ[ENV] = str(path)  # worlds launched by this process replay it too
    config.stash[_KEY] = path


def replay_settings(current: Any, path: Path | str, nodeid: str) -> Any:
    """``current`` plus the read-only database at ``path``, in ``nodeid``'s
    namespace (where the fuzzing session stored that test's examples).

    NOTE: Hypothesis treats ``derandomize=True`` (the ``ci`` profile) as
    "no database", so a test with stored examples runs with
    ``derandomize=False`` and a fixed seed (``replay_seed``) instead: still
    the same examples on every run and every rank, now after the stored ones.
    """
    from hypothesis import settings
    from hypothesis.database import MultiplexedDatabase

    fuzz = per_node(database(path), nodeid)
    own = None if current.derandomize else current.database
    db = fuzz if own is None else MultiplexedDatabase(own, fuzz)
    return settings(current, derandomize=False, database=db)


def replay_seed(inner: Any) -> int:
    """A seed derived from the test's source, as ``derandomize`` would use."""
    from hypothesis.internal.reflection import function_digest

    return int.from_bytes(function_digest(inner)[:8], "big")


_KEY = pytest.StashKey["Path | str"]()


def keys_of(item: pytest.Item) -> list[bytes]:
    """The database keys Hypothesis may use for ``item`` (with and without the
    per-parametrization digest its pytest plugin adds)."""
    from hypothesis.internal.reflection import function_digest

    inner = item.obj.hypothesis.inner_test
    keys = [function_digest(inner)]
    had = getattr(inner, "_hypothesis_internal_add_digest", None)
    try:
        inner._hypothesis_internal_add_digest = item.nodeid.encode()
        keys.append(function_digest(inner))
    finally:
        if had is None:
            del inner._hypothesis_internal_add_digest
        else:
            inner._hypothesis_internal_add_digest = had
    return keys


def stored(items: list[pytest.Item], path: Path | str) -> set[str]:
    """Node ids of ``items`` with examples in the database at ``path``."""
    db = database(path)
    out = set()
    for item in items:
        fn = getattr(getattr(item, "obj", None), "__func__", getattr(item, "obj", None))
        if not getattr(fn, "is_hypothesis_test", False):
            continue
        mine = per_node(db, item.nodeid)
        if any(next(iter(mine.fetch(k)), None) is not None for k in keys_of(item)):
            out.add(item.nodeid)
    return out


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = config.stash.get(_KEY, None)
    if path is None:
        return
    first = stored(items, path)
    for item in items:
        if item.nodeid in first:
            item.stash[_REPLAY] = path
            fn = getattr(item.obj, "__func__", item.obj)
            if fn._hypothesis_internal_use_seed is None:
                fn._hypothesis_internal_use_seed = replay_seed(item.obj.hypothesis.inner_test)
    if first:
        items[:] = [i for i in items if i.nodeid in first] + [
            i for i in items if i.nodeid not in first]


# NOTE: the settings go on per item at setup, not at collection: the variants
# of a parametrized test share one function object, and each must read its
# own namespace. Setup runs before any runtest_call wrapper (the lockstep
# plugin's mirrors this database from rank 0 to the other ranks).
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    path = item.stash.get(_REPLAY, None)
    if path is None:
        return
    engine.push(engine.given_function(item), "replay",
                settings=lambda cur: replay_settings(cur, path, item.nodeid))
    item.stash[_LAYERED] = True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    try:
        return (yield)
    finally:
        if item.stash.get(_LAYERED, False):
            engine.pop(engine.given_function(item), "replay")
            del item.stash[_LAYERED]


_REPLAY = pytest.StashKey["Path | str"]()
_LAYERED = pytest.StashKey[bool]()
