"""Covers: dtensor/rules/ (pure, single process): each rule's chosen input and
output placements for representative specs (that every registered op has a
distributed reference case: tests/test_rules_reference_cases.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtensor import DeviceMesh, Partial, Replicate, Shard, StridedShard
from dtensor.rules import rule_for_tags
from dtensor.rules._util import broadcast_shape
from dtensor.rules.view import view_groups
from dtensor.sharding import OpCall, Sharding
from dtensor.spec import DTensorSpec, TensorMeta, contiguous_stride

aten = torch.ops.aten
R, P = Replicate(), Partial()
SS = StridedShard
# Spec-only meshes (no groups, no world check): the rules are pure, and under
# `torchrun --nproc_per_node=1/2` the world is smaller than these meshes.
MESH = DeviceMesh("cpu", [0, 1], _init_backend=False)
MESH2D = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), _init_backend=False)


def spec(shape, *placements, mesh=MESH, dtype=torch.float32) -> DTensorSpec:
    return DTensorSpec(mesh, placements, TensorMeta(shape, contiguous_stride(shape), dtype))


def run(func, *args, **kwargs) -> Sharding | None:
    specs = tuple(a for a in (*args, *kwargs.values()) if isinstance(a, DTensorSpec))
    flat = []
    for a in args:
        if isinstance(a, list):
            specs = specs + tuple(x for x in a if isinstance(x, DTensorSpec))
            flat.append(tuple(a))
        else:
            flat.append(a)
    rule = rule_for_tags(func)
    assert rule is not None, func
    return rule(OpCall(func, specs, tuple(flat), kwargs))


_SHAPE = st.lists(st.sampled_from([0, 1, 2, 3]), max_size=4).map(tuple)


# deadline=None: torch.broadcast_shapes' first call imports sympy (~0.5 s),
# which made the first example miss the 200 ms deadline in a fresh process.
@settings(deadline=None)
@given(st.lists(_SHAPE, min_size=1, max_size=4))
def test_broadcast_shape_is_torchs(shapes) -> None:
    try:
        want = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        with pytest.raises(RuntimeError, match="do not broadcast"):
            broadcast_shape(*shapes)
        return
    assert broadcast_shape(*shapes) == want


def test_pointwise_keeps_matching_shards_and_broadcasts() -> None:
    s = run(aten.add.Tensor, spec((4, 3), Shard(0)), spec((3,), R))
    assert s.inputs == ((Shard(0),), (R,)) and s.outputs == ((Shard(0),),)
    s = run(aten.mul.Tensor, spec((4, 3), Shard(1)), spec((4, 1), Shard(0)))
    assert s.outputs == ((Shard(1),),) and s.inputs[1] == (R,)


@pytest.mark.parametrize(
    ("func", "pa", "pb", "out"),
    [
        (aten.add.Tensor, P, P, P),
        (aten.add.Tensor, P, R, P),  # R becomes a piece (PyTorch too)
        (aten.mul.Tensor, P, R, P),
        (aten.mul.Tensor, P, P, P),  # one factor reduced (PyTorch too)
        (aten.div.Tensor, R, P, R),
        (aten.div.Tensor, P, R, P),
    ],
)
def test_pointwise_partials_survive_only_linear_ops(func, pa, pb, out) -> None:
    s = run(func, spec((4,), pa), spec((4,), pb))
    assert s.outputs == ((out,),)


def test_add_of_a_partial_and_a_python_number_reduces_first() -> None:
    s = run(aten.add.Tensor, spec((4,), P), 1)
    assert s.outputs == ((R,),) and s.inputs == ((R,),)


def test_inplace_keeps_self_layout_or_falls_back() -> None:
    assert run(aten.mul_.Tensor, spec((4,), R), spec((4,), P)) is None
    s = run(aten.add_.Tensor, spec((4, 2), Shard(0)), spec((4, 2), Shard(1)))
    assert s.inputs == ((Shard(0),), (Shard(0),)) and s.outputs == ((Shard(0),),)


def test_multi_output_pointwise_gives_one_placement_per_output() -> None:
    s = run(aten.frexp.Tensor, spec((4,), Shard(0)))
    assert len(s.outputs) == 2


def test_copy_into_partial_makes_the_source_partial() -> None:
    s = run(aten.copy_.default, spec((4, 3), P), spec((3,), R))
    assert s.inputs == (None, (P,)) and s.outputs == ((P,),)


@pytest.mark.parametrize(
    ("func", "args", "placement", "want", "out"),
    [
        (aten.sum.dim_IntList, ([1],), Shard(0), Shard(0), Shard(0)),
        (aten.sum.dim_IntList, ([0],), Shard(0), Shard(0), P),
        (aten.sum.default, (), Shard(1), Shard(1), P),
        (aten.mean.dim, ([0],), Shard(0), Shard(0), P),
        (aten.amax.default, ([0],), Shard(0), Shard(0), R),
        (aten.amax.default, ([1],), Shard(0), Shard(0), Shard(0)),
        (aten.argmax.default, (None,), Shard(1), R, R),
        (aten.prod.dim_int, (0,), P, R, R),
        (aten.sum.dim_IntList, ([0],), P, P, P),
        (aten.sum.dim_IntList, ([0], True), Shard(1), Shard(1), Shard(1)),
        (aten.sum.dim_IntList, ([0],), Shard(1), Shard(1), Shard(0)),
    ],
)
def test_reductions(func, args, placement, want, out) -> None:
    s = run(func, spec((4, 6), placement), *args)
    assert s.inputs == ((want,),) and s.outputs[0] == (out,)


def test_mean_over_a_sharded_dim_is_a_partial_sum_of_local_sums() -> None:
    s = run(aten.mean.dim, spec((3, 2), Shard(0)), [0])
    assert s.local is not None
    x = torch.arange(6.0).reshape(3, 2)
    local = s.local(aten.mean.dim, (0,), (), (x[:2], [0]), {})
    torch.testing.assert_close(local, x[:2].sum(0) / 3)


@pytest.mark.parametrize(
    ("pa", "pb", "wa", "wb", "out"),
    [
        (Shard(0), R, Shard(0), R, Shard(0)),
        (R, Shard(1), R, Shard(1), Shard(1)),
        (Shard(1), Shard(0), Shard(1), Shard(0), P),
        (Shard(1), R, Shard(1), Shard(0), P),
        (P, R, P, R, P),
        (R, R, R, R, R),
    ],
)
def test_mm_strategies(pa, pb, wa, wb, out) -> None:
    s = run(aten.mm.default, spec((8, 6), pa), spec((6, 4), pb))
    assert s.inputs == ((wa,), (wb,)) and s.outputs == ((out,),)


def test_addmm_bias_follows_the_output() -> None:
    s = run(aten.addmm.default, spec((4,), R), spec((8, 6), R), spec((6, 4), Shard(1)))
    assert s.inputs[0] == (Shard(0),) and s.outputs == ((Shard(1),),)
    s = run(aten.addmm.default, spec((4,), R), spec((8, 6), Shard(1)), spec((6, 4), Shard(0)))
    assert s.inputs[0] == (P,) and s.outputs == ((P,),)


def test_view_groups() -> None:
    assert view_groups((4, 3), (12,)) == [([0, 1], [0])]
    assert view_groups((2, 3, 4), (6, 4)) == [([0, 1], [0]), ([2], [1])]
    assert view_groups((1, 4), (4,)) == [([0, 1], [0])]
    assert view_groups((0, 4), (4, 0)) is None


@pytest.mark.parametrize(
    ("shape", "size", "placement", "want", "out"),
    [
        ((4, 3), [12], Shard(0), Shard(0), Shard(0)),
        ((5, 3), [15], Shard(0), R, R),             # uneven: gather first
        ((4, 3), [12], Shard(1), Shard(1), SS(0, 4)),   # minor dim of a merge: runs
        ((2, 5), [10], Shard(1), Shard(1), SS(0, 2)),   # uneven runs
        ((2, 2, 2), [2, 4], Shard(2), Shard(2), SS(1, 2)),
        ((4, 3, 1), [12], Shard(1), Shard(1), SS(0, 4)),  # size-1 dims after it
        ((4, 3, 2), [24], Shard(1), R, R),          # a middle dim: runs of rows
        ((12,), [4, 3], SS(0, 4), SS(0, 4), Shard(1)),   # split back
        ((12,), [1, 4, 3], SS(0, 4), SS(0, 4), Shard(2)),
        ((12,), [2, 6], SS(0, 4), R, R),            # another split factor
        ((6, 3), [6, 3, 1], SS(0, 2), SS(0, 2), SS(0, 2)),
        ((6, 3), [3, 6], SS(0, 2), R, R),
        ((6, 4), [2, 3, 4], Shard(0), Shard(0), Shard(0)),
        ((6, 4), [3, 2, 4], Shard(0), R, R),        # 3 pieces of 2 rows: uneven
        ((4, 6), [4, 2, 3], Shard(1), Shard(1), Shard(1)),
        ((1, 6), [6], Shard(1), Shard(1), Shard(0)),
        ((4, 3), [12], P, P, P),
    ],
)
def test_view_rule(shape, size, placement, want, out) -> None:
    s = run(aten.view.default, spec(shape, placement), size)
    assert s.inputs == ((want,),) and s.outputs == ((out,),)


def test_shape_ops_map_dims() -> None:
    assert run(aten.transpose.int, spec((4, 3, 2), Shard(0)), 0, 2).outputs == ((Shard(2),),)
    assert run(aten.permute.default, spec((4, 3, 2), Shard(2)), [2, 0, 1]).outputs == ((Shard(0),),)
    assert run(aten.unsqueeze.default, spec((4, 3), Shard(1)), 0).outputs == ((Shard(2),),)
    assert run(aten.squeeze.dim, spec((1, 3), Shard(0)), 0).inputs == ((R,),)
    assert run(aten.select.int, spec((4, 3), Shard(1)), 0, 1).outputs == ((Shard(0),),)
    assert run(aten.slice.Tensor, spec((4, 3), Shard(0)), 0, 1, 3, 1).inputs == ((R,),)
    assert run(aten.slice.Tensor, spec((4, 3), Shard(0)), 1, 1, 3, 1).outputs == ((Shard(0),),)
    assert run(aten.expand.default, spec((4, 1), Shard(0)), [2, 4, 5]).outputs == ((Shard(1),),)


def test_cat_and_stack() -> None:
    s = run(aten.cat.default, [spec((4, 3), Shard(0)), spec((2, 3), Shard(0))], 0)
    assert s.outputs == ((R,),)
    s = run(aten.cat.default, [spec((4, 3), Shard(0)), spec((4, 2), R)], 1)
    assert s.inputs == ((Shard(0),), (Shard(0),)) and s.outputs == ((Shard(0),),)
    s = run(aten.stack.default, [spec((4, 3), Shard(1)), spec((4, 3), R)], 1)
    assert s.outputs == ((Shard(2),),)
    # one shard beside larger whole operands: the cut one is gathered
    s = run(aten.stack.default, [spec((8,), R), spec((8,), Shard(0)), spec((8,), R)], 1)
    assert s.inputs == ((R,),) * 3 and s.outputs == ((R,),)


def test_nn_rules() -> None:
    s = run(aten._softmax.default, spec((4, 6), Shard(1)), 1, False)
    assert s.inputs == ((R,),)
    s = run(aten.native_layer_norm.default, spec((4, 6), Shard(0)), [6], spec((6,), R), None, 1e-5)
    assert s.outputs == ((Shard(0),),) * 3
    s = run(aten.embedding.default, spec((10, 6), Shard(1)), spec((4,), R, dtype=torch.int64))
    assert s.outputs == ((Shard(1),),)
    s = run(aten.nll_loss_forward.default, spec((4, 6), Shard(0)),
            spec((4,), R, dtype=torch.int64), None, 2, -100)
    assert s.outputs == ((P,), (P,))
    s = run(aten.nll_loss_forward.default, spec((4, 6), Shard(0)),
            spec((4,), R, dtype=torch.int64), None, 1, -100)
    # mean: the batch stays sharded; local sum and weight total are all-reduced
    assert s.inputs[0] == (Shard(0),) and s.outputs == ((R,), (R,)) and s.local is not None


def test_two_dim_mesh_nested_shards() -> None:
    s = run(aten.mm.default, spec((8, 6), Shard(0), Shard(1), mesh=MESH2D),
            spec((6, 4), R, Shard(0), mesh=MESH2D))
    assert s.outputs == ((Shard(0), P),)


def test_view_merge_of_a_cut_inner_dim_on_a_2d_mesh() -> None:
    # both axes cut the inner dim: each cuts every run again
    s = run(aten.view.default, spec((4, 6), Shard(1), Shard(1), mesh=MESH2D), [24])
    assert s.inputs == ((Shard(1), Shard(1)),) and s.outputs == ((SS(0, 4), SS(0, 4)),)
    # one axis strided, the other a shard of another dim: both kept
    s = run(aten.view.default, spec((2, 3, 4), Shard(1), Shard(2), mesh=MESH2D), [6, 4])
    assert s.outputs == ((SS(0, 2), Shard(1)),)
    # the major dim cut too: as before, the major shard kept, the inner gathered
    s = run(aten.view.default, spec((4, 6), Shard(0), Shard(1), mesh=MESH2D), [24])
    assert s.inputs == ((Shard(0), R),) and s.outputs == ((Shard(0), R),)
    # a strided dim split back, one axis of another split factor: gathered
    s = run(aten.view.default, spec((12,), SS(0, 4), SS(0, 2), mesh=MESH2D), [4, 3])
    assert s.outputs == ((R, R),)


def test_shape_ops_carry_strided_shards() -> None:
    assert run(aten.t.default, spec((6, 3), SS(0, 2))).outputs == ((SS(1, 2),),)
    assert run(aten.permute.default, spec((6, 3, 2), SS(0, 2)), [2, 0, 1]).outputs == (
        (SS(1, 2),),)
    assert run(aten.unsqueeze.default, spec((6, 3), SS(0, 2)), 0).outputs == ((SS(1, 2),),)
    assert run(aten.slice.Tensor, spec((6, 3), SS(0, 2)), 0, 1, 3, 1).inputs == ((R,),)


@pytest.mark.parametrize(
    ("pa", "pb", "wa", "wb", "out"),
    [
        (SS(0, 2), R, SS(0, 2), R, SS(0, 2)),       # rows (M) kept
        (R, SS(1, 3), R, SS(1, 3), SS(1, 3)),       # columns (N) kept
        (SS(1, 2), SS(0, 2), SS(1, 2), SS(0, 2), P),  # K cut alike: partial sums
    ],
)
def test_mm_keeps_strided_shards(pa, pb, wa, wb, out) -> None:
    s = run(aten.mm.default, spec((6, 8), pa), spec((8, 6), pb))
    assert s.inputs == ((wa,), (wb,)) and s.outputs == ((out,),)


@pytest.mark.parametrize(("pa", "pb"), [(SS(1, 2), Shard(0)), (Shard(1), SS(0, 2)),
                                        (SS(1, 2), SS(0, 4))])
def test_mm_of_k_cut_two_ways_moves_one_operand(pa, pb) -> None:
    s = run(aten.mm.default, spec((6, 8), pa), spec((8, 6), pb))
    (wa,), (wb,) = s.inputs
    # never summed as cut alike: a strided operand is cut as a plain shard
    # (or gathered), nothing is gathered to keep interleaved rows
    assert not any(isinstance(w, SS) and w != p for w, p in ((wa, pa), (wb, pb))), s.inputs
    assert s.outputs != ((P,),) or (wa, wb) == (Shard(1), Shard(0)), s


def test_addmm_cuts_the_bias_like_the_output() -> None:
    s = run(aten.addmm.default, spec((6,), R), spec((4, 8), R), spec((8, 6), SS(1, 3)))
    assert s.outputs == ((SS(1, 3),),) and s.inputs[0] == (SS(0, 3),)
