"""Simulated worlds: n ranks as n threads of one process.

``world`` (the rank threads and their outcomes), ``turn`` (one rank thread
runs at a time), ``threaded`` (c10d on rank threads, with the turn),
``fanout`` (one Hypothesis engine, each example on every rank), ``draws``
(``st.data()`` draws shared by the ranks), ``copies`` (which drawn values a
rank may get as a copy).
"""
