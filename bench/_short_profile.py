"""A pytest plugin for ``bench/sim_throughput.py --marginal``: the ``ci``
profile cut to one example per property (``ci-1``), to time what a run costs
apart from its examples (start-up, imports, collection, exit)."""

from hypothesis import settings

import launch.hypo.profiles  # noqa: F401  (registers ``ci``)

settings.register_profile("ci-1", settings.get_profile("ci"), max_examples=1)
