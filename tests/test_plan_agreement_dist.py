"""Covers: dtensor/parallel/api.py — a plan that fails or differs on one rank
is a ``PlanError`` on every rank, not a transport error from the
parameters' broadcast; the comparison issues no collective."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtensor import DeviceMesh
from dtensor.debug import CommCounter
from dtensor.parallel import ColwiseParallel, PlanError, RowwiseParallel, parallelize_module

pytestmark = [pytest.mark.world_size(2), pytest.mark.dist_timeout(120)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def test_a_plan_failing_on_one_rank_fails_on_every_rank(world) -> None:
    mesh = DeviceMesh("cpu", list(range(world.size)))
    key = "0" if world.rank == 0 else "no_such_layer"  # rank 1 mistypes the key
    with CommCounter() as comm, pytest.raises(PlanError) as e:
        parallelize_module(_model(), mesh, {key: ColwiseParallel(), "2": RowwiseParallel()})
    assert comm.total == 0
    if world.rank == 0:
        assert "failed on rank(s) [1]" in str(e.value) and "no_such_layer" in str(e.value)
    # The world is still usable: the same (agreeing) plan then works everywhere.
    parallelize_module(_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def test_plans_that_differ_across_ranks_are_reported_on_every_rank(world) -> None:
    mesh = DeviceMesh("cpu", list(range(world.size)))
    first = ColwiseParallel() if world.rank == 0 else RowwiseParallel()
    with pytest.raises(PlanError, match=r"different plans \(ranks grouped by plan: \[\[0\], \[1\]\]\)"):
        parallelize_module(_model(), mesh, {"0": first})
