"""Covers: dtensor/rules/nn.py's vocabulary-parallel embedding rule on Gloo
worlds: a table sharded on its rows (``Shard(0)``) with replicated indices is
looked up where it lies, each coordinate reading only the rows it holds, and
the output is ``Partial(sum)``. Values equal single device for even and
uneven tables (empty trailing pieces included), indices on the first and
last row of every piece, 1-D and 2-D indices and 2-D meshes; the wire
carries only the output's all-reduce, never the table (the replicate
fallback gathered it: docs/fallback_bytes.md, 100 B vs torch's 20 B); the
table's gradient through autograd equals single device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dtensor import DeviceMesh, Partial, Replicate, Shard, distribute_tensor, implicit_replication
from dtensor.debug import CommCounter
from dtensor.spec import shard_range

WORLDS = pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.world_size(n), id=f"w{n}") for n in (2, 4)]
)
# 8: even at 2 and 4 ranks; 10: 5+5 / 3+3+3+1; 5: 3+2 / 2+2+1+0; 3: 2+1 / 1+1+1+0
VOCABS = pytest.mark.parametrize("vocab", [8, 10, 5, 3])
DIM = 6


def _same(got, want, where: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (where, got.shape, want.shape)
    torch.testing.assert_close(got, want, atol=0, rtol=0, msg=lambda m: f"{where}: {m}")


def _edge_ids(vocab: int, pieces: int) -> torch.Tensor:
    """The first and last row of every non-empty piece, then every row."""
    edges = []
    for i in range(pieces):
        start, length = shard_range(vocab, pieces, i)
        if length:
            edges += [start, start + length - 1]
    return torch.tensor(edges + list(range(vocab - 1, -1, -1)), dtype=torch.int64)


@WORLDS
@VOCABS
def test_vocab_sharded_lookup_reads_local_rows_only(line_mesh, world, n, vocab) -> None:
    w = torch.randn(vocab, DIM, generator=torch.Generator().manual_seed(vocab))
    dw = distribute_tensor(w, line_mesh(n), [Shard(0)])
    ids1 = _edge_ids(vocab, n)
    ids2 = torch.stack([ids1, ids1.flip(0), torch.zeros_like(ids1)])  # [3, L]
    for name, ids in (("1-D", ids1), ("2-D", ids2)):
        rep = distribute_tensor(ids, line_mesh(n), [Replicate()])
        for how, given in (("plain", ids), ("Replicate", rep)):
            where = f"{name} {how} indices, vocab {vocab} on {n} ranks"
            with CommCounter() as c, implicit_replication():
                got = F.embedding(given, dw)
                assert got.placements == (Partial("sum"),), where
                full = got.full_tensor()
            # the output's rows summed once; the table never on the wire
            assert c.bytes == {"all_reduce": full.nbytes}, (where, c.bytes)
            _same(full, F.embedding(ids, w), where)


@WORLDS
def test_a_large_table_stays_put(line_mesh, world, n) -> None:
    vocab = 1001  # uneven at 2 and 4 ranks
    w = torch.randn(vocab, DIM, generator=torch.Generator().manual_seed(0))
    dw = distribute_tensor(w, line_mesh(n), [Shard(0)])
    ids = torch.tensor([[0, 1000, 500], [250, 251, 999]])
    di = distribute_tensor(ids, line_mesh(n), [Replicate()])
    with CommCounter() as c:
        full = F.embedding(di, dw).full_tensor()
    # 144 B for the 6 looked-up rows; gathering the table was n * 24024 B
    assert c.bytes == {"all_reduce": 6 * DIM * 4}, c.bytes
    _same(full, F.embedding(ids, w), "1001-row table")


@WORLDS
def test_vocab_sharded_lookup_of_other_dtypes_and_empty_indices(
    line_mesh, world, n
) -> None:
    w = torch.randn(7, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    dw = distribute_tensor(w, line_mesh(n), [Shard(0)])
    for ids in (torch.tensor([6, 0, 3], dtype=torch.int32), torch.zeros(0, 2, dtype=torch.int64)):
        di = distribute_tensor(ids, line_mesh(n), [Replicate()])
        where = f"ids {ids.dtype} {tuple(ids.shape)}"
        _same(F.embedding(di, dw).full_tensor(), F.embedding(ids, w), where)


@WORLDS
def test_out_of_range_index_raises_like_single_device(line_mesh, world, n) -> None:
    w = torch.randn(5, DIM)
    dw = distribute_tensor(w, line_mesh(n), [Shard(0)])
    for bad in (5, -1):
        ids = torch.tensor([0, bad])
        with pytest.raises(IndexError):
            F.embedding(ids, w)
        # not a silent zero row: every rank holds the replicated index and raises
        with pytest.raises(IndexError, match="out of range"):
            F.embedding(distribute_tensor(ids, line_mesh(n), [Replicate()]), dw)


@pytest.mark.world_size(4)
def test_vocab_sharded_lookup_on_a_2d_mesh(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    w = torch.randn(7, DIM, generator=torch.Generator().manual_seed(2))  # 4+3, then 2+2 / 2+1
    ids = torch.stack([_edge_ids(7, 4)[:6], _edge_ids(7, 2)[:6], torch.arange(6),
                       torch.arange(6).flip(0)])  # [4, 6]
    want = F.embedding(ids, w)
    rows = want.nbytes  # the whole output
    cases = [
        # (weight, indices, output, bytes of forward + full_tensor)
        ((Shard(0), Replicate()), (Replicate(), Replicate()), (Partial(), Replicate()),
         {"all_reduce": rows}),
        # batch sharded on the other axis: axis 0 reduces half the rows, axis 1 gathers them
        ((Shard(0), Replicate()), (Replicate(), Shard(0)), (Partial(), Shard(0)),
         {"all_reduce": rows // 2, "all_gather": rows}),
        ((Replicate(), Shard(0)), (Shard(0), Replicate()), (Shard(0), Partial()),
         {"all_reduce": rows // 2, "all_gather": rows}),
        # nested row pieces (2+2 / 2+1 rows): a partial sum per axis, which
        # full_tensor reduces in one all-reduce over both axes
        ((Shard(0), Shard(0)), (Replicate(), Replicate()), (Partial(), Partial()),
         {"all_reduce": rows}),
        # rows on axis 0, columns on axis 1
        ((Shard(0), Shard(1)), (Replicate(), Replicate()), (Partial(), Shard(2)),
         {"all_reduce": rows // 2, "all_gather": rows}),
    ]
    for pw, pi, pout, wire in cases:
        where = f"weight {pw}, indices {pi}"
        dw = distribute_tensor(w, mesh, list(pw))
        di = distribute_tensor(ids, mesh, list(pi))
        with CommCounter() as c:
            got = F.embedding(di, dw)
            assert got.placements == pout, (where, got.placements)
            full = got.full_tensor()
        assert c.bytes == wire, (where, c.bytes)
        _same(full, want, where)


@WORLDS
@VOCABS
@pytest.mark.parametrize("kw", [{}, {"padding_idx": -1}, {"padding_idx": 0},
                                {"scale_grad_by_freq": True}],
                         ids=["plain", "pad-last", "pad-first", "freq"])
def test_table_gradient_through_autograd_equals_single_device(
    line_mesh, world, n, vocab, kw
) -> None:
    torch.manual_seed(vocab)
    ref = nn.Embedding(vocab, DIM, **kw)
    emb = nn.Embedding(vocab, DIM, **kw)
    emb.weight = nn.Parameter(distribute_tensor(ref.weight.detach().clone(), line_mesh(n), [Shard(0)]))
    ids = torch.stack([_edge_ids(vocab, n), _edge_ids(vocab, n).flip(0)])
    g = torch.randn(*ids.shape, DIM)
    di = distribute_tensor(ids, line_mesh(n), [Replicate()])
    with CommCounter() as c:
        out = emb(di).full_tensor()
        (out * g).sum().backward()
    # forward's all-reduce of the output; the table's gradient is computed
    # where the replicated output gradient and indices are (no collective)
    assert c.bytes == {"all_reduce": out.nbytes}, c.bytes
    (ref(ids) * g).sum().backward()
    _same(out, ref(ids), "forward")
    grad = emb.weight.grad
    torch.testing.assert_close(grad.full_tensor(), ref.weight.grad)
    # a step moves nothing: the replicated gradient reaches the row pieces by a slice
    with CommCounter() as c, torch.no_grad():
        emb.weight.add_(grad, alpha=-0.1)
    assert c.total == 0, c.counts
    with torch.no_grad():
        ref.weight.add_(ref.weight.grad, alpha=-0.1)
    torch.testing.assert_close(emb.weight.full_tensor(), ref.weight)


@pytest.mark.world_size(2)
def test_max_norm_renormalises_the_sharded_table_like_single_device(
    line_mesh, world
) -> None:
    w = 3 * torch.randn(7, DIM, generator=torch.Generator().manual_seed(5))
    dw = distribute_tensor(w.clone(), line_mesh(2), [Shard(0)])
    ids = torch.tensor([[0, 3, 4], [6, 6, 1]])
    got = F.embedding(distribute_tensor(ids, line_mesh(2), [Replicate()]), dw, max_norm=1.0)
    want = F.embedding(ids, w, max_norm=1.0)  # renormalises w's looked-up rows in place
    torch.testing.assert_close(got.full_tensor(), want)
    torch.testing.assert_close(dw.full_tensor(), w)
    assert dw.placements == (Shard(0),)
