"""Covers: lookups of the communication audit (bench/comm_audit.py) whose
pieces (``Partial``) ours kept where PyTorch's DTensor reduces them onto a
shard first, each run with both runtimes on a 2-rank Gloo world as the audit
counts them (the op plus making its result a full tensor). Ours must send no
more wire bytes (for equal bytes, no more collectives) than PyTorch's and
equal the single-device value:

- ``embedding`` of table pieces keeps them only where reducing the output
  moves the fewest bytes; an output larger than the table (rows looked up
  more than once in all) reduces the table first (dtensor/rules/nn.py);
- ``gather`` of pieces of the source and the index reduce-scatters both
  onto a shared shard of another dim where that and gathering the output
  move less than reducing the index and then the output
  (dtensor/rules/join.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_comm_audit_fixes_dist import _check_no_more_than_torch, _pieces


def _lookup(table, index):
    return F.embedding(index, table)


def _index_pieces(index: torch.Tensor, kind: str) -> list[torch.Tensor]:
    """Two pieces whose ``kind`` combination is ``index`` (each a valid index)."""
    if kind == "Psum":
        return [index - index.clamp(max=1), index.clamp(max=1)]
    if kind == "Pmax":
        return [index, torch.zeros_like(index)]
    if kind == "Pmin":
        return [index, torch.full_like(index, int(index.max()))]
    return [index]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("Psum", "R"), ("Pavg", "R"), ("Pmax", "R"), ("Pmin", "R"),
                                     ("Psum", "Psum"), ("Pmax", "Pmax"), ("Pmin", "Pmin")])
def test_embedding_reduces_a_table_smaller_than_its_output(world, layouts) -> None:
    # 25 lookups of 5 floats (500 B) in a table of 10 rows (200 B)
    table = _pieces((10, 5), 100)
    if layouts[0] == "Pavg":  # equal pieces: their mean is the first, as _global reads it
        table = [table[0], table[0]]
    index = torch.randint(0, 10, (5, 5), generator=torch.Generator().manual_seed(101))
    _check_no_more_than_torch(world, _lookup,
                              [(layouts[0], table), (layouts[1], _index_pieces(index, layouts[1]))])
    if layouts[1] == "R":
        # 3 lookups (60 B) in the same table: its pieces stay, the output reduced
        _check_no_more_than_torch(world, _lookup,
                                  [(layouts[0], table), ("R", [torch.tensor([1, 7, 3])])])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["Psum", "Pmax", "Pmin"])
def test_gather_of_pieces_reduce_scatters_source_and_index(world, kind) -> None:
    x = _pieces((10, 5), 103)
    index = torch.randint(0, 5, (10, 2), generator=torch.Generator().manual_seed(104))
    fn = lambda a, i: torch.gather(a, 1, i)  # noqa: E731
    _check_no_more_than_torch(world, fn, [(kind, x), (kind, _index_pieces(index, kind))])
    # pieces of the source alone against a whole index stay pieces
    _check_no_more_than_torch(world, fn, [(kind, x), ("R", [index])])
