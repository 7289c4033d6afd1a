"""Covers: launch/torchbases (classes of PyTorch's distributed test bases run
unchanged on the service's worlds).

The corpus files beside this one (``corpus_*.py``; not collected by
``pytest tests/``) hold classes of every base, with methods that pass, fail
on one rank, skip, hang, and lose a rank. Each is run in a fresh folder
(no conftest, the project installed) by the bases' own harness
(``-p no:launch.plugin``) and by the service in each mode; every method's
verdict, read from the junit file, must be the corpus' ``EXPECTED`` one
for that harness. Where the two columns differ it is on purpose (the table
in docs/test-service.md), which ``test_the_harnesses_agree_but_where_documented``
pins.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("expecttest", reason="torch's test bases need expecttest (test extra)")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CORPUS = ("corpus_procs.py", "corpus_continuous.py", "corpus_inproc.py")
# Differences between the bases' own harness and the service, each on purpose.
DOCUMENTED = {
    "Continuous::test_d_after_the_failure",  # own: skipped after a failure
    "ExitCodes::test_rank_1_exits_with_5",  # service: no spawned processes to judge
}
_WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PYTEST_XDIST_WORKER",
              "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST", "LAUNCH_RANK_PID")


def expected(files: tuple[str, ...] = CORPUS) -> dict[str, tuple[str, str]]:
    """method id -> (verdict under the own harness, under the service)."""
    out: dict[str, tuple[str, str]] = {}
    for name in files:
        tree = ast.parse((HERE / name).read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "EXPECTED":
                for k, v in ast.literal_eval(node.value).items():
                    out[k] = (v, v) if isinstance(v, str) else tuple(v)
    return out


def verdicts(junit: Path) -> dict[str, str]:
    """``Class::method`` -> passed / failed / skipped, from a junit file."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        key = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[key] = ("failed" if kinds & {"failure", "error"} else
                    "skipped" if "skipped" in kinds else "passed")
    return out


def commands(files: tuple[str, ...]) -> dict[str, list[str]]:
    py, base = sys.executable, ["-q", "-rs", "-p", "no:cacheprovider", "--junitxml=out.xml"]
    return {
        "own": [py, "-m", "pytest", "-p", "no:launch.plugin", *base, *files],
        "plain": [py, "-m", "pytest", *base, *files],
        "xdist": [py, "-m", "pytest", "-n", "2", *base, *files],
        "torchrun": [py, "-m", "launch", "--nproc-per-node", "4", "--", *base, *files],
        "sim": [py, "-m", "pytest", "--dist-sim", *base, *files],
    }


def run_corpus(tmp: Path, mode: str, files: tuple[str, ...] = CORPUS
               ) -> tuple[dict[str, str], str]:
    """Run the corpus files in ``tmp`` in ``mode``: (verdicts, output)."""
    for name in files:
        shutil.copy(HERE / name, tmp / name)
    env = {k: v for k, v in os.environ.items() if k not in _WORLD_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run(commands(files)[mode], cwd=tmp, env=env, capture_output=True,
                       text=True, timeout=1200)
    out = p.stdout + p.stderr
    assert (tmp / "out.xml").exists(), out[-4000:]
    return verdicts(tmp / "out.xml"), out + _failure_heads(tmp / "out.xml")


def _failure_heads(junit: Path) -> str:
    """The first lines of every failed method's report (a failure's cause can
    sit far above the end of the output)."""
    heads = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                text = (child.get("message") or "") + "\n" + (child.text or "")
                heads.append(f"--- {case.get('name')} ({child.tag}) ---\n{text[:500]}")
    return "\n== failed methods, first lines ==\n" + "\n".join(heads) if heads else ""


def _check(got: dict[str, str], want: dict[str, str], out: str) -> None:
    diff = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
    assert not diff and set(got) == set(want), (
        f"(got, expected) per method: {diff}; extra: {set(got) - set(want)}\n{out[-12000:]}")


def test_the_harnesses_agree_but_where_documented() -> None:
    both = expected()
    assert len(both) >= 30
    differ = {k for k, (own, ours) in both.items() if own != ours}
    assert differ == DOCUMENTED


needs_own_worlds = pytest.mark.skipif(
    "RANK" in os.environ, reason="starts its own worlds; run it with plain pytest")
# each run below starts the corpus in a child session (1-4 minutes on 2 cores)
slow = pytest.mark.slow
# The bases' own harness spawns fresh processes per method and waits out its
# own timeouts on the hang and dead-rank methods: the corpus under it costs
# more than every service run of it together. It checks the corpus' recorded
# ``EXPECTED`` own-harness column against PyTorch, which changes only with the
# corpus or the torch version, so it runs where asked.
OWN_HARNESS_ENV = "TORCHBASES_OWN_HARNESS"
own_harness = pytest.mark.skipif(
    os.environ.get(OWN_HARNESS_ENV) != "1",
    reason=f"re-checks the corpus' own-harness verdicts against PyTorch's harness "
           f"(about 10 min on 2 cores); {OWN_HARNESS_ENV}=1 runs it, after a change to "
           f"a corpus file or to the torch version")


@slow
@needs_own_worlds
@own_harness
def test_the_bases_own_harness_gives_the_expected_verdicts(tmp_path: Path) -> None:
    got, out = run_corpus(tmp_path, "own")
    _check(got, {k: v[0] for k, v in expected().items()}, out)


@slow
@needs_own_worlds
@pytest.mark.parametrize("mode", ["plain", "xdist", "torchrun"])
def test_the_service_gives_the_same_verdicts(tmp_path: Path, mode: str) -> None:
    got, out = run_corpus(tmp_path, mode)
    _check(got, {k: v[1] for k, v in expected().items()}, out)
    # the service's own reports, not the bases' (their harness loses ranks)
    assert "failed on rank 1 of 2 (rank 0: passed)" in out
    assert "timed out after 8 s" in out and "dead ranks: 1" in out
    assert "ExitCodes overrides _check_return_codes" in out


@slow
@needs_own_worlds
def test_in_process_bases_under_simulated_worlds(tmp_path: Path) -> None:
    files = ("corpus_inproc.py",)
    got, out = run_corpus(tmp_path, "sim", files)
    _check(got, {k: v[1] for k, v in expected(files).items()}, out)


@slow
@needs_own_worlds
def test_in_process_bases_under_torchrun(tmp_path: Path) -> None:
    """Inside a rank, c10d holds a world of their own while they run
    (``launch.torchbases.inproc.own_world``): without it the fake and threaded
    groups meet the rank's default group."""
    files = ("corpus_inproc.py",)
    got, out = run_corpus(tmp_path, "torchrun", files)
    _check(got, {k: v[1] for k, v in expected(files).items()}, out)


@slow
@needs_own_worlds
def test_a_hang_in_a_continuous_class_is_bounded(tmp_path: Path) -> None:
    files = ("corpus_continuous_hang.py",)
    got, out = run_corpus(tmp_path, "plain", files)
    _check(got, {k: v[1] for k, v in expected(files).items()}, out)
    assert "timed out after 5 s during corpus_continuous_hang.py::ContinuousHang::" \
           "test_b_hangs_on_rank_1" in out


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@slow
@needs_own_worlds
def test_two_nodes_give_the_bases_own_verdicts(tmp_path: Path) -> None:
    """Two torchrun agents on this machine (``--nnodes=2 --nproc-per-node=2``,
    c10d rendezvous): 4-rank classes span both nodes, a 2-rank class runs on
    node 0's sub-world; one junit file, on global rank 0, with the verdicts
    the bases' own harness gives the same file (the corpus' ``EXPECTED``,
    which ``test_two_nodes_corpus_under_the_own_harness`` checks)."""
    files = ("corpus_nodes.py",)
    want = {k: v[1] for k, v in expected(files).items()}
    for name in files:
        shutil.copy(HERE / name, tmp_path / name)
    env = {k: v for k, v in os.environ.items() if k not in _WORLD_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
           "--nproc-per-node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--rdzv-id=torchbases",
           "--max-restarts=0", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
           "--junitxml=out.xml", *files]
    logs = [tmp_path / f"node{k}.out" for k in (0, 1)]
    procs = []
    for k, log in enumerate(logs):  # node 0 first: it hosts the rendezvous
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=f,
                                          stderr=subprocess.STDOUT))
        time.sleep(1.0 if k == 0 else 0.0)
    try:
        procs[0].wait(timeout=600)
        # Node 0 hosts the rendezvous store and writes the junit file. When a
        # test failed, its agent exits without torchrun's exit barrier, and
        # node 1's agent then waits out that barrier (300 s) on a store that
        # is gone: its verdicts are in node 0's file, so do not wait for it.
        procs[1].wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out = "\n".join(f"--- {log.name} ---\n{log.read_text()}" for log in logs)
    assert (tmp_path / "out.xml").exists(), out[-4000:]
    _check(verdicts(tmp_path / "out.xml"), want, out)
    assert "failed on rank 3 of 4 (ranks 0, 1, 2: passed)" in out, out[-4000:]


@slow
@needs_own_worlds
@own_harness
def test_two_nodes_corpus_under_the_own_harness(tmp_path: Path) -> None:
    files = ("corpus_nodes.py",)
    got, out = run_corpus(tmp_path, "own", files)
    _check(got, {k: v[0] for k, v in expected(files).items()}, out)


pytestmark = pytest.mark.slow  # starts several worlds or compiles: the full run, not the quick tier
