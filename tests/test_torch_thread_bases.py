"""Covers: PyTorch's thread-per-rank test bases (``MultiThreadedTestCase``,
``DTensorOpTestBase``) driving our DTensor with only the import swapped.

Those bases start n rank threads over PyTorch's threaded process group in
the test's own process and never tell the runtime which thread is which rank;
the runtime must keep rank state per thread by itself
(``dtensor._rank_state.auto_enter``): before it, every rank shared one
generator, so a sharded ``rand`` after ``torch.manual_seed`` drew another
stream than the single-device one. The suite runs in a fresh interpreter
(the bases install their threaded world process-wide), from plain pytest and
under torchrun, where the service runs each class once, on rank 0, with c10d
holding a world of its own (``launch/torchbases``) and the verdict agreed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("expecttest", reason="torch's test bases need expecttest (test extra)")

ROOT = Path(__file__).resolve().parents[1]

SUITE = '''
import torch
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.common_distributed import MultiThreadedTestCase
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorOpTestBase

import dtensor
from dtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor


class OpsOnThreads(DTensorOpTestBase):
    @property
    def world_size(self):
        return 4

    def mesh(self):
        return DeviceMesh(self.device_type, list(range(self.world_size)))

    def test_pointwise_then_replicate(self):
        x = torch.arange(48.0).reshape(8, 6) - 20
        d = distribute_tensor(x, self.mesh(), [Shard(0)])
        y = (d * 2 + 1).relu()
        self.assertEqual(y.to_local(), ((x * 2 + 1).relu())[2 * self.rank:2 * self.rank + 2])
        self.assertEqual(y.redistribute(self.mesh(), [Replicate()]).to_local(),
                         (x * 2 + 1).relu())

    def test_partial_sums_over_ranks(self):
        p = DTensor.from_local(torch.ones(3) * (self.rank + 1), self.mesh(), [Partial()])
        self.assertEqual(p.full_tensor(), torch.full((3,), 10.0))

    def test_uneven_reductions(self):
        x = torch.arange(20.0).reshape(5, 4)
        d = distribute_tensor(x, self.mesh(), [Shard(0)])
        self.assertEqual(d.mean().full_tensor(), x.mean())
        self.assertEqual(d.sum(0).full_tensor(), x.sum(0))

    def test_rand_after_torch_manual_seed_is_the_single_device_stream(self):
        torch.manual_seed(5)
        r = dtensor.rand(8, 4, device_mesh=self.mesh(), placements=[Shard(0)])
        torch.manual_seed(5)
        whole = dtensor.random.rand(8, 4)  # single device, this rank's generator
        self.assertEqual(r.full_tensor(), whole, atol=0, rtol=0)
        self.assertEqual(r.to_local(), whole[2 * self.rank:2 * self.rank + 2], atol=0, rtol=0)

    def test_dropout_replicas_agree(self):
        torch.manual_seed(3)
        x = distribute_tensor(torch.ones(6, 6), self.mesh(), [Replicate()])
        y = torch.nn.functional.dropout(x, 0.5)
        gathered = [torch.empty(6, 6) for _ in range(self.world_size)]
        torch.distributed.all_gather(gathered, y.to_local().contiguous())
        for g in gathered[1:]:
            self.assertEqual(g, gathered[0], atol=0, rtol=0)


class CollectivesOnThreads(MultiThreadedTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_threads()

    def test_redistribute_with_autograd(self):
        mesh = DeviceMesh("cpu", [0, 1])
        x = torch.arange(6.0).reshape(3, 2).requires_grad_()
        d = distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_()
        (d.redistribute(mesh, [Replicate()]).to_local() ** 2).sum().backward()
        # Each rank's loss is over its replica; the gradient stays Replicate
        # (to_local's default grad placements), so it is one replica's: 2x.
        self.assertEqual(d.grad.full_tensor(), 2 * x.detach())


if __name__ == "__main__":
    run_tests()
'''


@pytest.mark.skipif("RANK" in os.environ,
                    reason="starts its own in-process world; run it with plain pytest")
@pytest.mark.parametrize("launcher", ["pytest", "torchrun"])
def test_pytorch_thread_per_rank_bases_drive_our_dtensor(tmp_path: Path, launcher: str) -> None:
    (tmp_path / "test_bases.py").write_text(SUITE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), OMP_NUM_THREADS="1")
    for k in ("PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST"):
        env.pop(k, None)
    start = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node=2"] if launcher == "torchrun" else [sys.executable])
    p = subprocess.run([*start, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "test_bases.py"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0 and "6 passed" in p.stdout, p.stdout[-4000:] + p.stderr[-2000:]


pytestmark = pytest.mark.slow  # starts several worlds or compiles: the full run, not the quick tier
