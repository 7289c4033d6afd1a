"""One rank process: ``core`` (join, log, run one test, agree), ``subworld``
(a smaller world inside a larger one), ``watchdog`` (hangs, dead peers,
termination), ``procs`` (ending a launched world's processes)."""
