"""Covers: ``DTensor.from_local(run_check=True)`` (dtensor/tensor.py,
dtensor/_local_check.py).

Properties, on 1-D to 3-D meshes over the world, with ``shape=`` given or
not:

- good blocks (every rank its ``torch.chunk`` block, uneven and empty ones
  included) give the global tensor, every rank holding its block;
- one rank's bad block — one row too many, an extra dim, another dtype —
  is rejected on every rank with a ``ValueError`` (no rank returns, none
  hangs);
- under ``Replicate``, a rank holding other values than the mesh axis's
  first rank ends up with the first rank's values (PyTorch's documented
  behaviour), so the result is the first rank's tensor.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dtensor.testing import assert_matches_single_device, distributed_inputs, dtypes

KINDS = ("good", "extra_row", "extra_dim", "dtype", "replica_values")


def _bad_block(local: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "extra_row":
        if local.ndim == 0:
            return local.reshape(1).repeat(2)
        return torch.cat([local, local.new_zeros((1, *local.shape[1:]))], 0)
    if kind == "extra_dim":
        return local.unsqueeze(0)
    if kind == "dtype":
        return local.to(torch.float64 if local.dtype != torch.float64 else torch.float32)
    return local + 1  # replica_values


@given(data=st.data())
def test_run_check_accepts_good_blocks_and_rejects_bad_ones_everywhere(
        n_ranks, world, impl, data):
    inp = data.draw(distributed_inputs(
        world_size=world.size, mesh_factory=impl.mesh, allow_partial=False,
        dtype=dtypes(include=(torch.float32, torch.int64)), fills=("arange", "small")),
        label="input")
    kind = data.draw(st.sampled_from(KINDS), label="kind")
    # Without shape=, one more row on a shard can be a valid uneven layout of
    # a larger tensor: an extra row is bad input only against a given shape.
    give_shape = kind == "extra_row" or data.draw(st.booleans(), label="shape= given")
    layout, ps = inp.layout, inp.placements
    # replica_values: a rank off coordinate 0 of a Replicate axis (if any).
    replicated = [a for a, p in enumerate(ps) if not p.is_shard() and layout.shape[a] > 1]
    if kind == "replica_values" and not replicated:
        kind = "good"
    if kind == "replica_values":
        axis = data.draw(st.sampled_from(replicated), label="replicate axis")
        bad = [r for r in layout.ranks if layout.coordinate_of(r)[axis] != 0]
    else:
        bad = list(layout.ranks)
    bad_rank = data.draw(st.sampled_from(bad), label="bad rank")
    local = impl.from_blocks(inp.tensor, inp.mesh, ps).to_local().clone()
    if kind != "good" and world.rank == bad_rank:
        local = _bad_block(local, kind)
    shape = tuple(inp.tensor.shape) if give_shape else None
    what = (f"from_local(run_check=True, shape={shape}) on {ps} of {layout}, "
            f"rank {bad_rank}'s block {kind}")
    raised = None
    try:
        dt = impl.DTensor.from_local(local, inp.mesh, impl.placements(ps), run_check=True,
                                     shape=shape)
    except ValueError as e:
        raised = e
    if kind in ("good", "replica_values"):
        assert raised is None, f"rank {world.rank}: {what}: raised {raised!r}"
        assert_matches_single_device(dt, inp.tensor, msg=what)
    elif raised is None:
        pytest.fail(f"rank {world.rank}: {what}: returned {dt.shape} instead of raising "
                    "a ValueError on every rank")
