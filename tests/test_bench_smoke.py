"""Covers: bench/_comm_bytes.py (the byte counter the benchmarks trust) and the
lower bound of bench/redistribute_bytes.py, on known cases."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))

from _comm_bytes import CommBytes, wire_bytes
from redistribute_bytes import lower_bound


def test_wire_bytes_ring_model() -> None:
    assert wire_bytes("all_gather", 64, 4) == 48
    assert wire_bytes("reduce_scatter", 64, 2) == 32
    assert wire_bytes("all_reduce", 64, 4) == 96
    assert wire_bytes("all_reduce", 64, 1) == 0


def test_lower_bound_known_pairs() -> None:
    even = (8, 8)  # 256 bytes of float32
    assert lower_bound(("S0",), ("R",), (2,), even) == 128  # all-gather
    assert lower_bound(("P",), ("R",), (2,), even) == 256  # all-reduce
    assert lower_bound(("P",), ("S1",), (2,), even) == 128  # reduce-scatter
    assert lower_bound(("R",), ("S0",), (2,), even) == 0
    # slicing the other axis first makes the all-gather a quarter of the tensor
    assert lower_bound(("S0", "R"), ("R", "S1"), (2, 2), even) == 64
    # without all-to-all, S0 -> S1 costs a full all-gather
    assert lower_bound(("S0",), ("S1",), (2,), even, all_to_all=False) == 128
    assert lower_bound(("S0",), ("S1",), (2,), even) == 64


@pytest.mark.world_size(2)
def test_counts_inplace_and_functional_collectives(world) -> None:
    with CommBytes() as cb:
        t = torch.ones(4)
        dist.all_reduce(t)
        out = torch.empty(8)
        dist.all_gather_into_tensor(out, torch.ones(4))
        rs = funcol.reduce_scatter_tensor(torch.ones(8), "sum", 0, dist.group.WORLD)
        funcol.wait_tensor(rs)
    got = [(r.kind, r.buffer, r.n, r.wire) for r in cb.records]
    assert got == [
        ("all_reduce", 16, 2, 16.0),
        ("all_gather", 32, 2, 16.0),
        ("reduce_scatter", 32, 2, 16.0),
    ]
    assert t.tolist() == [2.0] * 4  # the mode passes the op through unchanged


@pytest.mark.world_size(2)
def test_counts_both_runtimes_alike_including_implicit_redistributes(world) -> None:
    import torch.distributed.tensor as tdt

    import dtensor
    from dtensor.debug import CommCounter

    seen = {}
    for name, lib in (("ours", dtensor), ("torch", tdt)):
        mesh = lib.DeviceMesh("cpu", [0, 1])
        a = lib.distribute_tensor(torch.ones(8, 4), mesh, [lib.Shard(0)])
        b = lib.distribute_tensor(torch.ones(8, 4), mesh, [lib.Shard(1)])
        with CommBytes() as cb, CommCounter() as cc:
            # the add redistributes an operand inside the runtime's dispatch
            c = a + b
        seen[name] = [(r.kind, r.buffer) for r in cb.records]
        assert c.full_tensor().eq(2).all()
        if name == "ours":  # the runtime's own counter agrees with the mode
            assert cc.bytes == {"all_gather": sum(b for _, b in seen[name])}
    assert seen["ours"] == seen["torch"] == [("all_gather", 128)]
