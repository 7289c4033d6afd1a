"""Covers: launch/modes/server.py's report keys: a fault report the
watchdog wrote for a test is not overwritten by the rank's own reports of
that test, which the main thread may publish later (it was still finishing
the test when a peer died); the parent then reads the fault report with its
dead ranks, not a plain failure beside an "X" verdict."""

from __future__ import annotations

import json

import torch.distributed as dist

from launch.modes.server import Server


def _server() -> Server:
    s = Server.__new__(Server)
    s.config = None  # no reports to serialise below
    return s


def test_a_fault_report_stays_when_the_rank_publishes_its_own_later() -> None:
    store, s = dist.HashStore(), _server()
    s._send(store, 7, [], fatal=True)
    s._send(store, 7, [])
    assert json.loads(store.get("rep/7"))["fatal"] is True


def test_the_rank_s_own_report_is_replaced_by_a_later_fault_report() -> None:
    store, s = dist.HashStore(), _server()
    s._send(store, 3, [])
    assert json.loads(store.get("rep/3"))["fatal"] is False
    s._send(store, 3, [], fatal=True)
    assert json.loads(store.get("rep/3"))["fatal"] is True
