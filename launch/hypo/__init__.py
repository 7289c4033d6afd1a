"""Hypothesis in lockstep across ranks.

``engine`` (the one seam to a ``@given`` test's run, which every layer of the
service goes through), ``lockstep`` (the plugin: every Hypothesis run inside
a multi-rank test runs in step on its ranks), ``run`` (one such run: seed,
per-example exchange, verdict), ``db`` (the example database, read by rank 0
only), ``profiles`` (the opt-in ``ci``/``dev``/``fuzz`` profiles).
"""
