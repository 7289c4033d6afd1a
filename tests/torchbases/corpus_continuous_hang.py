"""Corpus: a ``MultiProcContinuousTest`` class with a method that hangs on
one rank. Its own harness never ends this class (the class teardown waits
for the hung worker forever), so ``test_corpus.py`` runs it by the service
only: the hang is reported in bounded time and the next method passes.
"""

import time

import torch
import torch.distributed as dist
from torch.testing._internal import common_distributed
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import run_tests

common_distributed.TIMEOUT_OVERRIDE["test_b_hangs_on_rank_1"] = 5

EXPECTED = {
    "ContinuousHang::test_a_before": "passed",
    "ContinuousHang::test_b_hangs_on_rank_1": "failed",
    "ContinuousHang::test_c_after_the_hang": "passed",
}


class ContinuousHang(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "gloo"

    def test_a_before(self):
        dist.barrier()

    def test_b_hangs_on_rank_1(self):
        if self.rank == 0:
            dist.all_reduce(torch.ones(1))
        else:
            time.sleep(3600)

    def test_c_after_the_hang(self):
        t = torch.ones(1)
        dist.all_reduce(t)
        self.assertEqual(t.item(), 2.0)


if __name__ == "__main__":
    run_tests()
