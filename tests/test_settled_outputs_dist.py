"""Covers: ``Sharding.settled`` (dtensor/sharding.py), planned in
dtensor/dispatch/propagate.py and applied in dtensor/dispatch/execute.py:
a rule computes its outputs in one layout and returns them in another, on
the first call and on every call its plan serves; a settled layout that
does not fit the outputs is refused on every rank, naming the op and rule.
"""

from __future__ import annotations

import pytest
import torch

import dtensor
from dtensor import DeviceMesh, Partial, Replicate, Shard, Sharding, register_rule
from dtensor.debug import CommDebugMode
from dtensor.dispatch.guard import RuleOutputError

_lib = torch.library.Library("dtensor_settled_test", "DEF")
_lib.define("colsum(Tensor x) -> Tensor")
_lib.define("colsum_bad(Tensor x) -> Tensor")
_lib.define("colsum_local(Tensor x) -> Tensor")
for _name in ("colsum", "colsum_bad", "colsum_local"):
    _lib.impl(_name, lambda x: x.sum(0), "CompositeExplicitAutograd")
COLSUM = torch.ops.dtensor_settled_test.colsum.default
COLSUM_BAD = torch.ops.dtensor_settled_test.colsum_bad.default
COLSUM_LOCAL = torch.ops.dtensor_settled_test.colsum_local.default


@register_rule(COLSUM)
def _colsum_rule(call):
    (spec,) = call.specs
    if spec.placements != (Shard(0),):
        return None
    # local column sums are pieces of the global ones; hand them back whole
    return Sharding(inputs=(None,), outputs=((Partial(),),), settled=((Replicate(),),))


def _local_colsum(func, coord, out_specs, args, kwargs):
    # a local function computes the outputs in the layout before settling
    if [s.placements for s in out_specs] != [(Partial(),)]:
        raise AssertionError(f"local function got {out_specs}")
    return args[0].sum(0)


@register_rule(COLSUM_LOCAL)
def _colsum_local_rule(call):
    return Sharding(inputs=((Shard(0),),), outputs=((Partial(),),),
                    settled=((Replicate(),),), local=_local_colsum)


@register_rule(COLSUM_BAD)
def _colsum_bad_rule(call):
    return Sharding(inputs=(None,), outputs=((Partial(),),),
                    settled=((Replicate(),), (Replicate(),)))


@pytest.mark.world_size(2)
def test_a_rule_settles_its_outputs_on_every_call(world) -> None:
    mesh = DeviceMesh("cpu", list(range(world.size)))
    full = torch.arange(30.0).reshape(10, 3)
    x = dtensor.distribute_tensor(full, mesh, [Shard(0)])
    for _ in range(3):  # the first call plans; the others reuse the plan
        with CommDebugMode() as comm:
            out = COLSUM(x)
        assert out.placements == (Replicate(),)
        torch.testing.assert_close(out.to_local(), full.sum(0))
        assert comm.get_total_counts() == 1, comm.get_comm_counts()


@pytest.mark.world_size(2)
def test_a_local_function_computes_the_outputs_before_they_settle(world) -> None:
    mesh = DeviceMesh("cpu", list(range(world.size)))
    full = torch.arange(21.0).reshape(7, 3)
    for _ in range(2):
        out = COLSUM_LOCAL(dtensor.distribute_tensor(full, mesh, [Replicate()]))
        assert out.placements == (Replicate(),)
        torch.testing.assert_close(out.to_local(), full.sum(0))


@pytest.mark.world_size(2)
def test_settled_placements_that_do_not_fit_the_outputs_are_refused(world) -> None:
    mesh = DeviceMesh("cpu", list(range(world.size)))
    x = dtensor.distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    with pytest.raises(RuleOutputError, match="colsum_bad.*_colsum_bad_rule.*settled"):
        COLSUM_BAD(x)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("reduce", [
    lambda t: t.sum(), lambda t: t.sum(0), lambda t: t.sum((0, 1), keepdim=True)],
    ids=["sum", "sum0", "sum01"])
def test_a_sum_of_average_pieces_returns_its_result_whole(world, reduce) -> None:
    mesh = DeviceMesh("cpu", list(range(world.size)))
    g = torch.Generator().manual_seed(7)
    pieces = [torch.randn(4, 5, generator=g) for _ in range(world.size)]
    p = dtensor.DTensor.from_local(pieces[world.rank], mesh, [Partial("avg")])
    out = reduce(p)
    assert out.placements == (Replicate(),)
    torch.testing.assert_close(out.to_local(), reduce(sum(pieces) / world.size))
    # read whole by several ops: no further collective
    with CommDebugMode() as comm:
        (out / out.sum() + out.max()).full_tensor()
    assert comm.get_total_counts() == 0, comm.get_comm_counts()


@pytest.mark.world_size(2)
def test_a_mean_of_average_pieces_stays_pieces(world) -> None:
    # as PyTorch's DTensor: batch norm writes such means into running
    # statistics that are pieces too
    mesh = DeviceMesh("cpu", list(range(world.size)))
    p = dtensor.DTensor.from_local(torch.full((4, 5), float(world.rank)), mesh,
                                   [Partial("avg")])
    with CommDebugMode() as comm:
        out = p.mean(1)
    assert out.placements == (Partial("avg"),) and comm.get_total_counts() == 0
    torch.testing.assert_close(out.full_tensor(), torch.full((4,), (world.size - 1) / 2))
