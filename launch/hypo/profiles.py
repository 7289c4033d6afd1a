"""Hypothesis profiles for distributed suites, opt-in: ``ci``, ``dev``, ``fuzz``.

Load it with ``-p launch.hypo.profiles`` or from a conftest's
``pytest_plugins`` (this repository's root conftest does) and pick a profile
with ``--hypothesis-profile``. The lockstep itself (every rank draws the same
examples, agreed verdicts, divergence reports) is ``launch.hypo.lockstep``,
part of the installed service; this module only adds the profiles, which the
service does not impose on every repository (a repository's own ``ci``
profile, or Hypothesis' built-in one, stays as it is without this module).

Every profile turns off what differs between processes (deadlines, timing
health checks, the ``explain`` phase); lockstep turns them off anyway.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings

from launch.hypo.db import mirror_db_class as _mirror_db_class
from launch.hypo.run import LockstepDivergence, RankFailure

__all__ = ["LockstepDivergence", "RankFailure"]

pytest_plugins = ["launch.hypo.lockstep"]  # also when loaded without the service

_MirrorDB = _mirror_db_class()  # for tests that drive the database mirror directly
_TIMING_CHECKS = [HealthCheck.too_slow, HealthCheck.differing_executors,
                  HealthCheck.function_scoped_fixture]
_PHASES = tuple(p for p in Phase if p != Phase.explain)

settings.register_profile(
    "ci", derandomize=True, deadline=None, database=None, print_blob=True,
    max_examples=25, suppress_health_check=_TIMING_CHECKS, phases=_PHASES)
settings.register_profile(
    "dev", deadline=None, print_blob=True, max_examples=40,
    suppress_health_check=_TIMING_CHECKS, phases=_PHASES)
settings.register_profile(
    "fuzz", deadline=None, print_blob=True, max_examples=2000,
    suppress_health_check=_TIMING_CHECKS, phases=_PHASES)
