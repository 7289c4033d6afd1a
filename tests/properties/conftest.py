"""Property suite plumbing: every property runs on a 2-rank and a 4-rank
world, on the DTensor implementation ``--dtensor-impl`` names.

- A test that takes ``n_ranks`` is parametrized with ``world_size(2)`` and
  ``world_size(4)`` variants (a 2-rank world skips the 4-rank variant).
- ``--dtensor-impl {dtensor,torch}`` (env ``DTENSOR_TEST_IMPL``) and the
  ``impl`` fixture (``dtensor.testing.get_impl``).
- ``DTENSOR_MUTANT=name`` applies ``tools/mutants.py``'s mutant on every rank.
- ``--property-summary``: after the run, one line per distributed property:
  pass / FAIL / skip.
- Both appear in the ``Replay:`` line of the lockstep Hypothesis plugin
  (``launch.hypo.profiles``, loaded by the root conftest, keeps the
  ranks' examples identical) through its ``pytest_lockstep_replay_args`` hook.

This glue lives here, not in ``launch/``: the test service never imports
``dtensor``. Example::

    torchrun --nproc_per_node=4 -m pytest tests/properties --dtensor-impl=torch
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

# DTENSOR_WORLD_SIZES=16,64 runs the suite on other sizes (simulated worlds:
# pytest --dist-sim, see docs/test-service.md).
WORLD_SIZES = tuple(int(n) for n in os.environ.get("DTENSOR_WORLD_SIZES", "2,4").split(","))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "n_ranks" in metafunc.fixturenames:
        metafunc.parametrize("n_ranks", [
            pytest.param(n, marks=pytest.mark.world_size(n), id=f"{n}ranks")
            for n in WORLD_SIZES
        ])


def _impl(config: pytest.Config) -> str:
    # NOTE: the option exists only when this conftest was loaded at startup
    # (a path under tests/properties on the command line); else the env's.
    return config.getoption("dtensor_impl", default=None) or os.environ.get(IMPL_ENV, "dtensor")


IMPL_ENV = "DTENSOR_TEST_IMPL"
MUTANT_ENV = "DTENSOR_MUTANT"
COVERAGE_ENV = "DTENSOR_RULE_COVERAGE"  # "0": no coverage record


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("dtensor", "dtensor property suite")
    g.addoption("--dtensor-impl", choices=("dtensor", "torch"),
                default=os.environ.get(IMPL_ENV, "dtensor"),
                help=f"DTensor implementation the properties run on (env {IMPL_ENV})")
    g.addoption("--property-summary", action="store_true", default=False,
                help="after the run, one line per distributed property: pass / FAIL / skip")


def pytest_configure(config: pytest.Config) -> None:
    impl = _impl(config)
    os.environ[IMPL_ENV] = impl  # worlds launched by a plain pytest parent inherit it
    mutant = os.environ.get(MUTANT_ENV)
    if mutant:
        import importlib.util

        path = config.rootpath / "tools" / "mutants.py"
        spec = importlib.util.spec_from_file_location("_dtensor_mutants", path)
        if spec is None or spec.loader is None:
            raise pytest.UsageError(f"{MUTANT_ENV}={mutant}: no {path}")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.apply(mutant)
    config.pluginmanager.register(_Summary(config), "dtensor-property-summary")
    if impl == "dtensor" and os.environ.get(COVERAGE_ENV, "1") != "0":
        # Which input kinds each registered rule meets (python -m
        # dtensor.testing.coverage prints the table after the run).
        from dtensor.testing import coverage

        coverage.install()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _impl(session.config) != "dtensor" or os.environ.get(COVERAGE_ENV, "1") == "0":
        return
    from dtensor.testing import coverage

    if coverage.RECORD and not os.environ.get(MUTANT_ENV):  # a mutant's run is no record
        run = " ".join(["pytest", *session.config.invocation_params.args])
        coverage.dump(session.config.rootpath / coverage.DEFAULT_DIR, run=run)


def pytest_report_header(config: pytest.Config) -> list[str]:
    mutant = os.environ.get(MUTANT_ENV)
    return [f"dtensor properties: impl={_impl(config)}"
            + (f", MUTANT={mutant}" if mutant else "")]


@pytest.hookimpl(optionalhook=True)
def pytest_lockstep_replay_args(config: pytest.Config) -> list[str]:
    out = []
    if os.environ.get("DTENSOR_WORLD_SIZES"):  # else a [16ranks] id does not exist
        out.append(f"DTENSOR_WORLD_SIZES={os.environ['DTENSOR_WORLD_SIZES']}")
    mutant = os.environ.get(MUTANT_ENV)
    if mutant:
        out.append(f"{MUTANT_ENV}={mutant}")
    impl = _impl(config)
    if impl != "dtensor":
        out.append(f"--dtensor-impl={impl}")
    return out


@pytest.fixture
def impl(request: pytest.FixtureRequest) -> Any:
    """The DTensor implementation under test (``--dtensor-impl``)."""
    from dtensor.testing.impl import get_impl

    return get_impl(_impl(request.config))


_ERROR_LINE = re.compile(r"^E\s+([\w.]*(?:Error|Exception|Interrupt)): (.*)$")


def _first_line(rep: Any) -> str:
    """The most telling line of a report: the first error line, or the skip reason."""
    if rep.skipped and isinstance(rep.longrepr, tuple):
        return str(rep.longrepr[2]).removeprefix("Skipped: ")[:200]
    text = getattr(rep, "longreprtext", "") or ""
    for line in text.splitlines():
        m = _ERROR_LINE.match(line.strip())
        if m and not m.group(1).endswith(("RankFailure", "LockstepDivergence")):
            return f"{m.group(1).split('.')[-1]}: {m.group(2)}"[:200]
    for line in text.splitlines():
        if "launch:" in line or "LockstepDivergence" in line:
            return line.strip().removeprefix("E").strip()[:200]
    return ""


class _Summary:
    """Per distributed property: pass / FAIL / skip for the implementation under test."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.property_ids: set[str] = set()

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            fn = getattr(getattr(item, "obj", None), "__func__", getattr(item, "obj", None))
            if getattr(fn, "is_hypothesis_test", False) and item.get_closest_marker(
                    "world_size"):
                self.property_ids.add(item.nodeid)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        rows: dict[str, tuple[str, str]] = {}
        for kind in ("passed", "failed", "skipped", "error"):
            for rep in terminalreporter.stats.get(kind, []):
                nodeid = getattr(rep, "nodeid", None)
                if nodeid not in self.property_ids:
                    continue
                if kind == "passed" and rep.when != "call":
                    continue
                rows.setdefault(nodeid, (kind, _first_line(rep)))
                if kind in ("failed", "error"):
                    rows[nodeid] = (kind, _first_line(rep))
        if not rows or not self.config.getoption("property_summary", default=False):
            return  # -q stays short: failures are in pytest's own summary
        mutant = os.environ.get(MUTANT_ENV)
        tr = terminalreporter
        tr.write_sep("-", f"property summary: impl={_impl(self.config)}"
                     + (f", mutant={mutant}" if mutant else ""))
        for nodeid in sorted(rows):
            kind, why = rows[nodeid]
            mark = {"passed": "pass", "failed": "FAIL", "error": "FAIL"}.get(kind, "skip")
            name = nodeid.split("/")[-1]
            tr.write_line(f"{mark:4}  {name}" + (f"  -- {why}" if mark != "pass" else ""))


#: World sizes tried, smallest first, when a simulated failure is searched for
#: the smallest world that still fails it (pytest --dist-sim --dist-sim-confirm).
SMALLER_WORLDS = (2, 3, 4, 8, 16, 32)


@pytest.hookimpl(optionalhook=True)
def pytest_dist_sim_smaller_worlds(item: pytest.Item, size: int) -> list | None:
    tag = f"[{size}ranks"
    if tag not in item.nodeid:
        return None
    return [(m, item.nodeid.replace(tag, f"[{m}ranks"), {"DTENSOR_WORLD_SIZES": str(m)})
            for m in SMALLER_WORLDS if m < size]


def pytest_launch_classify(values: list, op: str) -> dict[str, str]:
    """Input classes of a fuzzing example in DTensor's terms (mesh, placements,
    uneven shards) for ``python -m launch fuzz``, which knows no DTensor names."""
    from dtensor.testing.input_classes import classify

    return classify(values, op)
