"""Corpus: classes of PyTorch's process bases for a run over two nodes
(``test_nodes.py``: two torchrun agents, ``--nnodes=2 --nproc-per-node=2``,
c10d rendezvous on this machine). Written for their own harness; the same
verdict for every method under it and under the service across the nodes.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorTestBase,
    with_comms,
)

EXPECTED = {
    "AcrossNodes::test_mesh_over_both_nodes": "passed",
    "AcrossNodes::test_fails_on_rank_3_only": "failed",
    "AcrossNodes::test_skip_on_every_rank": "skipped",
    "AcrossNodes::test_after_the_failure": "passed",
    "OnePair::test_two_ranks": "passed",
    "ClassWorld::test_a_all_reduce_on_the_class_group": "passed",
    "ClassWorld::test_b_shard_then_replicate": "passed",
}


class AcrossNodes(DTensorTestBase):
    @property
    def world_size(self):
        return 4

    @with_comms
    def test_mesh_over_both_nodes(self):
        mesh = self.build_device_mesh()
        x = torch.arange(12.0).reshape(6, 2)
        d = distribute_tensor(x, mesh, [Shard(0)])
        self.assertEqual(d.full_tensor(), x)
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        self.assertEqual(t.item(), 6.0)

    @with_comms
    def test_fails_on_rank_3_only(self):
        dist.barrier()
        self.assertNotEqual(self.rank, 3, msg="rank 3 disagrees")

    @with_comms
    def test_skip_on_every_rank(self):
        self.skipTest("not on this platform")

    @with_comms
    def test_after_the_failure(self):
        self.assertEqual(self.build_device_mesh().size(), 4)


class OnePair(DTensorTestBase):
    @property
    def world_size(self):
        return 2

    @with_comms
    def test_two_ranks(self):
        t = torch.ones(1)
        dist.all_reduce(t)
        self.assertEqual(t.item(), 2.0)


class ClassWorld(MultiProcContinuousTest):
    world_size = 4

    @classmethod
    def backend_str(cls):
        return "gloo"

    def test_a_all_reduce_on_the_class_group(self):
        t = torch.ones(1)
        dist.all_reduce(t, group=self.pg)
        self.assertEqual(t.item(), 4.0)

    def test_b_shard_then_replicate(self):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2))
        x = torch.arange(16.0).reshape(4, 4)
        d = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
        self.assertEqual(d.redistribute(mesh, [Replicate(), Replicate()]).to_local(), x)


if __name__ == "__main__":
    run_tests()
