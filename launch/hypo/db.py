"""The example database of a Hypothesis run in lockstep across ranks.

Every rank must make the same decisions from the database (which stored
examples to replay first), so only rank 0 reads it; the other ranks replay
rank 0's reads, in order, from the store. Writes depend on where they land:

- storage rank 0 also writes (the same directory on this host, e.g. the
  default ``.hypothesis/examples``): rank 0 alone writes it, so ranks never
  race on one file;
- storage of this rank only (a test's own ``database=`` under its per-rank
  ``tmp_path``, an in-memory database): this rank writes it too, so a test
  that reads its database afterwards sees the same entries on every rank.
  The writes are the same on every rank because the runs are in lockstep.

Rank 0 publishes where its database writes go; a rank compares that with its
own storage before its first write. Hypothesis is imported lazily (inside
the class factory), like the rest of the service.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

WHERE = "db/where"  # store key: rank 0's storage locations (json list)
_INNER = ("db", "_db", "_wrapped", "wrapped")  # where wrappers keep their database


def locations(db: Any) -> list[str]:
    """Where writes to ``db`` land, one entry per writable storage."""
    from hypothesis.database import (
        DirectoryBasedExampleDatabase,
        ExampleDatabase,
        InMemoryExampleDatabase,
        MultiplexedDatabase,
        ReadOnlyDatabase,
    )

    if db is None or isinstance(db, ReadOnlyDatabase):
        return []
    if isinstance(db, MultiplexedDatabase):
        return [w for part in db._wrapped for w in locations(part)]
    if isinstance(db, DirectoryBasedExampleDatabase):
        return [f"dir:{os.path.realpath(db.path)}"]
    if isinstance(db, InMemoryExampleDatabase):  # this process' memory: private
        return [f"memory:{os.getpid()}:{id(db)}"]
    inner = [getattr(db, a) for a in _INNER if isinstance(getattr(db, a, None), ExampleDatabase)]
    if inner:  # a wrapper (per-node keys, background writes): where its inner one writes
        return [w for d in inner for w in locations(d)]
    # NOTE: an unknown kind (a network database) is taken as shared when its
    # repr matches rank 0's: rank 0 alone writes it.
    return [f"other:{db!r}"]


def write_private(db: Any, shared: set[str], op: str, args: tuple) -> None:
    """Apply ``op`` to the parts of ``db`` whose storage rank 0 does not write."""
    from hypothesis.database import MultiplexedDatabase, ReadOnlyDatabase

    if db is None or isinstance(db, ReadOnlyDatabase):
        return
    if isinstance(db, MultiplexedDatabase):
        for part in db._wrapped:
            write_private(part, shared, op, args)
        return
    where = locations(db)
    if where and not shared.intersection(where):
        getattr(db, op)(*args)


@functools.cache
def mirror_db_class() -> type:
    from hypothesis.database import ExampleDatabase

    class MirrorDB(ExampleDatabase):
        """Rank 0: the real database, publishing every fetch to the store.
        Other ranks: replay rank 0's fetches in order; write only their own
        storage. ``read(keys, what)`` waits for rank 0's keys and returns their
        values (the lockstep's version fails at once when rank 0 left the test)."""

        def __init__(self, real: Any, store: Any, rank: int, timeout: timedelta,
                     read: Callable[[list[str], str], list[bytes]] | None = None) -> None:
            super().__init__()
            self.real, self.store, self.rank, self.timeout = real, store, rank, timeout
            self.read = read or self._read
            self.n = 0
            self.shared: set[str] | None = None
            if rank == 0:
                store.set(WHERE, json.dumps(locations(real)))

        def _read(self, keys: list[str], what: str) -> list[bytes]:
            self.store.wait(keys, self.timeout)
            return self.store.multi_get(keys)

        def fetch(self, key: bytes):
            slot = f"db/{self.n}"
            self.n += 1
            if self.rank == 0:
                values = list(self.real.fetch(key)) if self.real is not None else []
                self.store.set(slot, json.dumps([v.hex() for v in values]))
                return iter(values)
            got = self.read([slot], f"rank 0's database read #{self.n}")[0]
            return iter(bytes.fromhex(v) for v in json.loads(got))

        def _write(self, op: str, *args: Any) -> None:
            if self.real is None:
                return
            if self.rank == 0:
                getattr(self.real, op)(*args)
                return
            if self.shared is None:
                got = self.read([WHERE], "where rank 0's database writes go")[0]
                self.shared = set(json.loads(got))
            write_private(self.real, self.shared, op, args)

        def save(self, key: bytes, value: bytes) -> None:
            self._write("save", key, value)

        def delete(self, key: bytes, value: bytes) -> None:
            self._write("delete", key, value)

        def move(self, src: bytes, dest: bytes, value: bytes) -> None:
            self._write("move", src, dest, value)

    return MirrorDB
