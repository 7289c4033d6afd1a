"""dtensor's test service: a pytest plugin and a torchrun launcher.

Any ``torch.distributed`` code can be tested with it; it never imports
``dtensor``. See ``docs/test-service.md``.

- ``launch.plugin``: the pytest plugin (options, markers, the ``world`` fixture).
- ``python -m launch``: a thin CLI over ``torch.distributed.run``.

Layout: ``world`` (what every mode shares), ``agree`` (one outcome from every
rank's), ``hookspecs`` (hooks a project implements); ``rank/`` (one rank
process: core, sub-worlds, watchdog, ending processes); ``hypo/`` (Hypothesis
in lockstep, its database, the profiles); ``sim/`` (simulated worlds: ranks as
threads, the turn, the example fan-out); ``modes/`` (lockstep, server, parent,
simulated); ``fuzz/`` (fuzzing sessions); ``plugin``, ``shuffle``, ``cli``.
"""

from launch import _moved

_moved.install()
