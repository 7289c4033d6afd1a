"""PyTorch's distributed test bases, run unchanged on the service's worlds.

Test classes derived from ``torch.testing._internal``'s bases
(``MultiProcessTestCase``, ``DTensorTestBase`` with ``@with_comms``,
``MultiProcContinuousTest``, ``DTensorContinuousTestBase``) become ordinary
``world_size(n)`` items: every method runs on the ranks of a persistent
world of the class's ``world_size``, with the service's agreement, watchdog
and reports. The in-process bases (``MultiThreadedTestCase``,
``DTensorOpTestBase``, the ``LocalDTensor*`` bases) run once, in one
process, under every mode. See ``docs/test-service.md``.

Modules: ``kinds`` (which base a class derives from, its world size, what
cannot be honoured), ``ranked`` (a class as one rank of a running world),
``inproc`` (an empty c10d world for the in-process bases), ``items`` (the
pytest collector and item), ``hooks`` (the pytest hooks).
"""
