"""This repository's pytest setup: options only, no plugin of its own.

The test service (``launch.plugin``) comes from the ``pytest11`` entry point
once the project is installed (``pip install -e .``); naming it here as well
lets a bare checkout run too (pytest skips a plugin it already has under
that name, so it is never registered twice). ``launch.hypo.profiles``
(lockstep Hypothesis and the ``ci``/``dev``/``fuzz`` profiles) is opt-in, so
the property suite's repository loads it here; the suite's own options
(``--dtensor-impl``, mutants) live in ``tests/properties/conftest.py``.
"""

# launch.fuzz.replay: stored fuzzing failures (.fuzz-db or LAUNCH_FUZZ_DB) run
# first (docs/fuzzing.md); a no-op when there is no such database.
pytest_plugins = ["launch.plugin", "launch.hypo.profiles", "launch.fuzz.replay"]
