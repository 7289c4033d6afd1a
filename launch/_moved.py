"""Module names the service no longer has, and where their code lives now.

``import launch.lockstep`` (or ``-p launch.lockstep``) fails with a
``ModuleNotFoundError`` that names the new module, instead of a bare "no
module named". The plugin spellings users put in configs
(``launch.hypothesis_lockstep``, ``launch.given_lockstep``) are still modules
that load the new ones.
"""

from __future__ import annotations

import importlib.abc
import sys

MOVED = {
    "launch.lockstep": "launch.modes.lockstep",
    "launch.server": "launch.modes.server",
    "launch.parent": "launch.modes.parent",
    "launch.sim_mode": "launch.modes.simulated",
    "launch.sim_fanout": "launch.sim.fanout",
    "launch.subworld": "launch.rank.subworld",
    "launch.watchdog": "launch.rank.watchdog",
    "launch.procs": "launch.rank.procs",
    "launch.lockstep_db": "launch.hypo.db",
}


class _Finder(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: asked only for names no other finder found."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        new = MOVED.get(name)
        if new is not None:
            raise ModuleNotFoundError(
                f"{name} is now {new}: the test service is laid out by concept "
                "(docs/test-service.md, module map); import or -p the new name",
                name=name)


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
