"""Corpus: classes of PyTorch's process-per-rank bases, written for their own
harness (nothing here knows the service). Not collected by ``pytest tests/``
(the file name does not match ``test_*.py``): ``test_corpus.py`` runs it by
the bases' own harness and by the service in each mode and compares the
verdict of every method. ``EXPECTED`` maps each method to its verdict under both, or to (its own
harness, the service) where they differ on purpose.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.testing._internal import common_distributed
from torch.testing._internal.common_distributed import (
    MultiProcessTestCase,
    skip_if_lt_x_gpu,
)
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorTestBase,
    with_comms,
)

# Both harnesses read the base's per-test timeout table.
common_distributed.TIMEOUT_OVERRIDE["test_hangs_rank0_in_all_reduce"] = 8

EXPECTED = {
    "Collectives::test_all_reduce_over_a_file_store": "passed",
    "Collectives::test_file_name_is_one_file_for_every_rank": "passed",
    "Collectives::test_skip_test_on_every_rank": "skipped",
    "Collectives::test_skip_if_lt_x_gpu": "skipped",
    "Collectives::test_exit_code_the_test_expects": "passed",
    "Collectives::test_fails_on_rank_1_only": "failed",
    "Collectives::test_fine_after_the_failure": "passed",
    # the service has no spawned processes to judge: a skip naming the reason
    "ExitCodes::test_rank_1_exits_with_5": ("passed", "skipped"),
    "Mesh::test_build_device_mesh_and_assert_equal_on_dtensors": "passed",
    "Mesh::test_redistribute_placement0": "passed",
    "Mesh::test_redistribute_placement1": "passed",
    "Mesh::test_destroy_inside_a_test_keeps_the_next_one_working": "passed",
    "Mesh::test_rank_1_dies_before_a_collective": "failed",
    "Mesh::test_runs_after_a_dead_rank": "passed",
    "Mesh::test_hangs_rank0_in_all_reduce": "failed",
    "Mesh::test_healthy_after_a_hang": "passed",
}


class Collectives(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        fn = self.test_exit_code_the_test_expects  # wrapped when it is this test
        self.special_return_code_checks[getattr(fn, "__wrapped__", fn)] = 3
        self._spawn_processes()

    def _join(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank,
                                world_size=self.world_size)
        return store

    def test_all_reduce_over_a_file_store(self):
        self._join()
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        self.assertEqual(t, torch.tensor([3.0]))
        self.assertEqual(dist.get_world_size(), self.world_size)
        dist.destroy_process_group()

    def test_file_name_is_one_file_for_every_rank(self):
        store = self._join()
        if self.rank == 0:
            store.set("from_rank0", "hello")
        self.assertEqual(store.get("from_rank0"), b"hello")
        dist.barrier()
        dist.destroy_process_group()

    def test_skip_test_on_every_rank(self):
        self.skipTest("not on this platform")

    @skip_if_lt_x_gpu(2)
    def test_skip_if_lt_x_gpu(self):
        raise AssertionError("needs two GPUs: never runs here")

    def test_exit_code_the_test_expects(self):
        sys.exit(3)

    def test_fails_on_rank_1_only(self):
        self._join()
        t = torch.ones(1)
        dist.all_reduce(t)
        self.assertEqual(t.item(), 2.0)
        if self.rank == 1:
            self.assertEqual(self.rank, 0, msg="rank 1 disagrees")
        dist.destroy_process_group()

    def test_fine_after_the_failure(self):
        self._join()
        dist.barrier()
        dist.destroy_process_group()



class ExitCodes(MultiProcessTestCase):
    """Judges every rank's exit code itself, from the spawned processes."""

    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _check_return_codes(self, fn, elapsed_time):
        self.assertEqual([p.exitcode for p in self.processes], [0, 5])

    def test_rank_1_exits_with_5(self):
        if self.rank == 1:
            sys.exit(5)


class Mesh(DTensorTestBase):
    @property
    def world_size(self):
        return 4

    @with_comms
    def test_build_device_mesh_and_assert_equal_on_dtensors(self):
        mesh = self.build_device_mesh()
        self.assertEqual(mesh.size(), self.world_size)
        x = torch.arange(16.0).reshape(8, 2)
        d = distribute_tensor(x, mesh, [Shard(0)])
        self.assertEqual(d.to_local(), x[2 * self.rank:2 * self.rank + 2])
        self.assertEqual(d.full_tensor(), x)
        r = DTensor.from_local(torch.ones(2), mesh, [Replicate()])
        self.assertEqual(r, distribute_tensor(torch.ones(2), mesh, [Replicate()]))
        self.assertEqual(self.device_type, "cpu")
        self.assertEqual(self.backend, "gloo")

    @with_comms
    @parametrize("placement", [Shard(0), Replicate()])
    def test_redistribute(self, placement):
        mesh = self.build_device_mesh()
        x = torch.arange(8.0)
        d = distribute_tensor(x, mesh, [placement]).redistribute(mesh, [Replicate()])
        self.assertEqual(d.to_local(), x)

    def test_destroy_inside_a_test_keeps_the_next_one_working(self):
        self.init_pg(eager_init=False)
        t = torch.ones(1)
        dist.all_reduce(t)
        self.assertEqual(t.item(), 4.0)
        self.destroy_pg()

    @with_comms
    def test_rank_1_dies_before_a_collective(self):
        if self.rank == 1:
            os._exit(1)
        t = torch.ones(1)
        dist.all_reduce(t)

    @with_comms
    def test_runs_after_a_dead_rank(self):
        t = torch.ones(1)
        dist.all_reduce(t)
        self.assertEqual(t.item(), 4.0)

    @with_comms
    def test_hangs_rank0_in_all_reduce(self):
        if self.rank == 0:
            dist.all_reduce(torch.ones(1))
        else:
            time.sleep(3600)

    @with_comms
    def test_healthy_after_a_hang(self):
        self.assertEqual(self.build_device_mesh().size(), 4)


instantiate_parametrized_tests(Mesh)

if __name__ == "__main__":
    run_tests()
