"""Covers: launch/modes/forked.py and launch.rank.procs.ForkedRanks, black-box:
with ``LAUNCH_START=fork`` plain pytest forks its worlds' ranks from itself
after collection, and a
forked rank keeps nothing of the parent's test state: its fixtures are its
own (a session fixture the parent's local test set up is set up again on the
rank, and torn down there, never the parent's value nor the parent's
finalizer), the parent's captured output and junit stay whole; without the
variable the same world starts through torchrun."""

from __future__ import annotations

import re

import pytest

SUITE = '''
import os
import pytest, torch, torch.distributed as dist

# the pytest process the command started (its ranks inherit its environment)
PARENT = int(os.environ.setdefault("SUITE_PARENT_PID", str(os.getpid())))

@pytest.fixture(scope="session")
def owner():
    yield os.getpid()
    with open("teardowns.txt", "a") as f:  # who tore the session fixture down
        f.write(f"{os.getpid()} {os.environ.get('RANK', 'parent')}\\n")

def test_local(owner):
    print("parent output before the world")
    assert owner == PARENT

@pytest.mark.world_size(2)
def test_in_world(world, owner):
    assert owner == os.getpid() != PARENT  # set up on this rank, not inherited
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == 2

def test_local_after(owner):
    print("parent output after the world")
    assert owner == PARENT
'''


def _teardowns(c) -> list[str]:
    path = c.dir / "teardowns.txt"
    return path.read_text().split() if path.exists() else []


def test_forked_ranks_keep_their_own_fixtures_and_output(child, monkeypatch) -> None:
    monkeypatch.setenv("LAUNCH_START", "fork")
    c = child({"test_fork.py": SUITE}, "-m", "pytest", "-q", "-rP", "--junitxml=junit.xml",
              "test_fork.py")
    assert c.rc == 0, c.out
    assert c.outcomes == {"test_local": "passed", "test_in_world": "passed",
                          "test_local_after": "passed"}, c.out
    # the parent's captured output, each test's own, once (-rP)
    for when in ("before", "after"):
        assert c.out.count(f"parent output {when} the world") == 1, c.out
    logs = list(c.dir.glob(".launch-logs/*/w2g1-world.log"))
    assert len(logs) == 1 and "forked 2 ranks" in logs[0].read_text(), c.out
    assert not list(c.dir.glob(".launch-logs/*/w2g1-torchrun.log")), c.out
    # each rank tore down its own session fixture, the parent its own, once each
    words = _teardowns(c)
    assert sorted(words[1::2]) == ["0", "1", "parent"], words
    assert len(set(words[0::2])) == 3, words


@pytest.mark.slow  # torchrun's interpreters import torch: the full run, not the quick tier
def test_worlds_start_through_torchrun_unless_fork_is_asked_for(child, monkeypatch) -> None:
    monkeypatch.delenv("LAUNCH_START", raising=False)
    c = child({"test_fork.py": SUITE}, "-m", "pytest", "-q", "--junitxml=junit.xml",
              "test_fork.py")
    assert c.rc == 0, c.out
    assert set(c.outcomes.values()) == {"passed"}, c.out
    assert list(c.dir.glob(".launch-logs/*/w2g1-torchrun.log")), c.out
    assert not list(c.dir.glob(".launch-logs/*/w2g1-world.log")), c.out
    assert re.search(r"3 passed", c.out), c.out
