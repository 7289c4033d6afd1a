"""Covers: dtensor/placement.py, dtensor/spec.py (pure, no process group)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from dtensor import DeviceMesh, DTensorSpec, Partial, Replicate, Shard, TensorMeta
from dtensor.errors import PlacementError
from dtensor.placement import (
    Placement,
    format_placements,
    is_linear_partial,
    partial_to_replicate,
    replicated,
)
from dtensor.rules._util import shard_through_broadcast
from dtensor.spec import contiguous_stride, local_block, shard_range

ALL = [Shard(0), Shard(-1), Replicate(), Partial(), Partial("avg"), Partial("max"), Partial("min")]


@pytest.mark.parametrize("p", ALL, ids=str)
def test_placement_repr_round_trips_and_is_frozen(p: Placement) -> None:
    assert eval(repr(p)) == p
    assert hash(eval(repr(p))) == hash(p)
    assert pickle.loads(pickle.dumps(p)) == p
    for field in dataclasses.fields(p):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(p, field.name, 3)


def test_placement_str_is_compact() -> None:
    assert format_placements((Shard(0), Replicate(), Partial("max"))) == "(S(0), R, P(max))"


def test_placement_kinds() -> None:
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
    assert Replicate().is_replicate() and not Replicate().is_shard()
    assert Partial().is_partial("sum") and not Partial().is_partial("max")
    assert Shard(0) != Shard(1) and Partial("sum") != Partial("avg")


def test_placement_vocabulary() -> None:
    # spec-only mesh: under torchrun N<4 the world is smaller than it
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), _init_backend=False)
    assert replicated(mesh) == (Replicate(), Replicate()) == replicated(2)
    assert replicated(0) == ()
    assert partial_to_replicate((Shard(1), Partial("max"), Replicate())) == (
        Shard(1), Replicate(), Replicate())
    assert [Partial(op).is_linear for op in ("sum", "avg", "max", "min")] == [
        True, True, False, False]
    assert [is_linear_partial(p) for p in (Partial(), Partial("min"), Shard(0), Replicate())] == [
        True, False, False, False]
    meta = TensorMeta((4, 2), (2, 1), torch.float32)
    assert DTensorSpec.replicated(mesh, meta).placements == replicated(mesh)


@pytest.mark.parametrize(
    ("shard", "shape", "out_shape", "want"),
    [
        (Shard(1), (3,), (4, 3), Shard(0)),     # trailing dims line up
        (Shard(0), (3,), (4, 3), Replicate()),  # the operand lacks the dim
        (Shard(0), (1, 3), (4, 3), Replicate()),  # the operand broadcasts it
        (Shard(0), (1, 3), (1, 3), Shard(0)),   # size 1 on both: no broadcast
    ],
)
def test_shard_through_broadcast(shard, shape, out_shape, want) -> None:
    assert shard_through_broadcast(shard, shape, out_shape) == want


@pytest.mark.parametrize("bad", [lambda: Partial("mean"), lambda: Shard(1.0), lambda: Shard(True)])
def test_bad_placements_raise_value_errors(bad) -> None:
    with pytest.raises(PlacementError) as e:
        bad()
    assert isinstance(e.value, ValueError) and not isinstance(e.value, TypeError)


@pytest.mark.parametrize("size", [0, 1, 5, 7, 8])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_shard_range_matches_torch_chunk(size: int, n: int) -> None:
    pieces = torch.arange(size).chunk(n) if size else ()
    for i in range(n):
        start, length = shard_range(size, n, i)
        expected = pieces[i].tolist() if i < len(pieces) else []
        assert list(range(start, start + length)) == expected


def test_local_block_nested_sharding_is_left_to_right() -> None:
    # 5 rows over a 2x2 mesh, [S(0), S(0)]: axis 0 splits 3|2, axis 1 splits each.
    blocks = {
        c: local_block((5, 2), (2, 2), (Shard(0), Shard(0)), c)
        for c in [(0, 0), (0, 1), (1, 0), (1, 1)]
    }
    assert blocks == {
        (0, 0): ((2, 2), (0, 0)),
        (0, 1): ((1, 2), (2, 0)),
        (1, 0): ((1, 2), (3, 0)),
        (1, 1): ((1, 2), (4, 0)),
    }
    # Every row exactly once: the upstream 194457 row-loss cannot happen here.
    rows = sorted(r for (shape, off) in blocks.values() for r in range(off[0], off[0] + shape[0]))
    assert rows == list(range(5))


def test_local_block_outsider_is_empty() -> None:
    assert local_block((4, 3), (2,), (Shard(0),), None) == ((0, 0), (0, 0))
    assert local_block((), (2,), (Replicate(),), None) == ((0,), ())


def _spec(placements, shape=(4, 6)) -> DTensorSpec:
    mesh = DeviceMesh("cpu", [0])
    return DTensorSpec(mesh, placements, TensorMeta(shape, contiguous_stride(shape), torch.float32))


def test_spec_is_immutable_hashable_and_canonical() -> None:
    a = _spec([Shard(-1)])
    b = _spec((Shard(1),))
    assert a == b and hash(a) == hash(b) and a.placements == (Shard(1),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.placements = (Replicate(),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.tensor_meta.shape = (1,)
    assert str(a) == "f32[4,6](S(1))"
    assert a.with_placements((Shard(1),)) is a
    assert a.with_placements((Replicate(),)).placements == (Replicate(),)
    assert a.placements == (Shard(1),)  # deriving never changes the original


@pytest.mark.parametrize(
    ("placements", "match"),
    [
        ([Shard(0), Replicate()], "expected 1"),
        ([Shard(2)], "valid shard dims are -2..1"),
        ([object()], "expected Shard/Replicate/Partial"),
    ],
)
def test_spec_rejects_bad_placements(placements, match) -> None:
    with pytest.raises(PlacementError, match=match):
        _spec(placements)


def test_zero_dim_cannot_be_sharded() -> None:
    with pytest.raises(PlacementError, match="0-d tensor cannot be sharded"):
        _spec([Shard(0)], shape=())
