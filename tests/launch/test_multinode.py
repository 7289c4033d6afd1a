"""Covers: launch/modes/lockstep.py and launch/rank/watchdog.py across nodes, black-box:
two torchrun "nodes" on this machine (``--nnodes=2``, c10d rendezvous on
loopback) run one suite in lockstep: one report on global rank 0, per-node
logs, and a node killed mid-test is named within the watchdog bound."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from childrun import ROOT, UNDER_TORCHRUN, _junit, _processes_in

SUITE = '''
import os, time
import pytest, torch, torch.distributed as dist

def test_all_four_ranks_agree():
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == 4 == dist.get_world_size()

@pytest.mark.world_size(2)
def test_sub_world_spans_node_0(world):
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == 2

def test_fails_on_rank_3():
    assert dist.get_rank() != 3, "rank 3 (node 1) fails"

def test_node1_dies():
    if os.environ["GROUP_RANK"] == "1":
        if os.environ["LOCAL_RANK"] == "0":
            with open("kill-node1.tmp", "w") as f:
                f.write(str(os.getppid()))   # this node's torchrun agent
            os.rename("kill-node1.tmp", "kill-node1")
        time.sleep(600)
    t = torch.ones(1); dist.all_reduce(t)

def test_never_runs():
    pass
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants: a node that dies at once."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().split(") ", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += kids.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_two_nodes_run_in_lockstep_and_a_dead_node_is_named(tmp_path: Path) -> None:
    if UNDER_TORCHRUN:
        pytest.skip("self-test starts its own worlds; run it with plain pytest")
    (tmp_path / "test_mn.py").write_text(SUITE)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["launch.plugin"]\n')
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for k in ("PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST"):
        env.pop(k, None)
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=mn",
           "--max-restarts=0", "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "--dist-timeout=60", "--junitxml=junit.xml", "test_mn.py"]
    logs = [open(tmp_path / f"node{k}.out", "w+") for k in (0, 1)]
    procs = []
    for k in (0, 1):  # "node" 0 first: it hosts the rendezvous store
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=logs[k],
                                      stderr=subprocess.STDOUT, start_new_session=True))
        time.sleep(1.0 if k == 0 else 0)
    try:
        flag, end = tmp_path / "kill-node1", time.monotonic() + 300
        while not flag.exists() and time.monotonic() < end and all(p.poll() is None for p in procs):
            time.sleep(0.1)
        assert flag.exists(), [f.seek(0) or f.read() for f in logs]
        agent = int(flag.read_text())
        killed_at = time.monotonic()
        _kill_tree(agent)
        survivor = next(p for p in procs if p.pid != agent)
        survivor.wait(timeout=120)
        took = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_tree(p.pid)
                p.wait()
    outs = []
    for f in logs:
        f.seek(0)
        outs.append(f.read())
        f.close()
    out = next(o for o in outs if "test_all_four_ranks_agree" in o or "dead ranks" in o)
    assert sum("rank 3 (node 1) fails" in o for o in outs) == 1, outs  # one report
    assert "failed on rank 3 of 4 (ranks 0, 1, 2: passed)" in out, out
    assert "launch: lockstep, 4 ranks (gloo), 2 nodes of 2" not in out  # -q: no header
    assert "dead ranks: 2, 3 on node 1 (host " in out and "the whole node died" in out, out
    assert "during test_mn.py::test_node1_dies" in out, out
    assert took < 60, (took, out)  # within the watchdog bound
    assert _junit(tmp_path / "junit.xml") == {
        "test_all_four_ranks_agree": "passed", "test_sub_world_spans_node_0": "passed",
        "test_fails_on_rank_3": "failed", "test_node1_dies": "failed",
        "test_never_runs": "skipped"}, out
    node_logs = {p.parent.name.split("-node")[1][0] + p.name
                 for p in tmp_path.glob(".launch-logs/*/rank*.log")}
    assert {"0rank1.log", "1rank2.log", "1rank3.log"} <= node_logs, node_logs
    assert not _processes_in(tmp_path), "processes left behind"


pytestmark = pytest.mark.slow  # starts several worlds or compiles: the full run, not the quick tier
