"""Covers: ``launch.world.Mode.run(item, n)`` in every mode, black-box: a
plugin of the child run replaces pytest's test loop with ``mode_of(config)
.run(item, world_size_of(item))`` and records each item's reports. An unmarked
test runs in the calling process; a ``world_size(2)`` test runs on 2 ranks
(launched worlds from plain pytest, the ranks themselves under torchrun,
threads with ``--dist-sim``) with the agreed outcome: a failure on rank 1
fails the item everywhere. Every mode implements the protocol."""

from __future__ import annotations

import json

import pytest

SUITE = """
import os
import pytest
import torch.distributed as dist

def test_here():
    pass

@pytest.mark.world_size(2)
def test_two(world):
    assert dist.get_world_size() == 2 == world.size
    assert world.rank == 0, f"rank {world.rank} fails"
"""

RUNNER = """
import json, os
import pytest
from launch.plugin import mode_of
from launch.world import world_size_of

class Loop:
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session):
        mode = mode_of(session.config)
        got = {}
        for item in session.items:
            reps = mode.run(item, world_size_of(item))
            got[item.name] = [[r.when, r.outcome, str(r.longreprtext)] for r in reps]
        if int(os.environ.get("RANK", "0")) == 0:
            with open("ran.json", "w") as f:
                json.dump({"mode": mode.name, "got": got}, f)
        return True

@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    # After the service registered its mode, whose own loop this one replaces
    # (a launched world's ranks keep theirs: the parent sends them the tests).
    if mode_of(config) is not None and mode_of(config).name != "server":
        config.pluginmanager.register(Loop(), "mode-run-loop")
"""


# real worlds (~40-50 s each on 2 cores) in the full run; the simulated one in both
@pytest.mark.parametrize("how", [pytest.param("parent", marks=pytest.mark.slow), "simulated",
                                 pytest.param("lockstep", marks=pytest.mark.slow)])
def test_run_runs_an_item_in_every_mode(child, how: str) -> None:
    cmd = {"parent": ("-m", "pytest"), "simulated": ("-m", "pytest", "--dist-sim"),
           "lockstep": ("-m", "torch.distributed.run", "--nproc-per-node=2",
                        "-m", "pytest")}[how]
    r = child({"test_r.py": SUITE, "mode_runner.py": RUNNER}, *cmd, "-p", "mode_runner", "-q",
              "-p", "no:cacheprovider", "test_r.py", timeout=300)
    assert (r.dir / "ran.json").exists(), r.out[-3000:]
    ran = json.loads((r.dir / "ran.json").read_text())
    assert ran["mode"] == how, r.out[-3000:]
    here, two = ran["got"]["test_here"], ran["got"]["test_two"]
    assert [(w, o) for w, o, _ in here] == [("setup", "passed"), ("call", "passed"),
                                            ("teardown", "passed")], here
    calls = [(o, text) for w, o, text in two if w == "call"]
    assert calls and calls[0][0] == "failed", two
    assert "rank 1 fails" in calls[0][1], two


def test_every_mode_implements_the_protocol() -> None:
    from launch.modes.lockstep import Lockstep
    from launch.modes.parent import Parent
    from launch.modes.server import Server
    from launch.modes.simulated import SimMode

    for cls in (Lockstep, Parent, Server, SimMode):
        for attr in ("name", "ranks_here", "store", "world_for", "run"):
            assert hasattr(cls, attr), f"{cls.__name__} lacks Mode.{attr}"
    assert {c.name for c in (Lockstep, Parent, Server, SimMode)} == {
        "lockstep", "parent", "server", "simulated"}
