"""Covers: the pointwise rule (dtensor/rules/pointwise.py) and cat/stack
(dtensor/rules/view.py ``_join``) on nested shards, one tensor dim sharded
over several mesh axes (``(Shard(0), Shard(0))``). Identically placed
operands keep the nesting and send nothing. The rules used to demote the
second Shard(0) to Replicate (cat/stack: every shard), so each such op
gathered, and ``F.dropout`` sent 3 all-gathers on a 3-rank sub-mesh of a 3-D
layout (found by tests/properties/test_random.py). Operands placed otherwise
(not nested, nested on other axes, broadcast, Partial) still give
single-device values. Even, uneven and empty shards; 2x2, 4x1 and 1x4
meshes, and a sub-mesh that leaves a rank outside."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtensor import DeviceMesh, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommCounter

S0, S1, R = Shard(0), Shard(1), Replicate()


MESHES = [(2, 2), (4, 1), (1, 4)]


def _mesh(shape) -> DeviceMesh:
    return DeviceMesh("cpu", torch.arange(4).reshape(shape))


def _value(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def _same(got, want, where: str) -> None:
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=lambda m: f"{where}: {m}")


UNARY = [
    ("x * 2", lambda x: x * 2.0),
    ("exp", torch.exp),
    ("add_(1)", lambda x: x.add_(1.0)),
    ("relu", F.relu),
]


@pytest.mark.world_size(4)
@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rows", [8, 5, 2, 0], ids=lambda r: f"rows{r}")
def test_identically_nested_operands_send_nothing(mesh_shape, rows):
    mesh = _mesh(mesh_shape)
    pls = [S0, S0]
    a, b = _value((rows, 3), 1), _value((rows, 3), 2)
    da, db = distribute_tensor(a, mesh, pls), distribute_tensor(b, mesh, pls)
    cases = [(name, f, (da,), (a,)) for name, f in UNARY] + [
        ("x * y", torch.mul, (da, db), (a, b)),
        ("where", lambda x, y: torch.where(x > 0, x, y), (da, db), (a, b)),
        ("addcmul", lambda x, y: torch.addcmul(x, x, y, value=0.5), (da, db), (a, b)),
        ("cat(dim=1)", lambda x, y: torch.cat([x, y], 1), (da, db), (a, b)),
        ("stack(dim=1)", lambda x, y: torch.stack([x, y], 1), (da, db), (a, b)),
    ]
    for name, f, dargs, args in cases:
        dargs = tuple(d.clone() for d in dargs)  # add_ writes its operand
        with CommCounter() as comm:
            out = f(*dargs)
        where = f"{name} on {mesh_shape} (S(0), S(0)), {rows} rows"
        assert comm.total == 0, f"{where}: sent {comm.counts}"
        assert tuple(out.placements) == (S0, S0), f"{where}: {out.placements}"
        _same(out.full_tensor(), f(*(t.clone() for t in args)), where)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("rows", [8, 5, 3], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize(
    "other",
    [(S0, R), (R, S0), (R, R), (S1, S0), (S0, S1), (Partial(), S0)],
    ids=lambda p: ",".join(map(str, p)),
)
def test_nested_with_otherwise_placed_operand_equals_single_device(rows, other):
    mesh = _mesh((2, 2))
    a, b = _value((rows, 4), 3), _value((rows, 4), 4)
    da = distribute_tensor(a, mesh, [S0, S0])
    if isinstance(other[0], Partial):  # pieces summing to b
        db = distribute_tensor(b, mesh, [R, other[1]]).redistribute(mesh, list(other))
    else:
        db = distribute_tensor(b, mesh, list(other))
    for name, f in [("x + y", torch.add), ("y * x", lambda x, y: y * x),
                    ("sub", torch.sub), ("x.mul_(y)", lambda x, y: x.clone().mul_(y)),
                    ("cat(dim=1)", lambda x, y: torch.cat([x, y], 1)),
                    ("stack(dim=0)", lambda x, y: torch.stack([y, x]))]:
        out = f(da, db)
        _same(out.full_tensor(), f(a, b), f"{name}: (S(0), S(0)) with {other}, {rows} rows")


@pytest.mark.world_size(4)
def test_nested_operand_broadcasts():
    mesh = _mesh((2, 2))
    a, row, col = _value((6, 4), 5), _value((4,), 6), _value((6, 1), 7)
    da = distribute_tensor(a, mesh, [S0, S0])
    drow, dcol = distribute_tensor(row, mesh, [R, R]), distribute_tensor(col, mesh, [S0, S0])
    with CommCounter() as comm:
        out = da * drow
    assert comm.total == 0 and tuple(out.placements) == (S0, S0), (comm.counts, out.placements)
    _same(out.full_tensor(), a * row, "(S(0), S(0)) * replicated row")
    with CommCounter() as comm:
        out = dcol + da
    assert comm.total == 0 and tuple(out.placements) == (S0, S0), (comm.counts, out.placements)
    _same(out.full_tensor(), col + a, "(S(0), S(0)) column + (S(0), S(0))")


@pytest.mark.world_size(4)
def test_dropout_on_nested_sub_mesh_sends_nothing():
    """The property test's case: (R, S(0), S(0)) on a 1x1x3 sub-mesh; rank 3
    is outside and gets an empty block."""
    import torch.distributed as dist

    mesh = DeviceMesh("cpu", torch.tensor([0, 1, 2]).reshape(1, 1, 3))
    x = distribute_tensor(torch.ones(5), mesh, [R, S0, S0])
    torch.manual_seed(0)
    with CommCounter() as comm:
        y = F.dropout(x, 0.5, True)
    assert comm.total == 0, comm.counts
    if dist.get_rank() < 3:
        assert tuple(y.placements) == (R, S0, S0)
        full = y.full_tensor()
        assert bool(((full == 0) | (full == 2)).all()), full
    else:
        assert y.to_local().numel() == 0

