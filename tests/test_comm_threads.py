"""Covers: dtensor/debug.py ``CommDebugMode``/``CommCounter`` entered on a
rank thread of an in-process world (PyTorch's ``MultiThreadedTestCase``)
before that thread touched any DTensor (the mesh built inside the ``with``):
the mode counts that rank's collectives (``dtensor._rank_state.auto_enter``
at entry). Runs in a fresh interpreter: the base installs its threaded
world process-wide."""

from __future__ import annotations

from pathlib import Path

import pytest
from _user_repo import run_in

pytest.importorskip("expecttest", reason="torch's test bases need expecttest (test extra)")

SUITE = '''
import torch
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.common_distributed import MultiThreadedTestCase

from dtensor import DeviceMesh, Replicate, Shard, distribute_tensor
from dtensor.debug import CommCounter, CommDebugMode


class CountsOnThreads(MultiThreadedTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_threads()

    def test_mode_entered_before_the_first_dtensor_call_counts(self):
        with CommDebugMode() as comm, CommCounter() as c:
            mesh = DeviceMesh("cpu", [0, 1])
            d = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)], src_data_rank=None)
            d.redistribute(mesh, [Replicate()])
        self.assertEqual(comm.get_comm_counts()["all_gather"], 1)
        self.assertEqual(comm.get_total_counts(), 1)
        self.assertEqual(c.counts, {"all_gather": 1})


if __name__ == "__main__":
    run_tests()
'''


def test_comm_debug_mode_counts_on_a_fresh_rank_thread(user_repo: Path) -> None:
    (user_repo / "test_counts.py").write_text(SUITE)
    p = run_in(user_repo, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_counts.py",
               timeout=600)
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout[-6000:]
