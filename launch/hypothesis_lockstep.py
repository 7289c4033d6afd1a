"""``-p launch.hypothesis_lockstep``: the older spelling of
``launch.hypo.profiles`` (the opt-in ``ci``/``dev``/``fuzz`` profiles).

It loads that plugin and re-exports its names, so configs and imports that use
this spelling keep working; new configs name ``launch.hypo.profiles``.
"""

from __future__ import annotations

from launch.hypo.profiles import LockstepDivergence, RankFailure, _MirrorDB

__all__ = ["LockstepDivergence", "RankFailure", "_MirrorDB"]

pytest_plugins = ["launch.hypo.profiles"]
