"""Covers: dtensor/debug.py (CommCounter, CommDebugMode, visualize_sharding) on Gloo worlds."""

from __future__ import annotations

import io
import re

import pytest
import torch

from dtensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Replicate,
    Shard,
    ShardingError,
    distribute_tensor,
)
from dtensor.debug import CommCounter, CommDebugMode, visualize_sharding

funcol = torch.ops.c10d_functional


@pytest.mark.world_size(2)
def test_comm_counter_counts_and_bytes(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    x = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    with CommCounter() as c:
        x.redistribute(mesh, [Replicate()])
    local_bytes = x.to_local().numel() * 4
    assert c.counts == {"all_gather": 1} and c["all_gather"] == 1 and c.total == 1
    assert c.bytes == {"all_gather": 2 * local_bytes} and c.total_bytes == 2 * local_bytes


@pytest.mark.world_size(2)
def test_comm_debug_mode_uses_torch_keys_and_reports_bytes(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    x = distribute_tensor(torch.ones(4, 6, dtype=torch.float64), mesh, [Shard(0)])
    p = distribute_tensor(torch.ones(5, dtype=torch.int32), mesh, [Partial()])
    with CommDebugMode() as comm:
        x.redistribute(mesh, [Replicate()])
        p.redistribute(mesh, [Replicate()])
        p.redistribute(mesh, [Replicate()])
    counts = comm.get_comm_counts()
    assert counts[funcol.all_gather_into_tensor] == 1
    assert counts[funcol.all_reduce] == 2
    assert counts["all_reduce"] == 2  # our kind names work as keys too
    assert counts[funcol.reduce_scatter_tensor] == 0  # absent keys read as 0
    assert counts.get(funcol.reduce_scatter_tensor) is None and counts.get("all_reduce") == 2
    assert funcol.reduce_scatter_tensor not in counts  # reading did not insert it
    assert comm.get_total_counts() == 3
    size = comm.get_comm_bytes()
    assert size[funcol.all_gather_into_tensor] == 4 * 6 * 8  # the gathered buffer
    assert size[funcol.all_reduce] == 2 * 5 * 4
    assert comm.get_total_bytes() == 4 * 6 * 8 + 2 * 5 * 4
    with comm:  # counting restarts
        pass
    assert comm.get_total_counts() == 0 and comm.get_total_bytes() == 0
    assert "get_total_counts()=0" in repr(comm)


class _Row(torch.nn.Module):
    """Row-parallel linear: a Shard(1) input times a Shard(0) weight is Partial."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh
        w = torch.arange(12.0).reshape(4, 3) / 10
        self.weight = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))

    def forward(self, x):
        y = torch.mm(x, self.weight)
        return y.redistribute(self.mesh, [Replicate()])


class _Net(torch.nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.row = _Row(mesh)

    def forward(self, x):
        return self.row(x).sum()


@pytest.mark.world_size(2)
def test_comm_debug_mode_breaks_counts_down_by_module_and_phase(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    net = _Net(mesh)
    x = distribute_tensor(torch.ones(2, 4), mesh, [Shard(1)])
    with CommDebugMode() as comm:
        net(x).backward()
    per = comm.comm_module_counts
    fwd = per["_Net.row"]["forward"]
    assert fwd[funcol.all_reduce] == 1  # the Partial -> Replicate of the row output
    assert per["_Net"]["forward"][funcol.all_reduce] >= 1  # parents count it too
    for phase in ("forward", "backward"):
        total = sum(per["Global"][phase].values())
        assert total == sum(
            n for op, n in comm.get_comm_counts().items()
        ) - sum(per["Global"]["backward" if phase == "forward" else "forward"].values())
    assert comm.get_sharding_info() == {"_Net.row.weight": (Shard(0),)}
    seen = comm.get_parameter_info()["_Net.row"]["weight"]
    assert torch.equal(seen.to_local(), net.row.weight.to_local())
    table = comm.generate_comm_debug_tracing_table()
    assert "_Net.row" in table and "all_reduce x1" in table


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net1 = torch.nn.Linear(4, 8)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


@pytest.mark.world_size(2)
def test_comm_debug_mode_files_tp_collectives_under_layer_and_phase_as_torch(world) -> None:
    # PyTorch's test_MLP_module_tracing: the row-parallel output all-reduce is
    # net2's forward (it runs in a forward hook), the column-parallel input
    # gradient all-reduce is net1's backward; an optimizer's is Global's.
    from dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = DeviceMesh("cpu", [0, 1])
    model = parallelize_module(
        _MLP(), mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
    )
    x = torch.ones(2, 4, requires_grad=True)
    with CommDebugMode() as comm:
        model(x).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    per = comm.comm_module_counts
    ar = funcol.all_reduce
    assert per["_MLP.net2"]["forward"][ar] == 1
    assert per["_MLP.net2"]["backward"][ar] == 0
    assert per["_MLP.net1"]["forward"][ar] == 0
    assert per["_MLP.net1"]["backward"][ar] == 1
    assert per["_MLP"]["forward"][ar] == 1 and per["_MLP"]["backward"][ar] == 1
    assert "_MLP.relu" not in per or sum(per["_MLP.relu"]["forward"].values()) == 0
    # clip_grad_norm_'s reduction ran outside any module and outside backward.
    assert per["Global"]["backward"][ar] == 1
    assert per["Global"]["forward"][ar] == comm.get_comm_counts()[ar] - 1 >= 2
    nbytes = comm.comm_module_bytes["_MLP.net2"]["forward"][ar]
    assert nbytes == 2 * 4 * 4  # the (2, 4) float32 output
    table = comm.generate_comm_debug_tracing_table()
    assert re.search(r"_MLP\.net1\n\s+backward: all_reduce x1", table), table


def _parse(table: str) -> dict[int, tuple[slice, slice]]:
    """{rank: (row range, col range)} from a visualize_sharding table."""
    lines = table.splitlines()[1:]
    cols = re.findall(r"(?:cols )?(\d+):(\d+)", lines[0])
    out = {}
    for line in lines[1:]:
        if not line.strip() or line.startswith(("partial", "empty")):
            continue
        rows = re.match(r"rows (\d+):(\d+)", line)
        rslice = slice(int(rows[1]), int(rows[2])) if rows else slice(None)
        body = line[rows.end():] if rows else line
        for (c0, c1), cell in zip(cols, re.split(r"\s{2,}", body.strip()), strict=True):
            for r in re.findall(r"\d+", cell):
                out[int(r)] = (rslice, slice(int(c0), int(c1)))
    return out


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    ("shape", "placements"),
    [
        ((4, 6), [Shard(0), Shard(1)]),
        ((5, 3), [Shard(1), Shard(0)]),  # uneven: some blocks empty
        ((4, 6), [Replicate(), Shard(1)]),  # replicas share a cell
        ((9,), [Shard(0), Shard(0)]),
        ((3, 2), [Partial(), Replicate()]),
    ],
)
def test_visualize_sharding_cells_name_the_ranks_that_hold_each_block(world, shape, placements) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    x = distribute_tensor(full, mesh, placements)
    text = visualize_sharding(x, all_ranks=True, file=io.StringIO())
    cells = _parse(text)
    mine = x.to_local()
    if mine.numel() == 0:
        assert world.rank not in cells and f"{world.rank}" in text.splitlines()[-1]
        return
    rows, cols = cells[world.rank]
    want = full[rows] if full.ndim == 1 else full[rows, cols]
    if full.ndim == 1:
        want = full[cols]
    if any(p.is_partial() for p in placements):
        assert "partial" in text
    else:
        assert torch.equal(mine, want)
    assert mine.shape == want.shape


@pytest.mark.world_size(4)
def test_visualize_sharding_prints_once_by_default(world, capsys) -> None:
    mesh = DeviceMesh("cpu", [[2, 3], [0, 1]])
    x = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Shard(1)])
    got = visualize_sharding(x, header="weights")
    printed = capsys.readouterr().out
    if world.rank == 2:  # the mesh's first member
        assert printed.startswith("weights\n") and got in printed
        lines = printed.splitlines()
        assert re.fullmatch(r"\s+cols 0:2\s+cols 2:4", lines[2])
        assert re.fullmatch(r"rows 0:2\s+rank 2\s+rank 3", lines[3])
        assert re.fullmatch(r"rows 2:4\s+rank 0\s+rank 1", lines[4])
    else:
        assert printed == "" and got is None


@pytest.mark.world_size(2)
def test_visualize_sharding_rejects_3d_on_every_rank_and_skips_outsiders(world) -> None:
    mesh = DeviceMesh("cpu", [1])
    x = distribute_tensor(torch.ones(2, 2, 2), mesh, [Shard(0)])
    with pytest.raises(ShardingError, match="1-D and 2-D"):
        visualize_sharding(x)
    y = DTensor.from_local(torch.ones(2), mesh, [Shard(0)])
    got = visualize_sharding(y, all_ranks=True, file=io.StringIO())
    assert (got is None) == (world.rank == 0)


def test_sharding_table_layout_without_a_world() -> None:
    # The table is pure layout math: readable in one process, for any mesh.
    from dtensor.debug import sharding_table
    from dtensor.spec import DTensorSpec, TensorMeta

    # spec-only mesh: under torchrun N<4 the world is smaller than it
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], _init_backend=False)

    def table(shape, placements):
        meta = TensorMeta(shape, tuple(range(len(shape)))[::-1], torch.float32)
        return sharding_table(DTensor(torch.empty(0), DTensorSpec(mesh, placements, meta)))

    assert table((4, 6), (Shard(0), Shard(1))).splitlines()[1:] == [
        "          cols 0:3  cols 3:6",
        "rows 0:2  rank 0    rank 1",
        "rows 2:4  rank 2    rank 3",
    ]
    assert table((3,), (Shard(0), Shard(0))).splitlines()[1:] == [
        "0:1     1:2     2:3",
        "rank 0  rank 1  rank 2",
        "empty blocks (uneven shards): ranks 3",
    ]
