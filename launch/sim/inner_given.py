"""A Hypothesis run started inside a test body on a simulated rank thread.

A real world keeps an inner ``@given`` (a function the test defines and
calls; also ``find()`` and stateful machines) in lockstep: one engine per
rank process, the same seed, every example compared across ranks
(``launch.hypo``). Rank threads share one interpreter, and an engine per
thread draws different examples on different ranks (Python's ``random`` and
Hypothesis' caches are shared), so a simulated world would compare different
values or wait in a collective that another rank never enters. Such a run
fails at once, on every rank, with an error that names the form and what to
write instead; ``@given`` on the test itself and draws through ``st.data()``
run in lockstep (``launch.sim.fanout``).

Example (what ``launch.modes.simulated`` does around a test's rank bodies)::

    with refusing(item.nodeid):
        world.run(body, timeout)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

__all__ = ["InnerGivenInSimWorld", "refusing"]


class InnerGivenInSimWorld(RuntimeError):
    """An inner ``@given`` (or ``find``) ran on a simulated rank thread."""


_nodeid: str | None = None  # the world test whose rank bodies run now


@contextlib.contextmanager
def refusing(nodeid: str) -> Iterator[None]:
    """While the block runs, a Hypothesis run started on any thread but the
    main one raises ``InnerGivenInSimWorld`` naming ``nodeid``."""
    global _nodeid
    _install()
    saved, _nodeid = _nodeid, nodeid
    try:
        yield
    finally:
        _nodeid = saved


def _install() -> None:
    from hypothesis import core

    cls = core.StateForActualGivenExecution
    if getattr(cls, "_launch_sim_refuses", False):
        return
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        on_rank = threading.current_thread() is not threading.main_thread()
        if _nodeid is not None and on_rank:
            test = args[1] if len(args) > 1 else kwargs.get("test")
            name = getattr(test, "__qualname__", "a @given function")
            raise InnerGivenInSimWorld(
                f"{_nodeid}: {name} is an inner @given (a Hypothesis run started "
                "inside the test body); a simulated world (--dist-sim) cannot keep it "
                "in lockstep: each rank thread would draw its own examples. Put "
                "@given on the test itself, e.g. @given(data=st.data()) and "
                "data.draw(...) in the body, or run this test in a real world "
                "(pytest without --dist-sim, or torchrun), where inner @given runs "
                "in lockstep.")
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    cls._launch_sim_refuses = True
