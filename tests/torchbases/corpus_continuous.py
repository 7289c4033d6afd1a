"""Corpus: classes of PyTorch's one-world-per-class bases
(``MultiProcContinuousTest``, ``DTensorContinuousTestBase``), written for
their own harness. Run by ``test_corpus.py`` (see ``corpus_procs.py``).
``EXPECTED`` maps each method to (its own harness, the service): they differ
where the base's harness skips the rest of a class after a failure.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.common_distributed import (
    MultiProcContinuousTest,
    skip_if_lt_x_gpu,
)
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorContinuousTestBase,
)

EXPECTED = {
    "Continuous::test_a_all_reduce_on_the_class_group": ("passed", "passed"),
    "Continuous::test_b_skip_if_lt_x_gpu": ("skipped", "skipped"),
    "Continuous::test_c_fails_on_rank_1_only": ("failed", "failed"),
    # the base's harness skips the rest of the class after a failure
    "Continuous::test_d_after_the_failure": ("skipped", "passed"),
    "ContinuousMesh::test_mesh_of_the_class_world": ("passed", "passed"),
    "ContinuousMesh::test_uneven_shards": ("passed", "passed"),
}


class Continuous(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "gloo"

    def test_a_all_reduce_on_the_class_group(self):
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t, group=self.pg)
        self.assertEqual(t.item(), 1.0)
        self.assertEqual(dist.get_world_size(), self.world_size)

    @skip_if_lt_x_gpu(2)
    def test_b_skip_if_lt_x_gpu(self):
        raise AssertionError("needs two GPUs: never runs here")

    def test_c_fails_on_rank_1_only(self):
        dist.barrier()
        self.assertNotEqual(self.rank, 1, msg="rank 1 disagrees")

    def test_d_after_the_failure(self):
        t = torch.ones(1)
        dist.all_reduce(t)
        self.assertEqual(t.item(), 2.0)


class ContinuousMesh(DTensorContinuousTestBase):
    world_size = 4

    def test_mesh_of_the_class_world(self):
        mesh = self.build_device_mesh()
        x = torch.arange(8.0)
        d = distribute_tensor(x, mesh, [Shard(0)])
        self.assertEqual(d.to_local(), x[2 * self.rank:2 * self.rank + 2])
        self.assertEqual(d.full_tensor(), x)

    def test_uneven_shards(self):
        mesh = self.build_device_mesh()
        x = torch.arange(10.0).reshape(5, 2)
        d = distribute_tensor(x, mesh, [Shard(0)])
        self.assertEqual((d * 2).full_tensor(), x * 2)


if __name__ == "__main__":
    run_tests()
