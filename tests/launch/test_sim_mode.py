"""Covers: launch/modes/simulated.py and launch/sim/fanout.py (``pytest --dist-sim``):
world_size tests run with n ranks as threads of one process, @given tests in
lockstep across them, failures with simulated and real Replay lines, and
``--dist-sim-confirm`` telling runtime bugs from simulator faults."""

from __future__ import annotations

import re

import pytest

SUITE = """
import os
import threading

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st


@pytest.mark.world_size(4)
def test_ranks_are_threads_of_one_process(world):
    assert (world.rank, world.size) == (dist.get_rank(), 4)
    assert threading.current_thread() is not threading.main_thread()
    t = torch.tensor([float(world.rank)])
    dist.all_reduce(t)
    assert t.item() == 6.0


@pytest.mark.world_size(4)
@settings(max_examples=30, database=None)
@given(x=st.integers(0, 100))
def test_lockstep_all_reduce(world, x):
    t = torch.tensor([x])
    dist.all_reduce(t)
    assert t.item() == 4 * x


@pytest.mark.world_size(4)
@settings(max_examples=50, database=None)
@given(x=st.integers(0, 100))
def test_fails_on_rank_3_from_10(world, x):
    t = torch.tensor([x])
    dist.all_reduce(t)
    assert not (world.rank == 3 and x >= 10), f"rank 3 got x={x}"


@pytest.mark.world_size(2)
def test_fails_everywhere(world):
    assert world.size == 3, "a bug of the code under test"


@pytest.mark.world_size(2)
def test_passes_only_in_separate_processes(world):
    # Relies on one rank per process: the simulation's fault, not the code's.
    assert threading.current_thread() is threading.main_thread()


@pytest.mark.world_size(2)
def test_skipped_on_every_rank(world):
    pytest.skip("not here")
"""


def test_world_size_tests_run_as_threads(child) -> None:
    r = child({"test_s.py": SUITE}, "-m", "pytest", "--dist-sim", "-p", "no:cacheprovider",
              "test_s.py", "-k", "threads or lockstep or skipped", "-rs")
    assert r.rc == 0, r.out
    assert "2 passed, 1 skipped" in r.out, r.out
    assert "not here" in r.out
    assert "simulated worlds of 2, 4 ranks" in r.out, r.out


def test_xdist_workers_host_simulated_worlds_and_the_controller_sums_examples(child) -> None:
    """``pytest -n 2 --dist-sim``: each worker hosts its tests' simulated
    worlds; the controller (which runs no test) prints one summary line with
    every worker's examples (was: no line at all, so no example count)."""
    args = ("-m", "pytest", "--dist-sim", "-p", "no:cacheprovider", "test_s.py",
            "-k", "threads or lockstep or skipped")
    one = child({"test_s.py": SUITE}, *args)
    two = child({"test_s.py": SUITE}, *args, "-n", "2")
    assert one.rc == 0 and two.rc == 0, one.out + two.out
    assert "2 passed, 1 skipped" in two.out, two.out
    assert "simulated worlds of 2, 4 ranks (threads of each xdist worker); 30 hypothesis " \
        "examples" in two.out, two.out
    assert "(threads of this process); 30 hypothesis examples" in one.out, one.out


def test_a_one_rank_failure_shrinks_in_lockstep_and_prints_both_replays(child) -> None:
    r = child({"test_s.py": SUITE}, "-m", "pytest", "--dist-sim", "-p", "no:cacheprovider",
              "test_s.py", "-k", "rank_3")
    assert r.rc == 1, r.out
    assert "example failed on rank(s) [3] of [0, 1, 2, 3]" in r.out, r.out
    assert "x=10" in r.out, r.out  # every rank shrank to the same minimal example
    assert "Replay: pytest --dist-sim 'test_s.py::test_fails_on_rank_3_from_10'" in r.out
    assert ("Replay (real world): torchrun --nproc_per_node=4 -m pytest "
            "'test_s.py::test_fails_on_rank_3_from_10'") in r.out


@pytest.mark.slow  # re-runs failures in real worlds: the full run
def test_confirm_tells_runtime_bugs_from_simulator_faults(child) -> None:
    r = child({"test_s.py": SUITE}, "-m", "pytest", "--dist-sim", "--dist-sim-confirm",
              "-p", "no:cacheprovider", "test_s.py", "-k", "everywhere or separate",
              timeout=600)
    assert r.rc == 1, r.out
    assert "reproduced on a real 2-rank world (a runtime bug)" in r.out, r.out
    assert "SIMULATOR FAULT? the real 2-rank world passes" in r.out, r.out


def test_dist_sim_is_refused_under_torchrun(child) -> None:
    r = child({"test_s.py": SUITE}, "-m", "torch.distributed.run", "--nproc_per_node=1",
              "-m", "pytest", "--dist-sim", "-p", "no:cacheprovider", "test_s.py")
    assert r.rc != 0
    assert "--dist-sim runs simulated worlds inside one process" in r.out, r.out


DRAWS = """
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st


@pytest.mark.world_size(4)
@settings(max_examples=100, database=None)
@given(data=st.data())
def test_many_body_draws_agree(world, data):
    xs = [data.draw(st.lists(st.integers(0, 9), max_size=6)) for _ in range(30)]
    t = torch.tensor([float(sum(map(sum, xs)))])
    dist.all_reduce(t)
    assert t.item() == 4 * sum(map(sum, xs))
"""


def test_body_draws_are_the_same_on_every_rank_under_frequent_thread_switches(child) -> None:
    # The first rank to reach a draw draws it; the others replay its choices
    # as they appear. Swapping the engine's choice list back after each draw
    # raced the next draw's drawer ("the engine's draw made 0"); switching
    # threads every 0.2 ms made it show.
    script = ("import sys; sys.setswitchinterval(2e-4); import pytest; "
              "sys.exit(pytest.main(['--dist-sim', '-p', 'no:cacheprovider', '-q', 'test_d.py']))")
    r = child({"test_d.py": DRAWS}, "-c", script)
    assert r.rc == 0, r.out
    assert "1 passed" in r.out, r.out


COPIES = """
import threading

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

import launch.sim.draws

# A draw that waits for the other ranks must never wait for its own copy: no
# fallback timeout here, so a draw that is not replayed hangs the test.
launch.sim.draws._COPY_WAIT_S = 3600
SEEN = {}
LOCK = threading.Lock()


def _reduced(v):
    t = torch.tensor([v])
    dist.all_reduce(t)  # inside the draw: every rank must draw it itself
    return int(t.item())


class Box:  # holds rank state as far as the fan-out knows: replayed
    def __init__(self, v):
        self.v, self.rank = v, dist.get_rank()


@pytest.mark.world_size(4)
@settings(max_examples=20, database=None)
@given(data=st.data())
def test_copied_replayed_and_collective_draws(world, data):
    x = data.draw(st.integers(1, 5).map(lambda n: torch.arange(float(n))))
    total = data.draw(st.integers(0, 9).map(_reduced))
    box = data.draw(st.integers(0, 9).map(Box))
    assert total % 4 == 0
    assert box.rank == world.rank  # built on this rank's thread
    with LOCK:
        SEEN[world.rank] = x
    dist.barrier()
    assert len({id(t) for t in SEEN.values()}) == 4  # each rank its own copy
    assert all(torch.equal(t, x) for t in SEEN.values())
    dist.barrier()
    x.add_(world.rank)  # a write stays on its rank
    dist.barrier()
    assert [int(SEEN[r][0]) for r in range(4)] == [0, 1, 2, 3]
    dist.barrier()
"""


def test_plain_draws_are_copied_collective_and_stateful_ones_replayed(child) -> None:
    """Body draws of plain values (a tensor) reach each rank as its own copy;
    a draw that runs a collective, and one whose value holds rank state, are
    drawn by every rank (the collective draw would hang if the others waited
    for the drawer's value)."""
    r = child({"test_c.py": COPIES}, "-m", "pytest", "--dist-sim", "--dist-timeout", "60",
              "-p", "no:cacheprovider", "-q", "test_c.py", timeout=300)
    assert r.rc == 0, r.out
    assert "1 passed" in r.out, r.out


@pytest.mark.parametrize("answer", [[(2, "t.py::x")], [("2", "t.py::x", {})], "2", [(True, "t.py::x", {})]],
                         ids=["two-fields", "size-str", "not-a-list", "size-bool"])
def test_a_malformed_smaller_worlds_hook_answer_names_the_hook(answer) -> None:
    from types import SimpleNamespace

    from launch.modes.simulated import SimMode

    mode = SimMode.__new__(SimMode)
    mode.config = SimpleNamespace(hook=SimpleNamespace(
        pytest_dist_sim_smaller_worlds=lambda item, size: answer))
    item = SimpleNamespace(nodeid="t.py::x[4ranks]")
    with pytest.raises(pytest.UsageError, match=r"pytest_dist_sim_smaller_worlds\(item='t.py::x\[4ranks\]', size=4\) must return"):
        mode._variants(item, 4)
    mode.config.hook.pytest_dist_sim_smaller_worlds = lambda item, size: [[2, "t.py::x[2ranks]", {"A": "1"}]]
    assert mode._variants(item, 4) == [(2, "t.py::x[2ranks]", {"A": "1"})]


def test_plain_copies_equal_deepcopy_views_and_leaves_included() -> None:
    """The fan-out's fast copy of drawn tensors gives what ``copy.deepcopy``
    gives: values, offsets and strides, views drawn together still sharing
    one (new) storage, ``requires_grad`` leaves; anything else is left to
    ``deepcopy`` (a tensor with a gradient, a subclass, a dict)."""
    import copy

    import torch

    from launch.sim.copies import _SLOW, _copy_plain
    from launch.sim.copies import private as _private

    base = torch.arange(12.0).reshape(3, 4)
    leaf = torch.ones(2, requires_grad=True)
    value = (base, base.t(), [base[1:, 2:], torch.empty(0, 3)], 7, leaf)
    mine, theirs = _private(value), copy.deepcopy(value)
    flat = lambda v: [v[0], v[1], v[2][0], v[2][1], v[4]]  # noqa: E731
    for a, b, orig in zip(flat(mine), flat(theirs), flat(value), strict=True):
        assert type(a) is torch.Tensor and torch.equal(a, b)
        assert (a.stride(), a.storage_offset(), a.requires_grad, a.is_leaf) == \
               (b.stride(), b.storage_offset(), b.requires_grad, b.is_leaf)
        assert orig.numel() == 0 or a.untyped_storage().data_ptr() != orig.untyped_storage().data_ptr()
    assert type(mine) is tuple and type(mine[2]) is list and mine[3] == 7
    # views of one drawn storage share one copy, as deepcopy's memo makes them
    ptrs = {t.untyped_storage().data_ptr() for t in flat(mine)[:3]}
    assert len(ptrs) == 1
    mine[0].add_(100)
    assert torch.equal(mine[1], mine[0].t()) and torch.equal(base, torch.arange(12.0).reshape(3, 4))

    with_grad = torch.ones(2, requires_grad=True)
    with_grad.grad = torch.ones(2)

    class Sub(torch.Tensor):
        pass

    for other in (with_grad, torch.ones(2).as_subclass(Sub), {"a": torch.ones(1)},
                  (torch.ones(1), object())):
        assert _copy_plain(other, {}, 0) is _SLOW, other


REPORTED = """
import pytest
import torch
from hypothesis import given, settings, strategies as st


@pytest.mark.world_size(2)
@settings(max_examples=5, database=None)
@given(data=st.data())
def test_mutates_what_it_drew(world, data):
    x = data.draw(st.just(0).map(lambda _: torch.tensor([5.0, 6.0])))
    x.mul_(100)  # the report must show the draw, not this
    assert world.rank == 0
"""


def test_a_failure_reports_body_draws_as_drawn(child) -> None:
    """A failing simulated example names its body draws as they were drawn,
    even when a rank (the drawer included) changed its copy in place."""
    r = child({"test_r.py": REPORTED}, "-m", "pytest", "--dist-sim", "--dist-timeout", "60",
              "-p", "no:cacheprovider", "-q", "test_r.py", timeout=300)
    assert r.rc == 1, r.out
    assert "example failed on rank(s) [1] of [0, 1] (simulated world): draw 1: tensor([5., 6.])" \
        in r.out, r.out


def test_plain_copies_share_immutable_values_as_deepcopy_does() -> None:
    """Frozen dataclasses of immutable fields (placements, layouts), tuples
    of them, dtypes and functions are shared, not rebuilt; a frozen
    dataclass holding a tensor, and a mutable dataclass, are copied."""
    import copy
    import dataclasses

    import torch

    from dtensor import Partial, Replicate, Shard
    from launch.sim.copies import private as _private

    @dataclasses.dataclass(frozen=True)
    class Case:
        name: str
        shape: tuple
        fn: object

    @dataclasses.dataclass(frozen=True)
    class Holder:
        x: torch.Tensor

    @dataclasses.dataclass
    class Loose:
        n: int

    pls = (Shard(0), Replicate(), Partial("max"))
    case = Case("add", (2, 3), torch.add)
    value = (pls, case, torch.float16, [case])
    mine = _private(value)
    assert mine[0] is pls and mine[1] is case and mine[2] is torch.float16
    assert mine[3] is not value[3] and mine[3][0] is case  # a list is copied
    assert mine == copy.deepcopy(value)
    held = Holder(torch.ones(2))
    other = _private(held)
    assert other is not held and torch.equal(other.x, held.x)
    assert other.x.untyped_storage().data_ptr() != held.x.untyped_storage().data_ptr()
    loose = Loose(3)
    assert _private(loose) is not loose and _private(loose) == loose


FROZEN_A = """
import gc

import pytest
import torch.distributed as dist

import dtensor  # noqa: F401  (its hook on the end of a world)


@pytest.mark.world_size(2)
def test_first_module(world):
    dist.barrier()
    print(f"FROZEN_A {gc.get_freeze_count()}")
"""

FROZEN_B = """
import gc

import pytest


@pytest.mark.world_size(2)
def test_second_module(world):
    print(f"FROZEN_B {gc.get_freeze_count()}")
"""

ENDED = """
def pytest_unconfigure(config):
    from dtensor import _groups

    # The simulated worlds ended (session end): a threaded group leaves no
    # transport workers to drain at exit, so the exit hook's cue stays unset.
    print(f"ENDED {len(_groups._ended)}")
"""


def test_the_simulating_process_freezes_its_heap_between_modules(child) -> None:
    """After collection and between test modules the simulating process
    keeps what is alive out of the cyclic collector's scans (ranks' and
    imports' objects: a second of every full collection), and more is frozen
    once the first module's imports are in; a simulated world's end does not
    arm the exit hook that drains Gloo's workers (a 0.1 s wait and a full
    collection at every worker's exit)."""
    r = child({"test_a.py": FROZEN_A, "test_b.py": FROZEN_B, "ended.py": ENDED}, "-m",
              "pytest", "--dist-sim", "-p", "no:cacheprovider", "-p", "ended", "-s", "-q",
              "test_a.py", "test_b.py")
    assert r.rc == 0, r.out
    a = [int(n) for n in re.findall(r"FROZEN_A (\d+)", r.out)]
    b = [int(n) for n in re.findall(r"FROZEN_B (\d+)", r.out)]
    assert len(a) == 2 and len(b) == 2, r.out  # one line per rank
    assert min(a) > 10_000, r.out  # torch, hypothesis, the plugin: frozen after collection
    assert min(b) > max(a), r.out  # and again after module a
    assert "ENDED 0" in r.out, r.out



SLOW_BIG = """
import threading

import pytest


@pytest.mark.world_size(256)
@pytest.mark.dist_timeout(1)
def test_never_done_in_time(world):
    if world.rank == 0:
        threading.Event().wait(120)  # stuck outside any collective: never released
"""


def test_a_big_simulated_world_gets_a_deadline_that_grows_with_its_ranks(child) -> None:
    """Simulated ranks run one at a time, so past 128 ranks the watchdog's
    seconds grow with the rank count (``sim_deadline``): a 1 s watchdog is
    2 s for 256 ranks, and the hung rank's report says so."""
    from launch.sim.world import sim_deadline

    assert sim_deadline(120.0, 4) == sim_deadline(120.0, 128) == 120.0
    assert sim_deadline(120.0, 1024) == 960.0
    r = child({"test_big.py": SLOW_BIG}, "-m", "pytest", "--dist-sim", "-p",
              "no:cacheprovider", "-q", "test_big.py")
    assert r.rc == 1, r.out
    assert "rank 0 of the simulated 256-rank world did not finish within 2s" in r.out, r.out
