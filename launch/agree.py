"""Outcome agreement: one rank's reports -> a short verdict; all verdicts -> one
outcome that every rank logs. Pure functions, no processes (tested directly).

A verdict is a str: ``"P"`` (passed, the fast path), ``"-"`` (not a member of
the test's sub-world) or JSON ``[kind, when, text]`` with kind one of
failed / skipped / xfailed / xpassed / passed.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass

from _pytest._code.code import ReprExceptionInfo, ReprFileLocation, ReprTracebackNative
from _pytest.reports import TestReport

PHASES = ("setup", "call", "teardown")
_ADDRESS = re.compile(r"\b0x[0-9a-f]{6,}\b")
MAX_TEXT = 6000  # characters of one rank's traceback carried over the store


def verdict(reports: list[TestReport]) -> str:
    """Summarise one rank's setup/call/teardown reports of one test."""
    if all(r.passed and not hasattr(r, "wasxfail") for r in reports):
        return "P"
    for r in reports:
        if r.failed:
            return _enc("failed", r.when, _tail(r.longreprtext))
    for r in reports:
        if r.skipped:
            kind = "xfailed" if hasattr(r, "wasxfail") else "skipped"
            return _enc(kind, r.when, _skip_reason(r))
        if hasattr(r, "wasxfail"):
            return _enc("xpassed", r.when, str(r.wasxfail))
    return "P"


def missing_verdict(rank: int, nodeid: str) -> str:
    """The verdict of a rank that did not collect ``nodeid``."""
    return _enc("failed", "setup", f"{nodeid} was not collected on rank {rank}; "
                "every rank must collect the same tests")


def error_verdict(when: str, text: str) -> str:
    """The verdict of a rank that could not run the test at all."""
    return _enc("failed", when, _tail(text))


def failed(v: str) -> bool:
    """Whether verdict ``v`` is a failure (cheap on the ``"P"`` fast path)."""
    return v not in ("P", "-") and decode(v)[0] == "failed"


@dataclass(frozen=True)
class Decision:
    """An outcome that overrides the local reports: fail ``when`` with ``text``."""

    when: str
    text: str
    short: str


def decide(verdicts: list[str], members: tuple[int, ...]) -> Decision | None:
    """None when every member agrees on a non-failing outcome (keep local
    reports); otherwise the failure every rank reports."""
    parsed = {r: decode(verdicts[r]) for r in members}
    kinds = {r: v[0] for r, v in parsed.items()}
    failed = [r for r in members if kinds[r] == "failed"]
    n = len(members)
    if failed:
        when = min((parsed[r][1] for r in failed), key=PHASES.index)
        others = [r for r in members if r not in failed]
        head = f"failed on rank{'s' if len(failed) > 1 else ''} {_ranks(failed)} of {n}"
        if others:
            head += f" (rank{'s' if len(others) > 1 else ''} {_ranks(others)}: "
            head += ", ".join(sorted({kinds[r] for r in others})) + ")"
        blocks = [head]
        # Ranks that failed with the same text are shown once (a failure that
        # does not depend on the rank would otherwise print n copies).
        # Object addresses in a long traceback's locals differ per process.
        same: dict[tuple[str, str], list[int]] = {}
        first: dict[tuple[str, str], str] = {}
        for r in failed:
            key = (parsed[r][1], _ADDRESS.sub("0x…", parsed[r][2]))
            same.setdefault(key, []).append(r)
            first.setdefault(key, parsed[r][2])
        for key, rs in same.items():
            phase, text = key[0], first[key]
            who = f"rank {rs[0]}" if len(rs) == 1 else f"ranks {span(rs)}, same error"
            blocks.append(f"{'-' * 20} {who} ({phase}) {'-' * 20}\n{text}")
        return Decision(when, "\n".join(blocks), head)
    if len(set(kinds.values())) <= 1:
        return None
    by_kind: dict[str, list[int]] = {}
    for r in members:
        by_kind.setdefault(kinds[r], []).append(r)
    parts = []
    for kind, ranks in sorted(by_kind.items()):
        reasons = sorted({parsed[r][2] for r in ranks if parsed[r][2]})
        parts.append(f"{kind} on ranks {_ranks(ranks)}" + (f" ({'; '.join(reasons)})" if reasons else ""))
    short = "outcomes differ across ranks: " + ", ".join(parts)
    text = short + "\na test must have the same outcome on every rank (skip on all ranks or none)"
    return Decision("setup", text, short)


def apply(decision: Decision | None, reports: list[TestReport],
          nodeid: str, location: tuple) -> list[TestReport]:
    """This rank's reports to log: its own when there is no decision, else
    passed phases up to ``decision.when`` which fails with the shared text."""
    if decision is None:
        return reports
    by_when = {r.when: r for r in reports}
    out = []
    stop = PHASES.index(decision.when)
    for when in PHASES:
        i = PHASES.index(when)
        if when == "call" and stop == 0:
            continue  # a failed setup has no call phase
        base = by_when.get(when) or (reports[0] if reports else None)
        failing = i == stop
        out.append(make_report(nodeid, location, when,
                               "failed" if failing else "passed",
                               shared_longrepr(decision, location) if failing else None, base))
    return out


def shared_longrepr(decision: Decision, location: tuple) -> ReprExceptionInfo:
    """The agreed failure as pytest's own failure type: the whole text in the
    FAILURES section, ``decision.short`` as the crash line, so the short test
    summary stays one line per test also where pytest prints crash messages
    whole (``CI`` set, ``-vv``)."""
    path, lineno = (str(location[0]), (location[1] or 0) + 1) if location else ("", 0)
    return ReprExceptionInfo(reprtraceback=ReprTracebackNative([decision.text + "\n"]),
                             reprcrash=ReprFileLocation(path, lineno, decision.short))


def make_report(nodeid: str, location: tuple, when: str, outcome: str,
                longrepr: object, base: TestReport | None = None) -> TestReport:
    """A report for ``when``, copying captured output and timing from ``base``."""
    if base is None:
        return TestReport(nodeid, location, {}, outcome, longrepr, when)
    rep = copy.copy(base)
    rep.__dict__.pop("wasxfail", None)
    rep.when, rep.outcome, rep.longrepr = when, outcome, longrepr
    if base.when != when:
        rep.sections = []
    return rep


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def span(ranks: list[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``"0–3"``; ranks with gaps are listed."""
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}–{ranks[-1]}"
    return _ranks(ranks)


def _enc(kind: str, when: str, text: str) -> str:
    return json.dumps([kind, when, text])


def decode(v: str) -> tuple[str, str, str]:
    """A verdict as ``(kind, when, text)``."""
    if v == "P":
        return ("passed", "call", "")
    if v == "-":
        return ("absent", "setup", "")
    kind, when, text = json.loads(v)
    return (kind, when, text)


def _tail(text: str) -> str:
    return text if len(text) <= MAX_TEXT else "...\n" + text[-MAX_TEXT:]


def _skip_reason(r: TestReport) -> str:
    lr = r.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2]).removeprefix("Skipped: ")
    return str(getattr(r, "wasxfail", "") or lr or "")


def dump_report(config: object, report: TestReport) -> dict:
    """A report as JSON-able data (``pytest_report_to_serializable``)."""
    return config.hook.pytest_report_to_serializable(config=config, report=report)


def load_report(config: object, data: dict) -> TestReport:
    """Inverse of ``dump_report``; JSON turned tuples into lists, undo that."""
    rep = config.hook.pytest_report_from_serializable(config=config, data=data)
    if isinstance(rep.longrepr, list):
        rep.longrepr = tuple(rep.longrepr)
    if isinstance(rep.location, list):
        rep.location = tuple(rep.location)
    return rep


# One Hypothesis example on several ranks --------------------------------------------
class RankFailure(AssertionError):
    """An example failed on some rank. Raised alike wherever the example's
    verdict is taken (every rank of a real world, the one engine of a
    simulated world), so Hypothesis shrinks along the same path everywhere."""


class LockstepDivergence(BaseException):
    """The ranks did different things with one example (drew different values,
    stopped on some ranks only, hung). A BaseException: Hypothesis lets it
    through and never shrinks it."""


EXAMPLE_OUTCOMES = ("pass", "fail", "reject", "found", "control", "hung", "released")


def example_verdict(outcomes: dict[int, str]) -> tuple[str, list[int]]:
    """One example's verdict from each rank's outcome, and the ranks it names.

    Outcomes (``EXAMPLE_OUTCOMES``): ``pass``, ``fail``, ``reject`` (an
    assumption), ``found`` (``find()``'s condition held), ``control`` (a skip,
    an exit, Hypothesis' own control flow), ``hung``, ``released`` (let out of
    a collective because another rank failed: it follows the others). The
    first that applies:

    - ``("diverged", ranks)``: ranks hung; ``find()``'s condition held on some
      ranks only; a control on some ranks only; released with no failure;
    - ``("control", ranks)``: every rank stopped (each re-raises its own);
    - ``("failed", ranks)``, ``("rejected", ranks)``, ``("found", ranks)``;
    - ``("passed", [])``.

    Example::

        example_verdict({0: "pass", 1: "fail"})     # ("failed", [1])
    """
    bad = sorted(set(outcomes.values()) - set(EXAMPLE_OUTCOMES))
    if bad:
        raise ValueError(f"example_verdict: unknown outcome(s) {bad}; expected one of "
                         f"{EXAMPLE_OUTCOMES}")

    def ranks(kind: str) -> list[int]:
        return sorted(r for r, o in outcomes.items() if o == kind)

    following = [r for r, o in outcomes.items() if o != "released"]
    if ranks("hung"):
        return "diverged", ranks("hung")
    for kind in ("found", "control"):
        some = ranks(kind)
        if some and len(some) != len(following):
            return "diverged", some
    if ranks("control"):
        return "control", ranks("control")
    for kind, name in (("fail", "failed"), ("reject", "rejected"), ("found", "found")):
        if ranks(kind):
            return name, ranks(kind)
    if ranks("released"):
        return "diverged", ranks("released")
    return "passed", []
