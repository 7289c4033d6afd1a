"""``-p launch.given_lockstep``: the older spelling of ``launch.hypo.lockstep``
(Hypothesis in lockstep, which ``launch.plugin`` loads anyway).

It loads that plugin and re-exports its public names; new code names
``launch.hypo.lockstep``.
"""

from __future__ import annotations

from launch.hypo.lockstep import (
    RUN_NPROC_ENV,
    ExampleInWorldError,
    LockstepDivergence,
    RankFailure,
)

__all__ = ["RUN_NPROC_ENV", "ExampleInWorldError", "LockstepDivergence", "RankFailure"]

pytest_plugins = ["launch.hypo.lockstep"]
