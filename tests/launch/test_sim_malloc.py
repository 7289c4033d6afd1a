"""Covers: launch/sim/malloc.py and its use by launch/modes/simulated.py and
launch/fuzz/cli.py: processes that host simulated worlds start with glibc's
per-thread caches off (xdist workers of ``pytest --dist-sim -n``), a user's
own ``tcache_count`` is kept, and a plain ``pytest --dist-sim`` that started
with the caches on says how to turn them off once it hosted a big world.

Black-box, in a repository outside this one with no conftest."""

from __future__ import annotations

import sys

import pytest
from _user_repo import run_in

from launch.sim.malloc import TUNABLE, without_thread_caches

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="glibc tunables: Linux only")

# Each rank writes down the GLIBC_TUNABLES its process started with (an xdist
# worker's prints do not reach the controller's output).
SEEN = '''
import os, pytest

def _started_with():
    for entry in open("/proc/self/environ", "rb").read().split(b"\\0"):
        if entry.startswith(b"GLIBC_TUNABLES="):
            return entry.split(b"=", 1)[1].decode()
    return None

@pytest.mark.world_size(2)
def test_tunables(world):
    with open(os.path.join(os.environ["STAMPS_DIR"], f"seen{world.rank}"), "w") as f:
        f.write(repr(_started_with()))
'''

BIG = '''
import pytest, torch, torch.distributed as dist

@pytest.mark.world_size(256)
def test_big_world(world):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 256
'''

HINT = "keeps its own cache of freed blocks"


def test_the_setting_is_added_to_what_the_user_has() -> None:
    assert without_thread_caches({}) == {"GLIBC_TUNABLES": TUNABLE}
    got = without_thread_caches({"GLIBC_TUNABLES": "glibc.malloc.mxfast=0", "X": "1"})
    assert got == {"GLIBC_TUNABLES": f"glibc.malloc.mxfast=0:{TUNABLE}", "X": "1"}
    mine = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=3"}
    assert without_thread_caches(mine) == mine  # the user's choice stands


@pytest.mark.parametrize(("given", "want"), [
    ("", TUNABLE),
    ("glibc.malloc.tcache_count=3", "glibc.malloc.tcache_count=3"),
])
def test_xdist_workers_start_without_thread_caches(user_repo, given, want) -> None:
    (user_repo / "test_seen.py").write_text(SEEN)
    p = run_in(user_repo, "-m", "pytest", "-p", "no:cacheprovider", "--dist-sim", "-n", "1",
               "-q", "test_seen.py", env={"GLIBC_TUNABLES": given}, timeout=200)
    assert p.returncode == 0, p.stdout + p.stderr
    assert [(user_repo / f"seen{r}").read_text() for r in (0, 1)] == [repr(want)] * 2


@pytest.mark.parametrize(("given", "hint"), [
    ("", True),  # glibc's default: the process keeps a cache per rank thread
    (TUNABLE, False),
    ("glibc.malloc.tcache_count=3", False),  # chosen by the user
])
def test_a_big_world_in_one_process_says_how_to_drop_the_caches(user_repo, given, hint) -> None:
    (user_repo / "test_big.py").write_text(BIG)
    p = run_in(user_repo, "-m", "pytest", "-p", "no:cacheprovider", "--dist-sim", "-q",
               "test_big.py", env={"GLIBC_TUNABLES": given}, timeout=200)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (HINT in p.stdout) == hint, p.stdout
    if hint:
        assert f"GLIBC_TUNABLES={TUNABLE}" in p.stdout and "256 rank threads" in p.stdout


def test_a_small_world_says_nothing(user_repo) -> None:
    (user_repo / "test_seen.py").write_text(SEEN)
    p = run_in(user_repo, "-m", "pytest", "-p", "no:cacheprovider", "--dist-sim", "-q",
               "test_seen.py", env={"GLIBC_TUNABLES": ""}, timeout=200)
    assert p.returncode == 0 and HINT not in p.stdout, p.stdout


FUZZED = SEEN.replace("@pytest.mark.world_size(2)\n", '''@pytest.mark.world_size(2)
@given(x=st.integers(0, 9))
''').replace("def test_tunables(world):", "def test_tunables(world, x):").replace(
    "import os, pytest", "import os, pytest\nfrom hypothesis import given, strategies as st")


def test_a_simulated_fuzzing_world_starts_without_thread_caches(user_repo) -> None:
    (user_repo / "test_seen.py").write_text(FUZZED)
    p = run_in(user_repo, "-m", "launch", "fuzz", "test_seen.py", "--sim", "2",
               "--minutes", "0.2", env={"GLIBC_TUNABLES": ""}, timeout=200)
    assert p.returncode == 0, p.stdout + p.stderr
    assert [(user_repo / f"seen{r}").read_text() for r in (0, 1)] == [repr(TUNABLE)] * 2
