"""The service's one seam to a ``@given`` test's Hypothesis run.

Four layers change how a ``@given`` test runs, and each does it here, by
stacking a *layer* on the test function: settings made from the settings
below it, and optionally a wrapper of the test's inner function (the one
Hypothesis calls once per example). Layers nest in one order, outermost
first (``ORDER``):

- ``slice``: one slice of a fuzzing session (``launch.fuzz.rank``): its
  seed, example count and database; the probe that records each example;
- ``replay``: the fuzzing database read first in later runs
  (``launch.fuzz.replay``);
- ``lockstep``: what every multi-process run needs (``launch.hypo.lockstep``:
  no deadline, no timing health checks, no ``explain`` phase);
- ``fanout``: a simulated world's one engine, each example on every rank
  thread (``launch.sim.fanout``).

``layer(fn, name, settings=..., inner=...)`` puts a layer on, and takes it
off again on leaving; a layer put on out of order, or taken off while another
is on top of it, is an error naming both (a bug of the service). Per-run
hooks (``install_run_hook``) reach Hypothesis' engine itself: one run of a
``@given`` function, wherever it is called (the test itself, an inner
function, ``find()``).

Example (what the simulated world's fan-out does)::

    fn = given_function(item)
    with layer(fn, "fanout", settings=lambda cur: multi_process_settings(cur),
               inner=lambda inner: fanned_out(inner)):
        item.obj(**fixtures)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ORDER", "given_function", "install_run_hook", "is_data", "layer",
           "multi_process_settings"]

ORDER = ("slice", "replay", "lockstep", "fanout")
_TIMING_CHECKS = ("too_slow", "differing_executors", "function_scoped_fixture")


def given_function(item: Any) -> Any | None:
    """The ``@given`` function behind a pytest item (None: not a ``@given`` test)."""
    obj = getattr(item, "obj", None)
    fn = getattr(obj, "__func__", obj)
    return fn if getattr(fn, "is_hypothesis_test", False) else None


def is_data(v: Any) -> bool:
    """Whether ``v`` is the object ``st.data()`` draws into a test."""
    return type(v).__name__ == "DataObject" and hasattr(v, "draw")


def multi_process_settings(current: Any, **more: Any) -> Any:
    """``current`` without what differs between processes (deadlines, timing
    health checks, the ``explain`` phase), plus ``more``."""
    from hypothesis import HealthCheck, Phase, settings

    checks = list(dict.fromkeys([*current.suppress_health_check,
                                 *(HealthCheck[c] for c in _TIMING_CHECKS)]))
    phases = more.pop("phases", current.phases)
    return settings(current, deadline=None, suppress_health_check=checks,
                    phases=[p for p in phases if p != Phase.explain], **more)


class LayerOrderError(RuntimeError):
    """Layers on one test were put on or taken off out of ``ORDER``."""


@contextlib.contextmanager
def layer(fn: Any, name: str, settings: Callable[[Any], Any] | None = None,
          inner: Callable[[Any], Any] | None = None) -> Iterator[None]:
    """Layer ``name`` on ``fn`` for the ``with`` block (see the module docstring)."""
    push(fn, name, settings, inner)
    try:
        yield
    finally:
        pop(fn, name)


def push(fn: Any, name: str, settings: Callable[[Any], Any] | None = None,
         inner: Callable[[Any], Any] | None = None) -> None:
    """``layer``'s entry, for a layer that ends in another hook than it began."""
    if name not in ORDER:
        raise ValueError(f"launch.hypo.engine: unknown layer {name!r}; layers: {ORDER}")
    stack = fn.__dict__.setdefault("_launch_layers", [])
    if stack and ORDER.index(stack[-1][0]) >= ORDER.index(name):
        raise LayerOrderError(
            f"launch.hypo.engine: layer {name!r} put on {fn.__qualname__} inside "
            f"{stack[-1][0]!r}; the order is {ORDER} (outermost first)")
    handle = fn.hypothesis
    stack.append((name, fn._hypothesis_internal_use_settings, handle.inner_test))
    if settings is not None:
        fn._hypothesis_internal_use_settings = settings(fn._hypothesis_internal_use_settings)
    if inner is not None:
        handle.inner_test = inner(handle.inner_test)


def pop(fn: Any, name: str) -> None:
    """Take layer ``name`` off ``fn``: what it replaced comes back."""
    stack = fn.__dict__.get("_launch_layers") or []
    if not stack or stack[-1][0] != name:
        raise LayerOrderError(
            f"launch.hypo.engine: layer {name!r} taken off {fn.__qualname__}, but the "
            f"top layer is {stack[-1][0] if stack else None!r}")
    _, fn._hypothesis_internal_use_settings, fn.hypothesis.inner_test = stack.pop()


def layers(fn: Any) -> list[str]:
    """The names of the layers on ``fn``, outermost first."""
    return [entry[0] for entry in fn.__dict__.get("_launch_layers") or []]


# Per run: Hypothesis' engine ---------------------------------------------------------
def install_run_hook(start: Callable[..., Any], example: Callable[[], None]) -> None:
    """Route every Hypothesis run of this process through ``start`` (once).

    ``start(test, wrapped_test, settings, stuff)`` is called on the main
    thread when a run begins; it returns None (the run is left alone) or a
    run object with ``settings``, ``shared_random(random)``, ``wrap(test)``
    and ``finish()``, which the run then uses. ``example()`` is called before
    ``strategy.example()`` draws (it may raise to refuse the draw).
    """
    from hypothesis import core
    from hypothesis.strategies import SearchStrategy

    cls = core.StateForActualGivenExecution
    if getattr(cls, "_launch_lockstep", False):
        return
    init, run_engine, draw_example = cls.__init__, cls.run_engine, SearchStrategy.example

    @functools.wraps(init)
    def __init__(self, stuff, test, settings, random, wrapped_test, **kw):
        run = None
        if threading.current_thread() is threading.main_thread():
            run = start(test, wrapped_test, settings, stuff)
        if run is not None:
            settings, random, test = run.settings, run.shared_random(random), run.wrap(test)
        init(self, stuff, test, settings, random, wrapped_test, **kw)
        self._launch_run = run

    @functools.wraps(run_engine)
    def _run_engine(self):
        from launch.agree import LockstepDivergence

        run = getattr(self, "_launch_run", None)
        if run is None:
            return run_engine(self)
        try:
            result = run_engine(self)
        except LockstepDivergence:
            raise  # the ranks are apart; a final exchange could only wait
        except BaseException:
            run.finish()
            raise
        run.finish()
        return result

    @functools.wraps(draw_example)
    def _example(self):
        example()
        return draw_example(self)

    cls.__init__, cls.run_engine, SearchStrategy.example = __init__, _run_engine, _example
    cls._launch_lockstep = True
