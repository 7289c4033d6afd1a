"""Covers: dtensor/dispatch/guard.py (users' rules' output blocks checked before
wrapping) and dtensor/experimental.py (strategy functions see the schema's
default arguments), as a new user meets them."""

from __future__ import annotations

import pytest
import torch

from dtensor import (
    DeviceMesh,
    Replicate,
    Shard,
    Sharding,
    distribute_tensor,
    register_rule,
)
from dtensor.dispatch import check_builtin_rules
from dtensor.dispatch.guard import RuleOutputError
from dtensor.experimental import register_sharding


@torch.library.custom_op("dtensor_guard::colsum", mutates_args=())
def colsum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(0)


@colsum.register_fake
def _(x):
    return x.new_empty(x.shape[1:])


@register_rule(torch.ops.dtensor_guard.colsum.default)
def _wrong_colsum_rule(call):
    # Wrong: a column sum of row blocks is a Partial(sum), not row blocks.
    (spec,) = call.specs
    return Sharding(inputs=(None,), outputs=(spec.placements,))


@torch.library.custom_op("dtensor_guard::merge01", mutates_args=())
def merge01(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).clone()


@merge01.register_fake
def _(x):
    return x.new_empty((x.shape[0] * x.shape[1], x.shape[-1]))


@register_rule(torch.ops.dtensor_guard.merge01.default)
def _wrong_merge_rule(call):
    # Wrong on uneven blocks: Shard(0) of [3, 2, 4] is not Shard(0) of [6, 4].
    (spec,) = call.specs
    return Sharding(inputs=(None,), outputs=(spec.placements,))


@torch.library.custom_op("dtensor_guard::rowscale", mutates_args=())
def rowscale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@rowscale.register_fake
def _(x):
    return torch.empty_like(x)


@register_rule(torch.ops.dtensor_guard.rowscale.default)
def _right_rule(call):
    (spec,) = call.specs
    return Sharding(inputs=(None,), outputs=(spec.placements,))


@pytest.mark.world_size(2)
def test_column_sum_claimed_as_row_blocks_fails_on_every_rank(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    x = distribute_tensor(torch.arange(48.0).reshape(8, 6), mesh, [Shard(0)])
    with pytest.raises(RuleOutputError) as e:
        colsum(x)
    msg = str(e.value)
    for part in ("dtensor_guard.colsum.default", "_wrong_colsum_rule", "(S(0))",
                 "block of shape [3]", "gives a block of shape [6]"):
        assert part in msg, msg


@pytest.mark.world_size(2)
def test_dim_merge_on_uneven_blocks_fails_on_every_rank_not_in_gloo(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    x = distribute_tensor(torch.arange(24.0).reshape(3, 2, 4), mesh, [Shard(0)])
    with pytest.raises(RuleOutputError, match=r"should hold a block of shape \[3, 4\]"):
        merge01(x)
    # Even blocks fit the claim: the same rule passes there.
    y = distribute_tensor(torch.arange(32.0).reshape(4, 2, 4), mesh, [Shard(0)])
    assert torch.equal(merge01(y).full_tensor(), torch.arange(32.0).reshape(8, 4))


@pytest.mark.world_size(2)
def test_right_user_rule_passes_and_later_calls_stay_fast(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    x = distribute_tensor(torch.arange(15.0).reshape(5, 3), mesh, [Shard(0)])
    for _ in range(2):  # the second call is a cache hit: no check
        y = rowscale(x)
        assert y.placements == (Shard(0),)
        assert torch.equal(y.full_tensor(), torch.arange(15.0).reshape(5, 3) * 2)


@pytest.mark.world_size(2)
def test_builtin_rules_checked_in_debug_mode(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    check_builtin_rules(True)
    try:
        x = distribute_tensor(torch.arange(15.0).reshape(5, 3), mesh, [Shard(0)])
        full = torch.arange(15.0).reshape(5, 3)
        assert torch.equal((x.sum(0) + 0).full_tensor(), full.sum(0))
        assert torch.equal(x.t().full_tensor(), torch.arange(15.0).reshape(5, 3).t())
    finally:
        check_builtin_rules(False)


# Strategy functions see the schema's defaults -----------------------------------
@torch.library.custom_op("dtensor_guard::soft", mutates_args=())
def soft(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.softmax(x, dim)


@soft.register_fake
def _(x, dim=-1):
    return torch.empty_like(x)


@register_sharding(torch.ops.dtensor_guard.soft.default)
def _soft_strategies(x, dim):
    d = dim % x.ndim
    out = [([Replicate()], [Replicate(), None])]
    return out + [([Shard(k)], [Shard(k), None]) for k in range(x.ndim) if k != d]


@pytest.mark.world_size(2)
def test_strategy_function_gets_the_default_dim(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    full = torch.arange(15.0).reshape(5, 3) / 7
    x = distribute_tensor(full, mesh, [Shard(0)])
    for y in (soft(x, -1), soft(x), torch.ops.dtensor_guard.soft.default(x, -1)):
        assert y.placements == (Shard(0),)
        torch.testing.assert_close(y.full_tensor(), torch.softmax(full, -1))
    z = soft(x, 0)  # dim 0 is sharded: the strategy moves it
    assert z.placements == (Replicate(),)
    torch.testing.assert_close(z.full_tensor(), torch.softmax(full, 0))


@torch.library.custom_op("dtensor_guard::pair", mutates_args=())
def pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x + 1, x - 1


@pair.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x)


@register_rule(torch.ops.dtensor_guard.pair.default)
def _one_output_for_two(call):
    (spec,) = call.specs
    return Sharding(inputs=(None,), outputs=(spec.placements,))  # wrong: two outputs


@pytest.mark.world_size(2)
def test_wrong_output_count_names_the_rule(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    x = distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])
    want = r"_one_output_for_two gave 1 output placement tuples, but the op returns 2"
    with pytest.raises(RuleOutputError, match=want):
        pair(x)
