"""Fuzzing sessions: ``python -m launch fuzz`` (see ``launch.fuzz.cli``).

Modules: ``cli`` (the launcher: worlds, restarts, live view, report),
``rank`` (the loop on every rank), ``scheduler`` (which property next),
``probe`` (what one example did), ``session`` (the state), ``report``,
``live``, ``replay`` (later runs replay the database first).
"""
