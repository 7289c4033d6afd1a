"""Covers: the extremes over sharded dims in dtensor/rules/reduction.py on
Gloo worlds: ``amax``/``amin`` over dims that include a sharded dim send one
all-reduce of the output (order-preserving integer keys, so a NaN on one rank
wins), and ``max.dim``/``min.dim``/``argmax``/``argmin`` along a sharded dim
send one all-gather of (key, global index) pairs, 2 x the output in the
key's integer type (4 bytes each for float32),
where the replicate fallback gathered the whole dim. Values and indices equal
single device exactly: ties across shard boundaries (the first index wins),
NaN on one rank (the first NaN wins), -inf/inf, -0/+0 ties, uneven and empty
shards, keepdim, float32/int64 and other keyed dtypes, Partial inputs, a
reduction over an unsharded dim (nothing sent) and a 2-D mesh. Flattened
argmax, empty tensors and bool keep the fallback."""

from __future__ import annotations

import math

import pytest
import torch

from dtensor import DeviceMesh, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommCounter

WORLDS = pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.world_size(n), id=f"w{n}") for n in (2, 4)]
)
# Bytes of the order-preserving key each value travels as.
KEY_BYTES = {torch.float32: 4, torch.int64: 8, torch.float64: 8, torch.float16: 4,
             torch.bfloat16: 4, torch.int32: 4, torch.uint8: 4}


def _data(shape, dtype, kind: str, seed: int = 0) -> torch.Tensor:
    """'ties': few distinct values (ties everywhere, across shard boundaries);
    'nan': one NaN in the last rows (a later rank's shard) and one in the
    middle column; 'inf': +-inf at both ends; 'zeros': -0 and +0 mixed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, shape, generator=g).to(dtype)
    if kind == "ties" or 0 in shape:
        return x
    if kind == "nan":
        if dtype.is_floating_point:
            x[-1, shape[1] // 2] = math.nan
            x[shape[0] // 2, -1] = math.nan
        else:
            x[-1, shape[1] // 2] = torch.iinfo(dtype).max
            x[0, -1] = torch.iinfo(dtype).min
        return x
    if kind == "inf":
        hi, lo = ((math.inf, -math.inf) if dtype.is_floating_point
                  else (torch.iinfo(dtype).max, torch.iinfo(dtype).min))
        x[-1, 0], x[0, 0], x[0, -1], x[-1, -1] = hi, lo, hi, lo
        return x
    if kind == "zeros":
        x = torch.zeros(shape, dtype=dtype)
        if dtype.is_floating_point:
            x[::2] = -0.0
            x[:, 1::3] = -0.0
        return x
    raise ValueError(kind)


def _same(got: torch.Tensor, want: torch.Tensor, where: str, sign: bool = False) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (where, got, want)
    assert torch.equal(got.isnan(), want.isnan()) if want.is_floating_point() else True, (
        where, got, want)
    ok = want.isnan() if want.is_floating_point() else torch.zeros_like(want, dtype=torch.bool)
    assert torch.equal(got[~ok], want[~ok]), (where, got, want)
    if sign and want.is_floating_point():
        assert torch.equal(got.signbit(), want.signbit()), (where, got, want)


KINDS = ["ties", "nan", "inf", "zeros"]
SHAPES = pytest.mark.parametrize(
    "shape", [(8, 6), (5, 3), (1, 3), (3, 5)], ids=["even", "uneven", "empty-shards", "3-of-4"]
)


def _amax_calls():
    """(name, fn, reduced dims)."""
    return [
        ("amax(0)", lambda t: t.amax(0), (0,)),
        ("amin(1)", lambda t: t.amin(1), (1,)),
        ("amax(-1, keepdim)", lambda t: t.amax(-1, keepdim=True), (1,)),
        ("amin(0, keepdim)", lambda t: t.amin(0, keepdim=True), (0,)),
        ("amax((0, 1))", lambda t: t.amax((0, 1)), (0, 1)),
        ("amin(())", lambda t: t.amin(()), (0, 1)),
    ]


@WORLDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
@pytest.mark.parametrize("kind", KINDS)
@SHAPES
def test_amax_amin_send_one_all_reduce_of_the_output(
    line_mesh, world, n, dtype, kind, shape
) -> None:
    x = _data(shape, dtype, kind)
    mesh = line_mesh(n)
    for placement in (Shard(0), Shard(1)):
        d = distribute_tensor(x, mesh, [placement])
        for name, fn, dims in _amax_calls():
            where = f"{name} of {dtype} {kind} {shape} on {placement}"
            want = fn(x)
            with CommCounter() as c:
                got = fn(d)
                full = got.full_tensor()
            if placement.dim in dims:
                assert got.placements == (Replicate(),), (where, got.placements)
                # the output's keys, once: never the reduced dim
                assert c.bytes == {"all_reduce": want.numel() * KEY_BYTES[dtype]}, (where, c.bytes)
            else:
                # a reduction over an unsharded dim: local, shards kept
                kept = placement.dim if want.ndim == x.ndim else placement.dim - (dims[0] < placement.dim)
                assert got.placements == (Shard(kept),), (where, got.placements)
                assert c.counts.keys() <= {"all_gather"}, where  # full_tensor only
                with CommCounter() as c:
                    fn(d)
                assert c.counts == {}, (where, c.counts)
            _same(full, want, where)


def _along_calls(dim: int):
    """(name, fn returning a tuple of tensors)."""
    return [
        (f"argmax({dim})", lambda t: (t.argmax(dim),)),
        (f"argmin({dim})", lambda t: (t.argmin(dim),)),
        (f"argmax({dim}, keepdim)", lambda t: (t.argmax(dim, keepdim=True),)),
        (f"max({dim})", lambda t: tuple(torch.max(t, dim))),
        (f"min({dim}, keepdim)", lambda t: tuple(torch.min(t, dim, keepdim=True))),
        (f"max({dim - 2})", lambda t: tuple(t.max(dim - 2))),
    ]


@WORLDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
@pytest.mark.parametrize("kind", KINDS)
@SHAPES
def test_argmax_and_max_dim_gather_pairs_not_the_dim(
    line_mesh, world, n, dtype, kind, shape
) -> None:
    x = _data(shape, dtype, kind, seed=1)
    mesh = line_mesh(n)
    for placement in (Shard(0), Shard(1)):
        d = distribute_tensor(x, mesh, [placement])
        for dim in (0, 1):
            for name, fn in _along_calls(dim):
                where = f"{name} of {dtype} {kind} {shape} on {placement}"
                want = fn(x)
                with CommCounter() as c:
                    got = fn(d)
                if placement.dim == dim:
                    assert all(g.placements == (Replicate(),) for g in got), where
                    # (key, index) pairs from every rank: 2 x the output
                    nbytes = 2 * want[-1].numel() * KEY_BYTES[dtype] * n
                    assert c.bytes == {"all_gather": nbytes}, (where, c.bytes)
                else:
                    assert c.counts == {}, (where, c.counts)
                    assert all(isinstance(g.placements[0], Shard) for g in got), where
                for g, w in zip(got, want, strict=True):
                    _same(g.full_tensor(), w, where, sign=True)


@WORLDS
def test_ties_across_shard_boundaries_take_the_first_index(line_mesh, world, n) -> None:
    mesh = line_mesh(n)
    # every rank holds the extreme: the first index, on rank 0, wins
    x = torch.ones(4 * n, 3)
    # the extreme on both sides of the first boundary (and NaNs later)
    y = torch.zeros(4 * n, 3)
    y[3:5] = 7.0
    y[-1, 1] = math.nan
    y[-2, 1] = math.nan
    for t in (x, y, -y, x.long(), (y.nan_to_num(nan=7)).long()):
        d = distribute_tensor(t, mesh, [Shard(0)])
        for fn in (lambda v: v.argmax(0), lambda v: v.argmin(0),
                   lambda v: torch.max(v, 0).indices, lambda v: torch.min(v, 0).indices):
            _same(fn(d).full_tensor(), fn(t), f"{t.dtype} {t[:, 1]}")
        _same(torch.max(d, 0).values.full_tensor(), torch.max(t, 0).values, "max values")


@WORLDS
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16,
                                   torch.int32, torch.uint8], ids=str)
def test_other_keyed_dtypes(line_mesh, world, n, dtype) -> None:
    x = _data((7, 4), dtype, "nan" if dtype.is_floating_point else "ties", seed=2)
    if dtype == torch.uint8:
        x = _data((7, 4), torch.int64, "ties", seed=2).add(2).to(dtype)
    d = distribute_tensor(x, line_mesh(n), [Shard(0)])
    for fn in (lambda t: t.amax(0), lambda t: t.amin((0, 1)), lambda t: t.argmax(0),
               lambda t: torch.min(t, 0).values, lambda t: torch.max(t, 0, True).indices):
        want = fn(x)
        with CommCounter() as c:
            got = fn(d)
        assert c.counts.keys() <= {"all_reduce", "all_gather"} and sum(c.counts.values()) == 1
        _same(got.full_tensor(), want, f"{dtype}")


@WORLDS
def test_logits_argmax_on_the_vocab_dim(line_mesh, world, n) -> None:
    """Accuracy in a tensor-parallel loop: logits sharded on the vocabulary;
    argmax(-1) sends (key, index) per row, not the rows' logits."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g)
    target = logits.argmax(-1)
    d = distribute_tensor(logits, line_mesh(n), [Shard(1)])
    with CommCounter() as c:
        pred = d.argmax(-1)
    assert c.bytes == {"all_gather": 2 * 6 * 4 * n}, c.bytes
    assert pred.placements == (Replicate(),)
    assert torch.equal(pred.full_tensor(), target)


@WORLDS
def test_partial_inputs_are_reduced_first(line_mesh, world, n) -> None:
    x = _data((6, 4), torch.float32, "ties", seed=4)
    d = distribute_tensor(x, line_mesh(n), [Partial()])
    for fn in (lambda t: t.amax(0), lambda t: t.argmax(1), lambda t: torch.min(t, 0).values):
        got = fn(d)
        assert got.placements == (Replicate(),)
        _same(got.full_tensor(), fn(x), "P(sum)")


@WORLDS
def test_fallbacks_keep_their_values(line_mesh, world, n) -> None:
    """Flattened argmax, an empty tensor, bool: the gathering fallback."""
    mesh = line_mesh(n)
    x = _data((5, 3), torch.float32, "nan", seed=5)
    d = distribute_tensor(x, mesh, [Shard(0)])
    _same(d.argmax().full_tensor(), x.argmax(), "argmax()")
    _same(d.argmin().full_tensor(), x.argmin(), "argmin()")
    e = torch.empty(0, 3)
    de = distribute_tensor(e, mesh, [Shard(0)])
    _same(de.amax(1).full_tensor(), e.amax(1), "amax of empty")
    _same(de.argmax(1).full_tensor(), e.argmax(1), "argmax of empty")
    b = x.nan_to_num() > 0
    db = distribute_tensor(b, mesh, [Shard(0)])
    _same(db.amax(0).full_tensor(), b.amax(0), "amax of bool")
    _same(torch.max(db, 0).indices.full_tensor(), torch.max(b, 0).indices, "max.dim of bool")


@pytest.mark.world_size(4)
def test_on_a_2d_mesh(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    for dtype in (torch.float32, torch.int64):
        x = _data((5, 7), dtype, "nan", seed=6)
        d = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
        # both dims reduced: one element per mesh axis
        with CommCounter() as c:
            got = d.amax((0, 1))
        assert c.bytes == {"all_reduce": 2 * KEY_BYTES[dtype]}, c.bytes
        _same(got.full_tensor(), x.amax((0, 1)), "amax (S0, S1)")
        # dim 1 reduced on axis 1 only: this rank's rows stay its shard
        rows = d.to_local().shape[0]
        with CommCounter() as c:
            got = d.argmax(1)
        assert got.placements == (Shard(0), Replicate())
        assert c.bytes == {"all_gather": 2 * rows * KEY_BYTES[dtype] * 2}, c.bytes
        _same(got.full_tensor(), x.argmax(1), "argmax(1) (S0, S1)")
        got = torch.min(d, 0, keepdim=True)
        assert got.values.placements == (Replicate(), Shard(1))
        _same(got.values.full_tensor(), torch.min(x, 0, True).values, "min(0) (S0, S1)")
        _same(got.indices.full_tensor(), torch.min(x, 0, True).indices, "min(0) (S0, S1)")
        # one dim sharded on both axes: pairs gathered on each, offsets nested
        d = distribute_tensor(x, mesh, [Shard(1), Shard(1)])
        for fn in (lambda t: t.argmax(1), lambda t: t.argmin(-1),
                   lambda t: torch.max(t, 1).values, lambda t: t.amin(1)):
            got = fn(d)
            assert got.placements == (Replicate(), Replicate())
            _same(got.full_tensor(), fn(x), "(S1, S1)")


@WORLDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
@pytest.mark.parametrize("kind", KINDS)
@SHAPES
def test_aminmax_along_a_sharded_dim_sends_two_outputs(
    line_mesh, world, n, dtype, kind, shape
) -> None:
    """``aminmax(dim=d)``: amin and amax over the sharded dim, one all-reduce
    of the output's keys each (was a gather of the dim); an unsharded dim
    sends nothing."""
    x = _data(shape, dtype, kind)
    mesh = line_mesh(n)
    for placement in (Shard(0), Shard(1)):
        d = distribute_tensor(x, mesh, [placement])
        for dim, keepdim in ((0, False), (1, True), (-1, False)):
            where = f"aminmax(dim={dim}, keepdim={keepdim}) of {dtype} {kind} {shape} on {placement}"
            want = torch.aminmax(x, dim=dim, keepdim=keepdim)
            with CommCounter() as c:
                got = torch.aminmax(d, dim=dim, keepdim=keepdim)
            if placement.dim == dim % x.ndim:
                assert c.counts == {"all_reduce": 2}, (where, c.counts)
                assert c.bytes == {"all_reduce": 2 * want.min.numel() * KEY_BYTES[dtype]}, (where, c.bytes)
                assert got.min.placements == got.max.placements == (Replicate(),), where
            else:
                assert c.counts == {}, (where, c.counts)
            _same(got.min.full_tensor(), want.min, where + " min")
            _same(got.max.full_tensor(), want.max, where + " max")
