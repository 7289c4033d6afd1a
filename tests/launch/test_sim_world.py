"""Covers: launch/sim/world.py (ranks as threads over the threaded process group) and
the runtime's per-rank state (dtensor/_rank_state.py, meshes keyed by rank,
dtensor/_comm.py's per-world group cache) in such a world."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from launch.sim.threaded import entered
from launch.sim.world import SimAbort, SimWorld

pytestmark = pytest.mark.skipif(
    "RANK" in os.environ, reason="a simulated world swaps this process's c10d world; "
    "not inside a rank of a real world")


def _run(w: SimWorld, fn, timeout: float = 120.0):
    with entered():
        return w.run(fn, timeout)


def _run_in_new_world(n: int, fn, timeout: float = 120.0):
    """``fn`` once on a fresh n-rank world, closed afterwards."""
    w = SimWorld(n)
    try:
        return _run(w, fn, timeout)
    finally:
        with entered():
            w.close()


def test_each_thread_is_its_own_rank_and_a_failure_releases_the_others() -> None:
    w = SimWorld(4)
    try:
        outs = _run(w, lambda r: (dist.get_rank(), dist.get_world_size()))
        assert [o.value for o in outs] == [(r, 4) for r in range(4)]

        def one_fails(rank: int) -> float:
            t = torch.ones(1)
            if rank == 2:
                raise ValueError("rank 2 fails before the all_reduce")
            dist.all_reduce(t)
            return t.item()

        outs = _run(w, one_fails, timeout=60)
        assert isinstance(outs[2].error, ValueError)
        assert all(o.aborted and isinstance(o.error, SimAbort) for o in outs if o.rank != 2)
        # The world is usable again afterwards.
        def reduce(rank: int) -> float:
            t = torch.ones(1)
            dist.all_reduce(t)
            return t.item()

        assert [o.value for o in _run(w, reduce)] == [4.0] * 4
    finally:
        with entered():
            w.close()


def test_reduce_scatter_max_in_a_simulated_world() -> None:
    # PyTorch's threaded group reduce-scatters with SUM/AVG only; launch.sim.threaded
    # adds the other ops (Partial(max) -> Shard needs MAX).
    from dtensor import _comm

    w = SimWorld(2)
    try:
        outs = _run(w, lambda r: _comm.reduce_scatter(
            torch.tensor([1.0, 5.0]) * (r + 1), "max", 0, dist.group.WORLD).tolist())
        assert [o.error for o in outs] == [None, None]
        assert [o.value for o in outs] == [[2.0], [10.0]]
    finally:
        with entered():
            w.close()


def test_an_async_collective_hands_back_finished_work_holding_its_tensors() -> None:
    """The work a simulated collective returns is torch's: completed, waitable,
    its future's value the collective's tensors (made without the Python
    ``Future`` wrapper)."""

    def body(rank: int):
        t = torch.full((2,), float(rank + 1))
        work = dist.all_reduce(t, async_op=True)
        held = work.get_future().value()
        return (type(work) is dist.Work, work.is_completed(), work.wait(),
                held[0] is t, t.tolist())

    outs = _run_in_new_world(3, body)
    assert [o.error for o in outs] == [None] * 3
    assert [o.value for o in outs] == [(True, True, True, True, [6.0, 6.0])] * 3


@pytest.mark.parametrize("n", [4, 16])
def test_dtensor_layouts_in_a_simulated_world(n: int) -> None:
    # Red before meshes compared their rank (a cached spec handed rank 0's mesh,
    # hence rank 0's block, to every rank) and before the group cache locked
    # per world (one rank creating a group held the lock its peers needed).
    from dtensor import DeviceMesh, Replicate, Shard, distribute_tensor
    from dtensor._rank_state import enter_rank

    w = SimWorld(n, enter_rank)

    def body(rank: int):
        x = torch.arange(70.0).reshape(14, 5)
        got = []
        for shape in [(n,), (2, n // 2), (2, 2, n // 4)]:
            mesh = DeviceMesh("cpu", torch.arange(n).reshape(shape))
            rest = [Replicate()] * (len(shape) - 1)
            d = distribute_tensor(x, mesh, [Shard(0), *rest])
            expect = x.chunk(shape[0])[mesh.get_coordinate()[0]] \
                if mesh.get_coordinate()[0] < len(x.chunk(shape[0])) else x[:0]
            assert torch.equal(d.to_local(), expect), (rank, shape)
            full = d.redistribute(mesh, [Replicate()] * len(shape)).to_local()
            assert torch.equal(full, x), (rank, shape)
            got.append(torch.add(d, d).full_tensor().sum().item())
        return got

    try:
        outs = _run(w, body, timeout=120)
        errors = {o.rank: repr(o.error) for o in outs if o.error is not None}
        assert not errors, errors
        assert all(o.value == [2 * float(torch.arange(70.0).sum())] * 3 for o in outs)
    finally:
        with entered():
            w.close()


def test_random_state_is_per_rank_and_replicas_agree() -> None:
    # Every rank thread draws from its own generator state: replicas of
    # dtensor.rand agree, and no rank advances another's offset.
    import dtensor
    from dtensor import DeviceMesh, Replicate
    from dtensor._rank_state import enter_rank

    w = SimWorld(4, enter_rank)

    def body(rank: int):
        dtensor.manual_seed(5)
        mesh = DeviceMesh("cpu", torch.arange(4))
        a = dtensor.rand(4, 3, device_mesh=mesh, placements=[Replicate()]).to_local()
        b = dtensor.rand(4, 3, device_mesh=mesh, placements=[Replicate()]).to_local()
        return a.sum().item(), b.sum().item(), dtensor.random.get_rng_state().offset

    try:
        outs = _run(w, body)
        errors = {o.rank: repr(o.error) for o in outs if o.error is not None}
        assert not errors, errors
        assert len({o.value for o in outs}) == 1, [o.value for o in outs]
        assert outs[0].value[0] != outs[0].value[1]
    finally:
        with entered():
            w.close()


def test_on_wait_refuses_a_non_callable() -> None:
    from launch.sim.turn import on_wait

    with pytest.raises(TypeError, match="expected a callable taking no arguments, got 3"):
        on_wait(3)


def test_one_rank_runs_at_a_time_until_it_waits_for_the_others() -> None:
    """Between two collectives a rank runs alone: another rank's body never
    interleaves with it, though each gives up the GIL inside (a sleep, a
    torch op); at the collective the turn passes on and everyone finishes."""
    import threading
    import time

    log: list[tuple[int, str]] = []
    lock = threading.Lock()

    def body(rank: int) -> float:
        for phase in ("a", "b"):
            with lock:
                log.append((rank, phase + "-start"))
            for _ in range(3):
                time.sleep(0.002)  # gives up the GIL, not the turn
                torch.ones(64).sum()
            with lock:
                log.append((rank, phase + "-end"))
            t = torch.ones(1)
            dist.all_reduce(t)  # a wait for the others: the turn passes on
        return t.item()

    w = SimWorld(4)
    try:
        outs = _run(w, body)
        assert [o.value for o in outs] == [4.0] * 4, [o.error for o in outs]
    finally:
        with entered():
            w.close()
    assert len(log) == 16
    for i in range(0, 16, 2):  # every start is followed by its own end
        (r0, s0), (r1, s1) = log[i], log[i + 1]
        assert r0 == r1 and s0.endswith("start") and s1 == s0[0] + "-end", log


def test_a_rank_stuck_in_an_unknown_wait_gets_help_without_the_turn() -> None:
    """A rank that waits, holding the turn, for something only another rank
    does (here a plain ``threading.Event``, which the simulator does not
    know of) must not hang the world: once the turn has not changed hands
    for a while, the waiting ranks run without it."""
    import threading

    from launch.sim.turn import turn

    here = [threading.Event(), threading.Event()]

    def body(rank: int) -> int:
        # Whichever rank runs first waits, holding the turn, for the other.
        here[rank].set()
        if not here[1 - rank].wait(timeout=30):
            raise AssertionError(f"rank {1 - rank} never ran while rank {rank} waited")
        return rank

    before = turn.missed
    outs = _run_in_new_world(2, body, timeout=60)
    assert [o.value for o in outs] == [0, 1], [o.error for o in outs]
    assert turn.missed > before


def test_a_rank_busy_in_a_long_step_keeps_the_turn() -> None:
    """A rank that computes for much longer than the turn's wait (building a
    big cached table on first use) is working, not waiting for another rank:
    the ranks in line keep waiting, so none runs the step beside it."""
    import threading
    import time

    from launch.sim.turn import _PARKED_POLL_S, _TURN_WAIT_S, turn

    lock = threading.Lock()
    inside, most = [0], [0]

    def body(rank: int) -> int:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        # Past a waiting rank's longest poll, then past its wait for the turn.
        end = time.thread_time() + _PARKED_POLL_S + 4 * _TURN_WAIT_S
        while time.thread_time() < end:  # CPU work, no wait
            pass
        with lock:
            inside[0] -= 1
        return rank

    before = turn.missed
    outs = _run_in_new_world(2, body, timeout=60)
    assert [o.value for o in outs] == [0, 1], [o.error for o in outs]
    assert most[0] == 1, f"{most[0]} ranks ran the step at once"
    assert turn.missed == before


def test_a_failure_after_a_collective_leaves_the_others_its_result() -> None:
    """The last rank into a collective moves the data and goes on; if it then
    fails (releasing the world), the ranks still waiting for their turn get
    the finished collective's result, as on a real world, not a release."""

    def body(rank: int) -> float:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        if rank == 3:
            raise AssertionError("rank 3 fails after the all-reduce")
        return t.item()

    outs = _run_in_new_world(4, body)
    assert [o.value for o in outs[:3]] == [10.0] * 3, [o.error for o in outs]
    assert isinstance(outs[3].error, AssertionError)
