"""Covers: dtensor/testing/strategies.py, dtensor/testing/asserts.py,
dtensor/testing/impl.py (single process, no process group) and the profiles
and example-database mirror of launch/hypo/profiles.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from dtensor.placement import Partial, Replicate, Shard
from dtensor.spec import normalize_placements
from dtensor.testing import (
    DTYPES,
    MeshLayout,
    assert_matches_single_device,
    distributed_inputs,
    dtypes,
    get_impl,
    mesh_shapes,
    placements,
    sub_meshes,
    tensor_shapes,
    tensors,
)

# -- eager validation, naming the argument -----------------------------------------
BAD = [
    (mesh_shapes, {"world_size": 0}, "world_size=0"),
    (mesh_shapes, {"world_size": 4, "min_ndim": 3, "max_ndim": 2}, "min_ndim=3 must be <= max_ndim=2"),
    (mesh_shapes, {"world_size": 2.0}, "world_size=2.0 must be an int"),
    (mesh_shapes, {"world_size": 4, "min_ranks": 5}, "min_ranks=5 must be <= world_size=4"),
    (sub_meshes, {"world_size": 1}, "world_size=1"),
    (sub_meshes, {"world_size": 4, "min_outsiders": 4}, "min_outsiders=4"),
    (placements, {"mesh_ndim": 0, "tensor_ndim": 1}, "mesh_ndim=0"),
    (placements, {"mesh_ndim": 1, "tensor_ndim": -1}, "tensor_ndim=-1"),
    (placements, {"mesh_ndim": 1, "tensor_ndim": 1, "reduce_ops": ("prod",)}, "reduce_ops"),
    (placements, {"mesh_ndim": 1, "tensor_ndim": 1, "reduce_ops": ()}, "allow_partial=True"),
    (tensor_shapes, {"min_dims": 4, "max_dims": 2}, "min_dims=4 must be <= max_dims=2"),
    (tensor_shapes, {"min_side": 3, "max_side": 1}, "min_side=3 must be <= max_side=1"),
    (tensor_shapes, {"min_side": True}, "min_side=True must be an int"),
    (dtypes, {"include": ()}, "include=()"),
    (tensors, {"fills": ("zeros",)}, "fills=('zeros',)"),
    (distributed_inputs, {"world_size": 0}, "world_size=0"),
    (distributed_inputs, {"world_size": 2, "mesh_factory": 3}, "mesh_factory=3"),
]


@pytest.mark.parametrize(("fn", "kwargs", "message"), BAD,
                         ids=[f"{f.__name__}-{m}" for f, _, m in BAD])
def test_bad_arguments_raise_when_the_strategy_is_built(fn, kwargs, message):
    with pytest.raises(InvalidArgument, match=None) as e:
        fn(**kwargs)
    assert message in str(e.value)
    assert fn.__name__ in str(e.value)


def test_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        mesh_shapes(4)  # type: ignore[misc]
    with pytest.raises(TypeError):
        placements(1, 2)  # type: ignore[misc]



def test_strategies_built_twice_are_one_object():
    # Property bodies build strategies per drawn shape (st.data()); Hypothesis
    # validates every new strategy object on its first draw, which cost ~10 %
    # of the property suite. Equal arguments must give the same object.
    assert tensors(shape=(2, 3), dtype=torch.float32) is tensors(
        shape=[2, 3], dtype=torch.float32)
    assert tensors(shape=(2, 3), dtype=torch.float32) is not tensors(
        shape=(3, 2), dtype=torch.float32)
    assert placements(mesh_ndim=2, tensor_ndim=1) is placements(mesh_ndim=2, tensor_ndim=1)
    assert placements(mesh_ndim=2, tensor_ndim=1, reduce_ops=["sum"]) is placements(
        mesh_ndim=2, tensor_ndim=1, reduce_ops=("sum",))
    assert dtypes(include=[torch.float32]) is dtypes(include=(torch.float32,))
    assert tensor_shapes(max_dims=2) is tensor_shapes(max_dims=2)
    assert mesh_shapes(world_size=4) is mesh_shapes(world_size=4)
    with pytest.raises(InvalidArgument, match="dtype="):
        tensors(shape=(2,), dtype="float32")  # type: ignore[arg-type]


# -- what the strategies produce ----------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(st.data())
def test_mesh_shapes_cover_the_world(data):
    n = data.draw(st.integers(1, 8))
    shape = data.draw(mesh_shapes(world_size=n, max_ndim=3))
    assert math.prod(shape) == n and 1 <= len(shape) <= 3


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_sub_meshes_leave_ranks_out(data):
    n = data.draw(st.integers(2, 8))
    layout = data.draw(sub_meshes(world_size=n))
    assert len(layout.ranks) < n
    assert list(layout.ranks) == sorted(set(layout.ranks))
    assert all(0 <= r < n for r in layout.ranks)
    assert layout.grid().shape == layout.shape


def test_sub_meshes_reach_every_shape_and_outsider():
    assert find(sub_meshes(world_size=4), lambda m: m.ranks == (1, 3)).shape in ((2,), (1, 2), (2, 1), (1, 1, 2), (1, 2, 1), (2, 1, 1))
    assert find(sub_meshes(world_size=4), lambda m: m.ndim == 3 and len(m.ranks) == 3)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_placements_are_valid_for_the_mesh_and_tensor(data):
    mesh_ndim = data.draw(st.integers(1, 3))
    tensor_ndim = data.draw(st.integers(0, 3))
    mixed = data.draw(st.booleans())
    ps = data.draw(placements(mesh_ndim=mesh_ndim, tensor_ndim=tensor_ndim,
                              mixed_reduce_ops=mixed))
    assert normalize_placements(ps, mesh_ndim, tensor_ndim) == ps
    assert all(p.dim < tensor_ndim for p in ps if isinstance(p, Shard))
    if not mixed:
        assert len({p.reduce_op for p in ps if isinstance(p, Partial)}) <= 1


def test_placements_shrink_to_replicate_and_reach_nested_sharding():
    assert find(placements(mesh_ndim=2, tensor_ndim=2), lambda ps: True) == (Replicate(),) * 2
    assert find(placements(mesh_ndim=2, tensor_ndim=1), lambda ps: ps == (Shard(0), Shard(0)))
    assert find(placements(mesh_ndim=2, tensor_ndim=0, allow_partial=False),
                lambda ps: True) == (Replicate(), Replicate())


def test_tensor_shapes_reach_scalars_empty_and_uneven_dims():
    assert find(tensor_shapes(), lambda s: True) == ()
    assert 0 in find(tensor_shapes(min_dims=2), lambda s: 0 in s)
    assert find(tensor_shapes(), lambda s: len(s) == 3 and all(x % 2 for x in s))


@settings(max_examples=60, deadline=None)
@given(tensors())
def test_tensors_have_a_covered_dtype_and_small_shape(t):
    assert t.dtype in DTYPES and t.ndim <= 3 and all(s <= 5 for s in t.shape)


def test_bfloat16_arange_is_exact():
    t = find(tensors(shape=(5, 5, 5), dtype=torch.bfloat16, fills=("arange",)), lambda t: True)
    assert torch.equal(t.float(), torch.arange(125.0).reshape(5, 5, 5))


@settings(max_examples=30, deadline=None)
@given(distributed_inputs(world_size=4, allow_sub_meshes=True, mesh_factory=lambda lay: lay))
def test_distributed_inputs_fit_together(inp):
    assert isinstance(inp.mesh, MeshLayout) and inp.mesh is inp.layout
    assert normalize_placements(inp.placements, inp.layout.ndim, inp.tensor.ndim)
    assert "DistributedInput(" in repr(inp) and "0x" not in repr(inp)


# -- asserts and the impl adapter on a one-rank mesh (no process group) --------------
@pytest.mark.world_size(1)  # the mesh is rank 0: other ranks would be outsiders
def test_assert_matches_single_device_names_rank_block_and_index():
    impl = get_impl("dtensor")
    mesh = impl.mesh(MeshLayout((1,), (0,)))
    x = torch.arange(6.0).reshape(2, 3)
    dt = impl.from_blocks(x, mesh, (Shard(1),))
    assert_matches_single_device(dt, x)
    wrong = x.clone()
    wrong[1, 2] = 99
    with pytest.raises(AssertionError) as e:
        assert_matches_single_device(dt, wrong)
    msg = str(e.value)
    assert "rank 0" in msg and "global index (1, 2)" in msg and "got 5.0" in msg
    assert "expected 99.0" in msg and "global[0:2, 0:3]" in msg
    with pytest.raises(AssertionError, match="dtype differs"):
        assert_matches_single_device(dt, x.double())
    with pytest.raises(AssertionError, match="global shape differs"):
        assert_matches_single_device(dt, x[0])


@pytest.mark.world_size(1)  # the mesh is rank 0: other ranks would be outsiders
def test_tolerances_are_dtype_aware():
    impl = get_impl("dtensor")
    mesh = impl.mesh(MeshLayout((1,), (0,)))
    x = torch.full((3,), 100.0, dtype=torch.bfloat16)
    assert_matches_single_device(impl.from_blocks(x, mesh, (Replicate(),)), x + 1)  # bf16 rtol
    i = torch.arange(3)
    with pytest.raises(AssertionError, match="exact"):
        assert_matches_single_device(impl.from_blocks(i, mesh, (Replicate(),)), i + 1)


# -- the plugin's profiles and database mirror -----------------------------------------
def test_profiles_are_registered_without_timing_or_explain():
    from hypothesis import HealthCheck, Phase

    import launch.hypo.profiles  # noqa: F401 - registers the profiles

    ci = settings.get_profile("ci")
    assert ci.derandomize and ci.deadline is None and ci.database is None
    assert 10 <= ci.max_examples <= 25
    for name in ("ci", "dev", "fuzz"):
        p = settings.get_profile(name)
        assert Phase.explain not in p.phases and p.deadline is None
        assert HealthCheck.too_slow in p.suppress_health_check
    assert settings.get_profile("fuzz").max_examples > settings.get_profile("dev").max_examples


def test_database_mirror_replays_rank_zero_reads_in_order():
    from datetime import timedelta

    import torch.distributed as dist
    from hypothesis.database import InMemoryExampleDatabase

    from launch.hypo.profiles import _MirrorDB

    store = dist.HashStore()
    real = InMemoryExampleDatabase()
    real.save(b"k", b"\x01\x02")
    zero = _MirrorDB(real, store, 0, timedelta(seconds=5))
    one = _MirrorDB(None, store, 1, timedelta(seconds=5))
    assert list(zero.fetch(b"k")) == [b"\x01\x02"]
    assert list(zero.fetch(b"nothing")) == []
    assert list(one.fetch(b"k")) == [b"\x01\x02"]
    assert list(one.fetch(b"nothing")) == []
    one.save(b"k", b"\x03")  # other ranks never write
    assert list(real.fetch(b"k")) == [b"\x01\x02"]


@pytest.mark.world_size(1)
def test_cached_meshes_are_per_world(monkeypatch):
    # Under a test service that swaps sub-worlds in, one layout names other
    # process groups in each world: a mesh cached in one must never be handed
    # out in another (it did: a 2-rank sub-world's group reached a 4-rank one).
    from dtensor import _comm
    from dtensor.testing import MeshLayout, get_impl

    layout = MeshLayout((1,), (0,))
    impl = get_impl("dtensor")
    first = impl.mesh(layout)
    assert impl.mesh(layout) is first and layout.build() is layout.build()
    built = layout.build()
    monkeypatch.setattr(_comm, "world_tag", lambda: "another-world.1")
    assert impl.mesh(layout) is not first
    assert layout.build() is not built


# -- layout strategies and the per-rank oracle's reference ---------------------------
def test_named_sub_meshes_reach_reordered_axes_and_3d_parents():
    from dtensor.testing.meshes import named_sub_meshes

    case = find(named_sub_meshes(world_size=4),
                lambda c: c.layout.ndim == 2 and c.picked == ("tp", "dp")
                and c.layout.shape == (2, 2))
    # mesh["tp", "dp"] of [[0, 1], [2, 3]] is its transpose, for every rank.
    assert case.sub_grid(3).tolist() == [[0, 2], [1, 3]]
    deep = find(named_sub_meshes(world_size=4),
                lambda c: c.layout.ndim == 3 and len(c.picked) == 2
                and c.names.index(c.picked[0]) > c.names.index(c.picked[1]))
    assert deep.sub_grid(0).numel() == math.prod(
        deep.layout.shape[deep.names.index(n)] for n in deep.picked)


@pytest.mark.parametrize("kind", ["empty", "one_row", "run", "strided"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sharded_blocks_reach_their_shape_class(kind, world_size):
    from dtensor.testing.blocks import sharded_blocks

    @settings(max_examples=40, database=None)
    @given(sharded_blocks(world_size=world_size, kind=kind, allow_sub_meshes=True))
    def check(case):
        assert kind in case.classes(), case

    check()


def test_block_classes_and_reference_blocks():
    from dtensor.testing.blocks import block_class
    from dtensor.testing.oracle import reference_block, reference_coordinate

    assert block_class((4, 6), (0, 6)) == "empty"
    assert block_class((4, 6), (1, 6)) == "one_row"
    assert block_class((4, 6), (2, 6)) == block_class((1, 6), (1, 3)) == "run"
    assert block_class((4, 6), (2, 3)) == "strided"
    # Nested uneven sharding follows torch.chunk axis by axis: 5 -> [0,1,2],[3,4]
    # -> [0,1],[2],[3],[4].
    pieces = [reference_block((5,), (2, 2), (Shard(0), Shard(0)), (i, j))[0].tolist()
              for i in range(2) for j in range(2)]
    assert pieces == [[0, 1], [2], [3], [4]]
    assert reference_block((3,), (4,), (Shard(0),), (3,))[0].numel() == 0
    grid = torch.tensor([[2, 0], [3, 1]])
    assert reference_coordinate(grid, 0) == (0, 1) and reference_coordinate(grid, 5) is None


def test_assert_coordinate_names_the_rank_and_its_rank_tensor_when_it_fails():
    """The failure context is built only on failure: it must still name the
    rank, the whole rank tensor and both coordinates."""
    from dtensor.testing import oracle

    rank = oracle._rank()
    grid = torch.arange(rank, rank + 4).reshape(2, 2)  # this rank sits at (0, 0)

    class WrongCoordinate:
        mesh, shape, mesh_dim_names = grid, (2, 2), None

        def get_coordinate(self):
            return [0, 1]

    with pytest.raises(AssertionError, match=(
            rf"^after op: rank {rank} in mesh \[\[{rank}, {rank + 1}\], \[{rank + 2}, "
            rf"{rank + 3}\]\]: get_coordinate\(\) is \(0, 1\), expected \(0, 0\)$")):
        oracle.assert_coordinate(WrongCoordinate(), msg="after op")


@pytest.mark.parametrize("case", ["equal", "off_by_tol", "nan_pair", "nan_strict", "int_diff",
                                  "dtype_cast", "neg_zero"])
def test_compare_block_exact_fast_path_keeps_every_verdict(case):
    """Bit-equal blocks pass at once; everything else takes the full check,
    so NaN handling, tolerances, exact ints and dtype casts are unchanged."""
    from dtensor.testing.compare import compare_block

    nan = float("nan")
    a = torch.tensor([1.0, 2.0, 3.0])
    cases = {  # local, block, equal_nan, passes
        "equal": (a, a.clone(), True, True),
        "off_by_tol": (a, a + 1e-3, True, False),
        "nan_pair": (torch.tensor([1.0, nan]), torch.tensor([1.0, nan]), True, True),
        "nan_strict": (torch.tensor([1.0, nan]), torch.tensor([1.0, nan]), False, False),
        "int_diff": (torch.tensor([1, 2]), torch.tensor([1, 3]), True, False),
        "dtype_cast": (torch.tensor([1.0, 2.0], dtype=torch.float16), a[:2], True, True),
        "neg_zero": (torch.tensor([-0.0]), torch.tensor([0.0]), True, True),
    }
    local, block, equal_nan, passes = cases[case]
    if passes:
        compare_block(local, block, (0,), "block", "", None, None, equal_nan)
    else:
        with pytest.raises(AssertionError, match="elements differ"):
            compare_block(local, block, (0,), "block", "", None, None, equal_nan)
