"""One example-database namespace per pytest node id.

Hypothesis keys a test's stored examples by a digest of its source, and its
pytest plugin adds the node id only for ``@pytest.mark.parametrize`` (or
fixture params, a check the lockstep settings switch off). The property
suite parametrizes ``n_ranks`` from ``pytest_generate_tests``, so
``test_x[2ranks]`` and ``test_x[4ranks]`` shared one key: a failure the
fuzzer stored for ``[4ranks]`` was replayed by the next ``[2ranks]`` slice,
passed there, and Hypothesis deleted it as stale (measured: the session's
database ended empty, and CI had nothing to replay).

Both writers and readers of the fuzzing database (``launch.fuzz.rank`` for a
slice, ``launch.fuzz.replay`` for CI) wrap it in ``per_node(db, nodeid)``:
every key Hypothesis uses (the test's key, its ``.secondary`` and
``.pareto`` keys, the key index) gets the node id appended, so variants never
see each other's examples, whatever key Hypothesis computes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["per_node"]


def per_node(db: Any, nodeid: str) -> Any:
    """``db`` seen through ``nodeid``'s namespace (``None`` stays ``None``)."""
    if db is None:
        return None
    return _class()(db, nodeid)


def _class() -> type:
    global _NodeKeyed
    if _NodeKeyed is not None:
        return _NodeKeyed
    from hypothesis.database import ExampleDatabase

    class NodeKeyed(ExampleDatabase):
        def __init__(self, db: Any, nodeid: str) -> None:
            super().__init__()
            self.db, self.nodeid = db, nodeid
            self.suffix = b"@" + nodeid.encode()

        def __repr__(self) -> str:
            return f"per_node({self.db!r}, {self.nodeid!r})"

        def __eq__(self, other: object) -> bool:
            return isinstance(other, NodeKeyed) and (self.db, self.nodeid) == (
                other.db, other.nodeid)

        def __hash__(self) -> int:
            return hash((id(self.db), self.nodeid))

        def fetch(self, key: bytes) -> Iterable[bytes]:
            yield from self.db.fetch(key + self.suffix)

        def save(self, key: bytes, value: bytes) -> None:
            self.db.save(key + self.suffix, value)

        def delete(self, key: bytes, value: bytes) -> None:
            self.db.delete(key + self.suffix, value)

        def move(self, src: bytes, dest: bytes, value: bytes) -> None:
            self.db.move(src + self.suffix, dest + self.suffix, value)

        # NOTE: no change listeners: nothing in a session or a CI run watches
        # the database, and the wrapped one may not support them.
        def _start_listening(self) -> None:
            pass

        def _stop_listening(self) -> None:
            pass

    _NodeKeyed = NodeKeyed
    return NodeKeyed


_NodeKeyed: type | None = None  # built on first use: importing hypothesis is not free
