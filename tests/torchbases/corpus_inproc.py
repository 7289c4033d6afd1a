"""Corpus: classes of PyTorch's in-process bases (threads:
``MultiThreadedTestCase``, ``DTensorOpTestBase``; ``LocalTensorMode`` over a
fake group: ``LocalDTensorTestBase``, ``LocalDTensorOpTestBase``,
``LocalDTensorContinuousTestBase``), written for their own harness, and a
``DTensorTestBase`` class that the LocalTensor variant is made from. Run by
``test_corpus.py`` (see ``corpus_procs.py``); the same verdict in every mode.
"""

import unittest

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.common_distributed import MultiThreadedTestCase
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorContinuousTestBase,
    DTensorOpTestBase,
    DTensorTestBase,
    LocalDTensorContinuousTestBase,
    LocalDTensorOpTestBase,
    create_local_tensor_test_class,
    with_comms,
)

EXPECTED = {
    "Threads::test_all_reduce": "passed",
    "Threads::test_fails_on_rank_1_only": "failed",
    "Threads::test_skip_on_every_rank": "skipped",
    "OpThreads::test_shard_then_replicate": "passed",
    "Sharding::test_shard_then_full_tensor": "passed",
    "Sharding::test_skipped_in_every_harness": "skipped",
    "ShardingWithLocalTensor::test_shard_then_full_tensor": "passed",
    "ShardingWithLocalTensor::test_skipped_in_every_harness": "skipped",
    "OpThreadsWithLocalTensor::test_shard_then_replicate": "passed",
    "MeshOnceWithLocalTensor::test_replicate": "passed",
    "MeshOnceWithLocalTensor::test_wrong_expectation": "failed",
}


class Threads(MultiThreadedTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_threads()

    def test_all_reduce(self):
        t = torch.ones(2) * (self.rank + 1)
        dist.all_reduce(t)
        self.assertEqual(t, torch.full((2,), 3.0))

    def test_fails_on_rank_1_only(self):
        self.assertNotEqual(self.rank, 1, msg="rank 1 disagrees")

    def test_skip_on_every_rank(self):
        self.skipTest("not on this platform")


class OpThreads(DTensorOpTestBase):
    @property
    def world_size(self):
        return 4

    @with_comms  # the LocalTensor variant joins its fake group here
    def test_shard_then_replicate(self):
        mesh = self.build_device_mesh()
        x = torch.arange(12.0).reshape(4, 3)
        d = distribute_tensor(x, mesh, [Shard(0)])
        self.assertEqual(d.redistribute(mesh, [Replicate()]).to_local(), x)


class Sharding(DTensorTestBase):
    @property
    def world_size(self):
        return 4

    @with_comms
    def test_shard_then_full_tensor(self):
        mesh = self.build_device_mesh()
        x = torch.arange(16.0).reshape(4, 4)
        d = distribute_tensor(x, mesh, [Shard(1)])
        self.assertEqual((d + 1).full_tensor(), x + 1)

    @unittest.skip("skipped on purpose")
    @with_comms
    def test_skipped_in_every_harness(self):
        raise AssertionError("never runs")


class MeshOnce(DTensorContinuousTestBase):
    world_size = 4

    def test_replicate(self):
        mesh = self.build_device_mesh()
        d = distribute_tensor(torch.ones(3), mesh, [Replicate()])
        self.assertEqual(d.full_tensor(), torch.ones(3))

    def test_wrong_expectation(self):
        mesh = self.build_device_mesh()
        d = distribute_tensor(torch.ones(3), mesh, [Replicate()])
        self.assertEqual(d.full_tensor(), torch.zeros(3))


ShardingWithLocalTensor = create_local_tensor_test_class(Sharding)
OpThreadsWithLocalTensor = create_local_tensor_test_class(
    OpThreads, base_class=LocalDTensorOpTestBase)
MeshOnceWithLocalTensor = create_local_tensor_test_class(
    MeshOnce, base_class=LocalDTensorContinuousTestBase)
del MeshOnce  # its process-world form is covered by corpus_continuous.py

if __name__ == "__main__":
    run_tests()
