"""Covers: dtensor/mesh.py sub-meshes, dtensor/dispatch/ and
dtensor/tensor.py on ranks outside a mesh.

Property: on meshes that leave some ranks of the world out, distribute,
redistribute and ops give the mesh's ranks the single-device answer, while
the ranks outside get empty local results of the right dtype (Python
scalars: the runtime returns None, which torch's schema for ``equal`` turns
into False) and issue no collectives (so nothing can hang).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dtensor.testing import (
    assert_local_is_empty,
    assert_matches_single_device,
    placements,
    sub_meshes,
    tensors,
)
from dtensor.testing.op_table import FAMILIES, draw_op, op_tolerances, reference

pytestmark = pytest.mark.dist_timeout(120)


def _need_sub_meshes(impl):
    if not impl.sub_meshes:
        pytest.skip(f"{impl.name}: DeviceMesh construction is collective over the whole "
                    "world, so meshes that leave ranks out cannot be built by members only")


@given(data=st.data())
def test_outsiders_get_empty_results_and_issue_no_collectives(n_ranks, world, impl, data):
    _need_sub_meshes(impl)
    layout = data.draw(sub_meshes(world_size=world.size))
    family = data.draw(st.sampled_from(FAMILIES))
    op = draw_op(data, family=family, mesh_ndim=layout.ndim)
    case, dtype, xs, pls = op
    dst = data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=xs[0].ndim))
    expected = reference(case, xs)
    mesh = impl.mesh(layout)
    inside = layout.coordinate_of(world.rank) is not None
    with impl.comm_counter() as comm:
        dts = [impl.distribute_tensor(x, mesh, impl.placements(p))
               for x, p in zip(xs, pls, strict=True)]
        moved = dts[0].redistribute(mesh, impl.placements(dst))
        out = case.fn(*dts)
    if not inside:
        assert comm.total == 0, (
            f"rank {world.rank} is outside {layout} but issued {comm.total} collectives: "
            f"{getattr(comm, 'counts', '')}")
        for t in (*dts, moved, out):
            assert_local_is_empty(t.to_local(), t.dtype, f" {layout}")
    assert_matches_single_device(moved, xs[0], msg=f"redistribute {pls[0]} -> {dst}")
    assert_matches_single_device(out, expected, **op_tolerances(case, dtype),
                                 msg=f"{case.name} on {[str(p) for p in pls]}")


@given(data=st.data())
def test_scalar_results_are_none_outside(n_ranks, world, impl, data):
    _need_sub_meshes(impl)
    layout = data.draw(sub_meshes(world_size=world.size))
    x = data.draw(tensors())
    ps = data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=x.ndim))
    mesh = impl.mesh(layout)
    with impl.comm_counter() as comm:
        dt = impl.distribute_tensor(x, mesh, impl.placements(ps))
        same = dt.equal(dt)
    if layout.coordinate_of(world.rank) is None:
        assert comm.total == 0
        # The runtime returns None; torch's bool schema turns it into False.
        assert same in (None, False), f"outsider rank {world.rank} got {same!r} from equal()"
    else:
        expected = torch.equal(x, x)  # False when x holds a nan
        assert same is expected, f"rank {world.rank}: equal(x, x) gave {same!r}, " \
            f"single device {expected!r}"


@given(data=st.data())
def test_default_src_data_rank_works_on_every_sub_mesh(n_ranks, world, impl, data):
    # distribute_tensor's default source must exist on every mesh (torch: group
    # rank 0 of each mesh axis), and any error must be raised on every rank.
    _need_sub_meshes(impl)
    layout = data.draw(sub_meshes(world_size=world.size))
    x = data.draw(tensors())
    ps = data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=x.ndim))
    dt = impl.distribute_tensor(x, impl.mesh(layout), impl.placements(ps))
    assert_matches_single_device(dt, x)
