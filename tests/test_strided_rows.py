"""Covers: dtensor/placement.py (StridedShard), dtensor/spec.py (strided_runs,
cut_runs, local_shape, local_block's refusal), dtensor/strided.py
(block_runs, fsdp_tp_placements, has_strided, unstrided) — pure layout math,
no process group.

References are built independently: ``torch.chunk`` of index ranges (the
definition of the layout), and for FSDP + TP the right-to-left nesting
itself (chunk over tp, then each block over dp).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dtensor import DeviceMesh, PlacementError, Replicate, Shard, StridedShard
from dtensor.redistribute import plan
from dtensor.spec import (
    DTensorSpec,
    TensorMeta,
    contiguous_stride,
    local_block,
    local_shape,
    normalize_placements,
    strided_runs,
)
from dtensor.strided import block_runs, fsdp_tp_placements, has_strided


def _chunk(idx: list[int], n: int, c: int) -> list[int]:
    pieces = torch.chunk(torch.tensor(idx, dtype=torch.long), n) if idx else ()
    return pieces[c].tolist() if c < len(pieces) else []


def _expected_rows(size: int, n: int, sf: int, c: int) -> list[int]:
    idx = list(range(size))
    return [i for j in range(sf) for i in _chunk(_chunk(idx, sf, j), n, c)]


def _grid(ranks, names) -> DeviceMesh:
    """A mesh for layout math only: no process group (ranks may exceed the
    world a torchrun run gives these tests)."""
    return DeviceMesh("cpu", ranks, mesh_dim_names=names, _init_backend=False)


def _flat(runs) -> list[int]:
    return [i for s, n in runs for i in range(s, s + n)]


@given(size=st.integers(0, 20), n=st.integers(1, 5), sf=st.integers(1, 5))
def test_strided_runs_are_sub_piece_c_of_every_chunk(size, n, sf) -> None:
    seen = []
    for c in range(n):
        runs = strided_runs(size, n, sf, c)
        assert _flat(runs) == _expected_rows(size, n, sf, c), (size, n, sf, c, runs)
        assert all(length > 0 for _, length in runs)  # empty runs are left out
        seen += _flat(runs)
    assert sorted(seen) == list(range(size))  # every row once, over all pieces


def test_strided_runs_examples_uneven_and_empty() -> None:
    assert strided_runs(8, 2, 2, 0) == ((0, 2), (4, 2))
    # PyTorch's documented 9-row example: pieces [0,1,5], [2,3,6], [4,7], [8]
    assert [_flat(strided_runs(9, 4, 2, c)) for c in range(4)] == [
        [0, 1, 5], [2, 3, 6], [4, 7], [8]]
    assert strided_runs(3, 4, 2, 3) == ()  # an empty block
    assert strided_runs(0, 2, 3, 0) == ()


@given(shape=st.lists(st.integers(0, 9), min_size=1, max_size=3),
       mesh=st.lists(st.integers(1, 3), min_size=1, max_size=3), data=st.data())
def test_block_runs_and_local_shape_match_nested_chunks(shape, mesh, data) -> None:
    ndim = len(shape)
    kinds = st.one_of(st.just(Replicate()), st.integers(0, ndim - 1).map(Shard),
                      st.builds(StridedShard, st.integers(0, ndim - 1), st.integers(1, 4)))
    ps = tuple(data.draw(kinds) for _ in mesh)
    for coord in itertools.product(*(range(n) for n in mesh)):
        idx = [list(range(s)) for s in shape]
        for axis, p in enumerate(ps):  # the definition, axis by axis
            if isinstance(p, Shard):
                idx[p.dim] = _chunk(idx[p.dim], mesh[axis], coord[axis])
            elif isinstance(p, StridedShard):
                parts = [_chunk(idx[p.dim], p.split_factor, j) for j in range(p.split_factor)]
                idx[p.dim] = [i for part in parts for i in _chunk(part, mesh[axis], coord[axis])]
        runs = block_runs(shape, mesh, ps, coord)
        assert [_flat(r) for r in runs] == idx, (shape, mesh, ps, coord)
        assert local_shape(shape, mesh, ps, coord) == tuple(len(i) for i in idx)


def test_value_type_is_frozen_canonical_and_validated() -> None:
    p = StridedShard(0, 2)
    assert p == StridedShard(dim=0, split_factor=2) and hash(p) == hash(StridedShard(0, 2))
    assert repr(p) == "StridedShard(dim=0, split_factor=2)" and str(p) == "S(0,sf=2)"
    assert p.is_shard() and p.is_shard(0) and not p.is_shard(1) and not p.is_replicate()
    assert p != Shard(0)
    with pytest.raises(AttributeError):
        p.dim = 1  # type: ignore[misc]
    with pytest.raises(PlacementError, match=r"split_factor.*>= 1"):
        StridedShard(0, 0)
    with pytest.raises(PlacementError, match="expected an int"):
        StridedShard(0, 2.0)  # type: ignore[arg-type]
    # A spec stores the canonical form: split_factor 1 is Shard, -1 a real dim.
    assert normalize_placements((StridedShard(-1, 1),), 1, 2) == (Shard(1),)
    assert normalize_placements((StridedShard(-2, 3),), 1, 2) == (StridedShard(0, 3),)


def test_local_block_refuses_an_offset_for_interleaved_rows() -> None:
    ps = (StridedShard(0, 2), Shard(0))
    with pytest.raises(PlacementError, match=r"no single offset.*block_runs"):
        local_block((8, 4), (2, 2), ps, (0, 1))
    assert local_block((8, 4), (2, 2), ps, None) == ((0, 0), (0, 0))  # outsiders
    with pytest.raises(PlacementError, match="StridedShard axes"):
        plan(ps, (Replicate(), Replicate()), (2, 2))
    assert has_strided(ps) and not has_strided((Shard(0), Replicate()))


def test_spec_prints_and_hashes_with_strided_shard() -> None:
    mesh = _grid([[0, 1], [2, 3]], ("dp", "tp"))
    meta = TensorMeta((8, 4), contiguous_stride((8, 4)), torch.float32)
    spec = DTensorSpec(mesh, (StridedShard(0, 2), Shard(0)), meta)
    assert str(spec) == "f32[8,4](S(0,sf=2), S(0))"
    assert spec == DTensorSpec(mesh, [StridedShard(0, 2), Shard(0)], meta)
    assert spec.local_shape((1, 1)) == (2, 4)


def _rtl(rows: int, n_dp: int, n_tp: int, i: int, j: int) -> list[int]:
    """FSDP + TP by definition: TP block j of dim 0, then its dp piece i."""
    return _chunk(_chunk(list(range(rows)), n_tp, j), n_dp, i)


@pytest.mark.parametrize("n_dp,n_tp", [(2, 2), (2, 1), (1, 2), (4, 2), (2, 4), (3, 2)])
def test_fsdp_tp_placements_give_dp_piece_of_each_tp_block(n_dp, n_tp) -> None:
    ranks = torch.arange(n_dp * n_tp).reshape(n_dp, n_tp).tolist()
    mesh = _grid(ranks, ("dp", "tp"))
    for rows in range(0, 3 * n_dp * n_tp + 1):
        try:
            ps = fsdp_tp_placements(mesh, Shard(0), (rows, 3))
        except PlacementError as e:
            # Refused only where no placements say it: some rank's rows differ.
            assert "pad dim 0 to a multiple" in str(e)
            assert rows % (n_dp * n_tp)
            continue
        for i, j in itertools.product(range(n_dp), range(n_tp)):
            got = _flat(block_runs((rows, 3), (n_dp, n_tp), ps, (i, j))[0])
            assert got == _rtl(rows, n_dp, n_tp, i, j), (rows, ps, i, j)
    assert fsdp_tp_placements(mesh, Shard(0), (8, 4)) == (
        (StridedShard(0, n_tp), Shard(0)) if n_tp > 1 else (Shard(0), Shard(0)))
    assert fsdp_tp_placements(mesh, Shard(1), (5, 4)) == (Shard(0), Shard(1))
    assert fsdp_tp_placements(mesh, Replicate(), (5, 4)) == (Shard(0), Replicate())


def test_fsdp_tp_placements_on_tp_dp_order_and_bad_axes() -> None:
    mesh = _grid([[0, 1], [2, 3]], ("tp", "dp"))
    # tp first: left-to-right nesting already cuts the TP block first.
    assert fsdp_tp_placements(mesh, Shard(0), (7, 2)) == (Shard(0), Shard(0))
    with pytest.raises(PlacementError, match="two different mesh axes"):
        fsdp_tp_placements(mesh, Shard(0), (7, 2), dp_axis="tp")
    mesh = _grid([[0, 1], [2, 3], [4, 5]], ("dp", "tp"))
    # tp blocks [0-3] [4-6], dp pieces [0,1] [2,3] [] | [4] [5] [6]: rank (2, 0)
    # holds nothing, but the strided rows [6] of dp 2 put row 6 on tp 0.
    with pytest.raises(PlacementError, match=r"rank \(dp=2, tp=0\).*multiple of 6"):
        fsdp_tp_placements(mesh, Shard(0), (7, 2))


def test_fsdp_tp_placements_check_each_layout_once_per_process(monkeypatch) -> None:
    # The check walks every rank's block (linear in the rank count); every rank
    # of a simulated world asks it, so a second ask must not walk them again
    # (a 1,024-rank world's property spent minutes here).
    import dtensor.strided as strided

    calls = []
    real = strided.block_runs
    monkeypatch.setattr(strided, "block_runs", lambda *a: calls.append(a) or real(*a))
    mesh = _grid([[0, 1, 2], [3, 4, 5]], ("dp", "tp"))
    first = fsdp_tp_placements(mesh, Shard(0), (613, 2))
    walked = len(calls)
    assert walked >= 6
    assert fsdp_tp_placements(mesh, Shard(0), (613, 2)) == first
    assert len(calls) == walked, "the second ask walked the blocks again"


def test_draw_runs_puts_boxes_of_a_global_function_in_local_order() -> None:
    from dtensor.strided import draw_runs

    mesh = _grid([[0, 1], [2, 3]], ("dp", "tp"))
    shape = (7, 5)
    meta = TensorMeta(shape, contiguous_stride(shape), torch.float32)
    spec = DTensorSpec(mesh, (StridedShard(0, 2), StridedShard(1, 3)), meta)
    full = torch.arange(35.0).reshape(shape)  # value = global flat index

    def make(seed, offset, gshape, start, box, device=None):
        assert gshape == shape and (seed, offset) == (1, 2)
        return full[tuple(slice(s, s + n) for s, n in zip(start, box, strict=True))]

    for coord in itertools.product(range(2), range(2)):
        runs = block_runs(shape, (2, 2), spec.placements, coord)
        want = full[_flat(runs[0])][:, _flat(runs[1])]
        got = draw_runs(spec, coord, 1, 2, make, "cpu")
        assert torch.equal(got, want), (coord, got, want)
