"""Registers the distributed test service (``launch``) for this repository.

``launch.plugin`` is the service (worlds, lockstep agreement, watchdog);
``launch.hypothesis_lockstep`` (the property suite's plugin: lockstep
Hypothesis, profiles, the ``impl`` fixture) builds on it.
"""

pytest_plugins = ["launch.plugin", "launch.hypothesis_lockstep"]
