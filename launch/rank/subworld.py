"""Sub-worlds that look like whole worlds.

Under a torchrun world of N ranks, a ``world_size(n)`` test with n < N runs
on ranks 0..n-1 while ranks n..N-1 wait for its outcome. For the test's
duration those n ranks see a world of exactly n: ``dist.get_world_size() ==
n``, ``dist.get_rank()`` their rank in it, ``dist.group.WORLD`` (and every
collective without ``group=``) its own process group, ``dist.new_group`` and
any mesh built from the world within it, and ``RANK``/``WORLD_SIZE``/
``LOCAL_WORLD_SIZE`` to match. No collective can reach a rank outside it.

How: c10d keeps its world in module globals (``_world.default_pg``, the
group maps, the group counter) and group names in a process-wide C++
registry. A sub-world is a real ``init_process_group`` of n ranks over a
``PrefixStore`` of the full world's store, made once per size with those
globals emptied, its state captured, and the full world's put back. Entering
a sub-world swaps the two states (and the registered names); leaving swaps
back and keeps what the test added (groups made by ``new_group`` stay with
the sub-world for its later tests). Caches keyed by the default group (the
dtensor runtime's group cache is) see a different group in each world.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_MAPS = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config",
         "_tags_to_pg", "_pg_to_tag")
NAME_BASE = 1_000_000  # a sub-world of n names its groups from n * NAME_BASE up


@dataclass
class _State:
    """A snapshot of c10d's module-level world."""

    default_pg: Any
    maps: dict[str, dict] = field(default_factory=dict)
    group_count: int = 0
    backend: Any = None
    init_method: Any = None


def _capture() -> _State:
    return _State(
        c10d._world.default_pg,
        {name: dict(getattr(c10d, name)) for name in _MAPS},
        c10d._world.group_count,
        getattr(c10d, "_backend", None),
        getattr(c10d, "_default_pg_init_method", None),
    )


def _install(state: _State) -> None:
    """Make ``state`` c10d's world (in place: others may hold the dicts)."""
    from torch._C._distributed_c10d import (
        _register_process_group,
        _unregister_process_group,
    )

    for name in set(c10d._pg_names.values()):
        try:
            _unregister_process_group(name)
        except Exception:
            pass  # destroyed meanwhile
    for name in _MAPS:
        d = getattr(c10d, name)
        d.clear()
        d.update(state.maps.get(name, {}))
    for pg, name in c10d._pg_names.items():
        try:
            _register_process_group(name, pg)
        except Exception:
            pass
    c10d._world.default_pg = state.default_pg
    c10d._world.group_count = state.group_count
    c10d._backend = state.backend
    c10d._default_pg_init_method = state.init_method
    rank = state.default_pg.rank() if state.default_pg is not None else -1
    import torch

    torch._C._distributed_c10d._set_global_rank(rank)


@dataclass
class SubWorld:
    """The first n ranks of the running world as a world of their own."""

    n: int
    rank: int
    state: _State
    env: dict[str, str]

    @contextmanager
    def entered(self) -> Iterator[None]:
        """Be this sub-world for the duration (on its members only)."""
        full = _capture()
        saved_env = {k: os.environ.get(k) for k in self.env}
        _install(self.state)
        os.environ.update(self.env)
        try:
            yield
        finally:
            self.state = _capture()  # keep groups the test made
            _install(full)
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def create(n: int, prefix: str) -> SubWorld:
    """Members only (global ranks 0..n-1): make the n-rank sub-world.

    ``prefix`` keeps its store keys apart from other worlds' (e.g. per
    torchrun attempt)."""
    rank = dist.get_rank()
    if rank >= n:
        raise AssertionError(f"rank {rank} is not in the {n}-rank sub-world")
    store = dist.PrefixStore(f"{prefix}sub{n}/", c10d._get_default_store())
    backend = dist.get_backend()
    full = _capture()
    hook = sys.excepthook  # init_process_group wraps it; keep ours
    empty = _State(None, {}, n * NAME_BASE, None, None)
    _install(empty)
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=n)
        state = _capture()
    finally:
        sys.excepthook = hook
        _install(full)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", n)))
    env = {"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(min(n, local))}
    return SubWorld(n, rank, state, env)
