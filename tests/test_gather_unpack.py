"""Covers: dtensor/_comm.py ``unpack_chunks``, ``gather_chunks`` and
``all_gather_cat`` (the unpack after an all-gather), as ``redistribute`` uses them.

The gathered buffer is the result, viewed, when the dims before the gather
dim have one element (dim 0, or blocks like ``(1, k)``), even for uneven
(padded) pieces; otherwise one ``cat`` joins the ranks' real rows. The unpack
is checked in one process (copies counted by a dispatch mode that records
every aten op, storage sharing by data pointer); the collective's values on
real and simulated worlds.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dtensor import DeviceMesh, Replicate, Shard, _comm, distribute_tensor

# Ops that write a new buffer from an existing one.
COPIES = {"cat", "clone", "copy_", "_to_copy", "stack", "contiguous"}


class _Ops(TorchDispatchMode):
    """Records the aten op names run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def copies(self) -> list[str]:
        return [n for n in self.names if n in COPIES]


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _piece(full: torch.Tensor, dim: int, n: int, rank: int) -> torch.Tensor:
    chunks = torch.chunk(full, n, dim)
    if rank < len(chunks):
        return chunks[rank].clone()
    shape = list(full.shape)
    shape[dim] = 0
    return full.new_empty(shape)


def _stacked(full: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """What the all-gather fills: every rank's piece, padded, stacked on dim 0."""
    piece = -(-full.shape[dim] // n)
    padded = []
    for r in range(n):
        p = _piece(full, dim, n, r)
        pad = list(p.shape)
        pad[dim] = piece - p.shape[dim]
        padded.append(torch.cat([p, torch.full(pad, -1.0)], dim))
    return torch.cat(padded, 0)


# (global shape, gather dim): view path (dims before `dim` of size 1) and the
# general path, each even and uneven for some of the rank counts.
VIEW_CASES = [((12, 3), 0), ((13, 3), 0), ((1, 12), 1), ((1, 13, 2), 1), ((1, 1, 9), 2),
              ((0, 3), 0), ((1, 0), 1)]
CAT_CASES = [((2, 12), 1), ((3, 13, 2), 1), ((2, 1, 9), 2), ((0, 5), 1)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize(("shape", "dim"), VIEW_CASES)
def test_unpack_is_a_view_of_the_buffer_where_the_layout_allows(n, shape, dim) -> None:
    full = torch.arange(float(torch.Size(shape).numel())).view(shape)
    stacked = _stacked(full, dim, n)
    with _Ops() as ops:
        out = _comm.unpack_chunks(stacked, n, dim, shape[dim])
    assert torch.equal(out, full) and out.is_contiguous()
    assert ops.copies() == [], ops.names
    assert _shares(out, stacked)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize(("shape", "dim"), CAT_CASES)
def test_unpack_elsewhere_joins_the_pieces_with_one_cat(n, shape, dim) -> None:
    full = torch.arange(float(torch.Size(shape).numel())).view(shape)
    stacked = _stacked(full, dim, n)
    with _Ops() as ops:
        out = _comm.unpack_chunks(stacked, n, dim, shape[dim])
    assert torch.equal(out, full) and out.is_contiguous()
    assert ops.copies() == ["cat"], ops.names


# Real worlds: the values through the collective, uneven pieces included ------
@pytest.mark.world_size(4)
@pytest.mark.parametrize(("shape", "dim"), VIEW_CASES + CAT_CASES)
def test_gather_chunks_rebuilds_the_tensor(world, shape, dim) -> None:
    full = torch.arange(float(torch.Size(shape).numel())).view(shape)
    local = _piece(full, dim, world.size, world.rank)
    out = _comm.gather_chunks(local, dim, shape[dim], world.group)
    assert torch.equal(out, full) and out.is_contiguous()


@pytest.mark.world_size(4)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool, torch.int16])
def test_all_gather_cat_through_a_carrier(world, dtype) -> None:
    n = world.size
    full = (torch.arange(4.0 * n).view(2 * n, 2) % 3).to(dtype)
    local = full[2 * world.rank: 2 * world.rank + 2]
    out = _comm.all_gather_cat(local, world.group)
    assert out.dtype == dtype and torch.equal(out, full)
    if dtype == torch.complex64:  # a view of the buffer of real pairs
        assert out._base is not None and out._base.dtype == torch.float32


@pytest.mark.world_size(4)
def test_redistribute_of_one_row_blocks_returns_a_view_of_the_buffer(world) -> None:
    mesh = DeviceMesh("cpu", list(range(world.size)))
    n = world.size
    for k in (2 * n, 2 * n + 1):
        full = torch.arange(3.0 * k).view(1, k, 3)
        x = distribute_tensor(full, mesh, [Shard(1)])
        out = x.redistribute(mesh, [Replicate()]).to_local()
        assert torch.equal(out, full)
        if n > 1:  # a view of the (n * piece)-row buffer the all-gather filled
            assert out._base is not None
            assert out._base.numel() == n * -(-k // n) * 3
