"""Covers: dtensor/_async.py, ``redistribute(..., async_op=True)`` (dtensor/tensor.py,
dtensor/redistribute.py, dtensor/_comm.py).

An async redistribute returns a DTensor whose block is an
``AsyncCollectiveTensor``: in flight after ``redistribute``, after
``to_local()`` and through views; waited for by its first real use or
``wait()``; values equal to the synchronous result. The first tests drive
the wrapper with a hand-made pending handle (no process group), so "waited"
is observed, not inferred.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from dtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor._async import AsyncCollectiveTensor, Flight, settle
from dtensor.debug import CommCounter


class _Pending:
    """A collective's handle that counts its waits."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        return True


def _in_flight() -> tuple[AsyncCollectiveTensor, _Pending, torch.Tensor]:
    buf = torch.arange(12.0).view(3, 4)
    work = _Pending()
    return AsyncCollectiveTensor(buf, Flight([work])), work, buf


def test_views_stay_in_flight_and_share_the_buffer() -> None:
    t, work, buf = _in_flight()
    views = [t.view(4, 3), t[1], t.t(), t.narrow(1, 1, 2), t.detach(),
             t.view(torch.int32), *t.split(1)]
    assert work.waits == 0 and not t.completed
    for v in views:
        assert type(v) is AsyncCollectiveTensor and not v.completed
        assert v._elem.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    assert torch.equal(views[2].wait(), buf.t())
    # One wait completes every view of the same collective, once.
    assert work.waits == 1 and all(v.completed for v in views) and t.completed


def test_first_use_waits_once_and_returns_plain_tensors() -> None:
    t, work, buf = _in_flight()
    v = t[1:]
    out = v * 2  # reads data: waits
    assert work.waits == 1 and t.completed
    assert type(out) is torch.Tensor and torch.equal(out, buf[1:] * 2)
    assert torch.equal(t + 1, buf + 1) and work.waits == 1
    assert t.tolist() == buf.tolist() and "AsyncCollectiveTensor(" in repr(v)
    assert settle(t) is buf and settle(buf) is buf


def test_writes_wait_before_writing() -> None:
    t, work, buf = _in_flight()
    t[0].fill_(-1.0)  # a write into the buffer the collective fills
    assert work.waits == 1 and torch.equal(buf[0], torch.full((4,), -1.0))


def test_saving_and_copying_wait_and_keep_the_plain_result() -> None:
    t, work, buf = _in_flight()
    saved = io.BytesIO()
    torch.save(t[1], saved)
    assert work.waits == 1
    saved.seek(0)
    loaded = torch.load(saved)
    assert type(loaded) is torch.Tensor and torch.equal(loaded, buf[1])
    copied = copy.deepcopy(t)
    assert type(copied) is torch.Tensor and torch.equal(copied, buf)
    assert not _shares(copied, buf)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# Real worlds (Gloo processes, threads under --dist-sim) ----------------------
def _mesh(world) -> DeviceMesh:
    return DeviceMesh("cpu", list(range(world.size)))


def _pending(x: DTensor) -> bool:
    return type(x._local_tensor) is AsyncCollectiveTensor and not x._local_tensor.completed


@pytest.mark.world_size(4)
def test_gather_in_flight_through_to_local_and_views_until_first_use(world) -> None:
    mesh = _mesh(world)
    full = torch.arange(8.0 * world.size * 3).view(-1, 3)
    x = distribute_tensor(full, mesh, [Shard(0)])
    with CommCounter() as c:
        y = x.redistribute(mesh, [Replicate()], async_op=True)
    assert c.counts == ({"all_gather": 1} if world.size > 1 else {})
    if world.size == 1:  # nothing to send: a plain block
        assert type(y._local_tensor) is torch.Tensor
        return
    assert _pending(y) and y.placements == (Replicate(),)
    local = y.to_local()
    row, flat, yt = local[2], local.view(-1), y.t()  # views, DTensor view too
    assert type(local) is AsyncCollectiveTensor and not local.completed
    assert not row.completed and not flat.completed and _pending(yt)
    total = local.sum()  # the first real use
    assert type(total) is torch.Tensor and local.completed and row.completed
    assert torch.equal(total, full.sum()) and torch.equal(row.wait(), full[2])
    assert torch.equal(yt.to_local(), full.t())
    sync = x.redistribute(mesh, [Replicate()])
    assert type(sync.to_local()) is torch.Tensor and torch.equal(sync.to_local(), full)


@pytest.mark.world_size(4)
def test_dtensor_ops_and_wait_complete_the_result(world) -> None:
    mesh = _mesh(world)
    n = world.size
    pieces = torch.arange(5.0 * 2 * n).view(n, 5, 2)
    p = DTensor.from_local(pieces[world.rank], mesh, [Partial()])
    # Partial -> Replicate (all-reduce) and Partial -> uneven Shard(0)
    # (reduce-scatter of 5 rows over n ranks).
    r = p.redistribute(mesh, [Replicate()], async_op=True)
    s = p.redistribute(mesh, [Shard(0)], async_op=True)
    assert n == 1 or (_pending(r) and _pending(s))
    doubled = r * 2  # a DTensor op reads the block: waits
    assert type(doubled._local_tensor) is torch.Tensor
    assert torch.equal(doubled.full_tensor(), pieces.sum(0) * 2)
    assert torch.equal(s.to_local().wait(), s.redistribute(mesh, [Shard(0)]).to_local())
    assert torch.equal(s.full_tensor(), pieces.sum(0))
    # avg divides after the sum: the division reads it, so the result waits.
    a = DTensor.from_local(pieces[world.rank], mesh, [Partial("avg")])
    avg = a.redistribute(mesh, [Replicate()], async_op=True)
    assert torch.allclose(avg.to_local(), pieces.mean(0))


@pytest.mark.world_size(4)
def test_a_chain_of_async_redistributes(world) -> None:
    mesh = _mesh(world)
    n = world.size
    pieces = torch.arange(6.0 * n * 4).view(n, 6, 4) - 7
    p = DTensor.from_local(pieces[world.rank], mesh, [Partial()])
    a = p.redistribute(mesh, [Shard(0)], async_op=True)       # reduce-scatter
    b = a.redistribute(mesh, [Replicate()], async_op=True)    # all-gather of a
    c = b.redistribute(mesh, [Shard(0)], async_op=True)       # a local cut of b
    unread = a.redistribute(mesh, [Replicate()], async_op=True)  # read at the end
    d = c.redistribute(mesh, [Replicate()], async_op=True)    # all-gather of c
    if n > 1:
        # Each collective waited for its input; the last ones stay in flight,
        # and a result nobody has read yet holds up no later collective.
        assert a._local_tensor.completed and b._local_tensor.completed
        assert type(c._local_tensor) is torch.Tensor and _pending(d) and _pending(unread)
    want = pieces.sum(0)
    assert torch.equal(d.to_local() + 0, want)
    assert torch.equal(c.full_tensor(), want) and torch.equal(unread.to_local() * 1, want)


@pytest.mark.world_size(4)
def test_async_redistribute_differentiates_like_the_synchronous_one(world) -> None:
    mesh = _mesh(world)
    full = torch.arange(4.0 * world.size * 2).view(-1, 2)
    x = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_(True)
    y = x.redistribute(mesh, [Replicate()], async_op=True)
    assert world.size == 1 or _pending(y)
    local = y.to_local()  # differentiable, and still in flight
    assert y.requires_grad and local.requires_grad
    assert world.size == 1 or (type(local) is AsyncCollectiveTensor and not local.completed)
    (y * y).sum().backward()
    assert x.grad.placements == (Shard(0),)
    assert torch.equal(x.grad.full_tensor(), 2 * full)


@pytest.mark.world_size(4)
def test_uneven_gather_on_an_inner_dim_equals_the_synchronous_result(world) -> None:
    mesh = _mesh(world)
    full = torch.arange(3.0 * (2 * world.size + 1)).view(3, -1)  # uneven on dim 1
    x = distribute_tensor(full, mesh, [Shard(1)])
    y = x.redistribute(mesh, [Replicate()], async_op=True)
    # Rows before dim 1: the blocks are joined by a cat, which reads them.
    assert type(y.to_local()) is torch.Tensor and torch.equal(y.to_local(), full)
    row = distribute_tensor(full[:1], mesh, [Shard(1)])
    z = row.redistribute(mesh, [Replicate()], async_op=True)
    assert world.size == 1 or _pending(z)  # (1, k) blocks: a view of the buffer
    assert torch.equal(z.to_local().wait(), full[:1])
