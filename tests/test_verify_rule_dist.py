"""Covers: dtensor/testing/verify.py, dtensor/testing/rule_case.py and
dtensor/testing/partial_inputs.py: ``verify_rule`` on deliberately wrong
users' rules (each caught with a shrunk counterexample) and right ones
(passing), on this runtime and on PyTorch's (``register_sharding``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from torch.distributed.tensor import Partial as TPartial
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor.experimental import (
    register_sharding as torch_register_sharding,
)

from dtensor import Partial, Replicate, Shard, Sharding, register_rule
from dtensor.experimental import register_sharding
from dtensor.testing import (
    RuleCounterexample,
    Sample,
    tensor_shapes,
    tensors,
    verify_rule,
)

lib = torch.ops.dtensor_verify


def _op(name: str, fn, fake):
    op = torch.library.custom_op(f"dtensor_verify::{name}", mutates_args=())(fn)
    op.register_fake(fake)
    return getattr(lib, name).default


def _fake_like(x, *args, **kwargs):
    return torch.empty_like(x)


# The ops --------------------------------------------------------------------------
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _flip0(x: torch.Tensor) -> torch.Tensor:
    return x.flip(0)


def _relu(x: torch.Tensor) -> torch.Tensor:
    return x.clamp_min(0)


def _lift(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(0).clone()


def _soft(x: torch.Tensor, *, dim: int) -> torch.Tensor:
    return torch.softmax(x, dim)


def _every_other(x: torch.Tensor) -> torch.Tensor:
    return x[::2].clone()


def _add2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


DOUBLE = _op("double", _double, _fake_like)
FLIP = _op("flip0", _flip0, _fake_like)
RELU = _op("relu", _relu, _fake_like)
LIFT = _op("lift", _lift, lambda x: x.new_empty((1, *x.shape)))
SOFT = _op("soft", _soft, _fake_like)
SOFT_BAD = _op("soft_bad", _soft, _fake_like)
EVERY_OTHER = _op("every_other", _every_other,
                  lambda x: x.new_empty(((x.shape[0] + 1) // 2, *x.shape[1:])))
ADD2 = _op("add2", _add2, lambda a, b: torch.empty_like(a))
# For the same rule on both runtimes, one op per runtime (rules are per op).
T_RELU = _op("t_relu", _relu, _fake_like)
T_FLIP = _op("t_flip0", _flip0, _fake_like)
T_DOUBLE = _op("t_double", _double, _fake_like)
T_SOFT = _op("t_soft", _soft, _fake_like)


# The rules: right ones ---------------------------------------------------------------
@register_rule(DOUBLE)
def _double_rule(call):
    # Linear and increasing: every layout passes through, Partials too.
    (spec,) = call.specs
    return Sharding(inputs=(None,), outputs=(spec.placements,))


@register_sharding(SOFT)
def _soft_right(x, *, dim):
    d = dim % x.ndim
    return [([Replicate()], [Replicate()])] + [
        ([Shard(k)], [Shard(k)]) for k in range(x.ndim) if k != d]


@torch_register_sharding(T_DOUBLE)
def _t_double(x):
    return [([TReplicate()], [TReplicate()]),
            ([TPartial("sum")], [TPartial("sum")])] + [
        ([TShard(k)], [TShard(k)]) for k in range(x.ndim)]


@torch_register_sharding(T_SOFT)
def _t_soft(x, *, dim):
    d = dim % x.ndim
    return [([TReplicate()], [TReplicate()])] + [
        ([TShard(k)], [TShard(k)]) for k in range(x.ndim) if k != d]


# The rules: wrong ones ---------------------------------------------------------------
@register_rule(FLIP)
def _flip_wrong(call):
    # Wrong output placement: flipped row blocks are not the flipped tensor's.
    (spec,) = call.specs
    want = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)
    return Sharding(inputs=(want,), outputs=(want,))


@register_rule(RELU)
def _relu_keeps_partial(call):
    # Wrong: relu is not linear, a Partial input must be reduced first.
    (spec,) = call.specs
    return Sharding(inputs=(None,), outputs=(spec.placements,))


@register_rule(LIFT)
def _lift_off_by_one(call):
    # Wrong: after unsqueeze(0), Shard(d) is Shard(d + 1).
    (spec,) = call.specs
    want = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)
    return Sharding(inputs=(want,), outputs=(want,))


@register_sharding(SOFT_BAD)
def _soft_ignores_dim(x, *, dim):
    # Wrong: shards any dim but the last, whatever `dim` says.
    return [([Replicate()], [Replicate()])] + [
        ([Shard(k)], [Shard(k)]) for k in range(x.ndim - 1)]


@register_rule(EVERY_OTHER)
def _every_other_even_only(call):
    # Right only when every block has an even number of rows.
    (spec,) = call.specs
    want = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)
    return Sharding(inputs=(want,), outputs=(want,))


@register_rule(ADD2)
def _add_keeps_any_alike_layout(call):
    # Wrong for Partial(max/min): pieces of a and of b add up to pieces of
    # a + b only where one rank holds both extremes (right for sum and avg).
    a, b = call.specs
    if a.placements == b.placements:
        return Sharding(inputs=(None, None), outputs=(a.placements,))
    want = tuple(Replicate() for _ in a.placements)
    return Sharding(inputs=(want, want), outputs=(want,))


@torch_register_sharding(T_RELU)
def _t_relu_keeps_partial(x):
    return [([TReplicate()], [TReplicate()]),
            ([TPartial("sum")], [TPartial("sum")])] + [
        ([TShard(k)], [TShard(k)]) for k in range(x.ndim)]


@torch_register_sharding(T_FLIP)
def _t_flip_wrong(x):
    return [([TReplicate()], [TReplicate()])] + [
        ([TShard(k)], [TShard(k)]) for k in range(x.ndim)]


def _two_d():
    return st.tuples(tensors(shape=tensor_shapes(min_dims=2, max_dims=2),
                             dtype=torch.float32))


def _caught(op, samples=None, max_examples=80, **kw) -> str:
    # On several ranks the lockstep service re-raises it as one RankFailure
    # (an AssertionError too) carrying every rank's counterexample.
    with pytest.raises(AssertionError) as e:
        verify_rule(op, samples, max_examples=max_examples, **kw)
    msg = str(e.value)
    named = RuleCounterexample.__name__ in msg
    assert isinstance(e.value, RuleCounterexample) or named, msg
    assert "sharding rule counterexample for" in msg, msg
    return msg


# Right rules pass ------------------------------------------------------------------
@pytest.mark.world_size(4)
def test_right_rules_pass_on_dtensor(world) -> None:
    verify_rule(DOUBLE, max_examples=40)
    verify_rule(SOFT, st.builds(lambda x, d: Sample((x,), {"dim": d}),
                                tensors(shape=tensor_shapes(min_dims=2, max_dims=2),
                                        dtype=torch.float32),
                                st.sampled_from([0, 1, -1])), max_examples=40)


@pytest.mark.world_size(4)
def test_right_rules_pass_on_torch(world) -> None:
    verify_rule(T_DOUBLE, impl="torch", max_examples=30,
                reduce_ops=("sum",))
    verify_rule(T_SOFT, st.builds(lambda x, d: Sample((x,), {"dim": d}),
                                  tensors(shape=tensor_shapes(min_dims=2, max_dims=2),
                                          dtype=torch.float32),
                                  st.sampled_from([0, 1, -1])),
                impl="torch", max_examples=30)


# Wrong rules are caught ---------------------------------------------------------------
@pytest.mark.world_size(2)
def test_wrong_output_placement_is_caught(world) -> None:
    msg = _caught(FLIP)
    assert "dtensor_verify.flip0.default" in msg and "placed (S(0))" in msg, msg
    assert "the rule claimed: (S(0))" in msg and "single device gives" in msg, msg
    assert "Replay:" in msg, msg


@pytest.mark.world_size(2)
def test_partial_kept_through_nonlinear_op_is_caught(world) -> None:
    msg = _caught(RELU)
    assert "P(" in msg.split("the rule claimed:")[1].split("\n")[0], msg


@pytest.mark.world_size(2)
def test_max_pieces_added_elementwise_are_caught(world) -> None:
    # Each operand gets its own pieces, the extremes on varying ranks.
    pairs = tensor_shapes(max_dims=2).flatmap(lambda s: st.tuples(
        tensors(shape=s, dtype=torch.float32), tensors(shape=s, dtype=torch.float32)))
    msg = _caught(ADD2, pairs.map(lambda ab: Sample(ab, {})), max_examples=300)
    claimed = msg.split("the rule claimed:")[1].split("\n")[0]
    assert "P(max)" in claimed or "P(min)" in claimed, msg


@pytest.mark.world_size(2)
def test_shard_dim_off_by_one_after_a_view_is_caught(world) -> None:
    msg = _caught(LIFT)
    assert "dtensor_verify.lift.default" in msg and "(S(" in msg, msg


@pytest.mark.world_size(2)
def test_rule_ignoring_a_kwarg_is_caught(world) -> None:
    samples = st.builds(lambda x, d: Sample((x,), {"dim": d}),
                        tensors(shape=tensor_shapes(min_dims=2, max_dims=2),
                                dtype=torch.float32), st.sampled_from([-1, 0]))
    # Only dim=0 on a Shard(0) input of 2+ rows on a 2-rank axis shows it.
    msg = _caught(SOFT_BAD, samples, max_examples=300)
    assert "dim=0" in msg and "placed (S(0)" in msg, msg


@pytest.mark.world_size(2)
def test_rule_right_only_for_even_shards_is_caught(world) -> None:
    msg = _caught(EVERY_OTHER)
    assert "dtensor_verify.every_other.default" in msg, msg
    # shrunk to the smallest case, in real and simulated worlds alike: two rows
    # over two ranks, one odd block each
    assert "inputs: float32[2] [0.0, 1.0] placed (S(0))" in msg, msg


@pytest.mark.world_size(2)
def test_wrong_rules_caught_on_torch(world) -> None:
    msg = _caught(T_RELU, impl="torch", reduce_ops=("sum",))
    assert "placed (P(sum))" in msg or ", P(sum))" in msg, msg
    msg = _caught(T_FLIP, impl="torch")  # torch reduce-scatters a P(sum) input
    claimed = msg.split("the rule claimed:")[1].split("\n")[0]
    assert "t_flip0" in msg and "S(0)" in claimed, msg
