"""Covers: simulated worlds give real worlds' verdicts. The same properties,
on the same (derandomized) examples, run in a simulated and in a real world
of 2 and 4 ranks, once on the runtime and once with a planted bug; every
test's verdict must agree (``bench/sim_throughput.py`` does the same for the
whole property suite)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from sim_throughput import verdicts  # noqa: E402

FILES = ["tests/properties/test_redistribute.py", "tests/properties/test_outsiders.py"]

pytestmark = pytest.mark.skipif("RANK" in os.environ,
                                reason="starts its own worlds; run it with plain pytest")


def _run(tmp: Path, name: str, mutant: str | None, sim: bool) -> dict[str, str]:
    # With the planted gather bug, the file it breaks at the smallest world
    # that shows it (2 ranks) is enough: every failing example is shrunk, in
    # both worlds, which makes this the costliest run of README's test command.
    files = FILES[:1] if mutant else FILES
    env = dict(os.environ, DTENSOR_WORLD_SIZES="2" if mutant else "2,4")
    env.pop("DTENSOR_MUTANT", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    if mutant:
        env["DTENSOR_MUTANT"] = mutant
    junit = tmp / f"{name}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "--hypothesis-profile=ci", f"--junitxml={junit}", *files,
           *(["--dist-sim"] if sim else [])]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert junit.exists(), p.stdout + p.stderr
    return verdicts(str(junit))


# With a planted bug the two worlds must fail the same properties: a
# simulated world that drew other examples than the real one (as an engine per
# rank thread did: test_gradients passed simulated, failed real) would differ.
@pytest.mark.parametrize("mutant", [None, "gather_drops_last_uneven_shard"])
def test_simulated_and_real_worlds_agree_on_every_verdict(tmp_path: Path, mutant) -> None:
    sim = _run(tmp_path, "sim", mutant, sim=True)
    real = _run(tmp_path, "real", mutant, sim=False)
    assert sim.keys() == real.keys()
    differ = {k: (sim[k], real[k]) for k in sim if sim[k] != real[k]}
    assert not differ, f"(simulated, real) verdicts differ: {differ}"
    if mutant:  # the comparison covers failures, not only passes
        assert "failed" in sim.values()


def _sim_redistribute(size: int, mutant: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DTENSOR_WORLD_SIZES=str(size), DTENSOR_MUTANT=mutant)
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "--hypothesis-profile=ci", "--dist-sim", "--dist-sim-examples=10",
           "tests/properties/test_redistribute.py"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_a_layout_bug_that_needs_8_ranks_on_an_axis_is_caught_at_16_simulated_ranks() -> None:
    # The planted bug loses the 8th piece of an uneven gather over >= 8 ranks:
    # no 4-rank world (real or simulated) can show it; a 16-rank simulated one does.
    mutant = "gather_zeroes_eighth_piece_on_wide_axis"
    small = _sim_redistribute(4, mutant)
    assert small.returncode == 0, small.stdout[-3000:]
    big = _sim_redistribute(16, mutant)
    assert big.returncode == 1, big.stdout[-3000:]
    assert "[16ranks]" in big.stdout and "RankFailure" in big.stdout, big.stdout[-3000:]
    assert (f"DTENSOR_MUTANT={mutant} torchrun --nproc_per_node=16 -m pytest "
            "'tests/properties/test_redistribute.py::") in big.stdout, big.stdout[-3000:]


def test_confirm_finds_the_smallest_world_that_fails_and_confirms_it_on_a_real_one() -> None:
    # A 4-rank simulated failure: smaller simulated worlds are tried first (2
    # ranks already fails this planted bug), and the real re-run happens there.
    env = dict(os.environ, DTENSOR_WORLD_SIZES="4", DTENSOR_MUTANT="gather_drops_last_uneven_shard")
    env.pop("PYTEST_XDIST_WORKER", None)
    test = "tests/properties/test_redistribute.py::test_redistribute_keeps_the_value_and_the_blocks"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--hypothesis-profile=ci", "--dist-sim", "--dist-sim-confirm",
                        f"{test}[4ranks]"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    out = p.stdout
    assert p.returncode == 1, out[-3000:]
    assert ("Replay (smallest real world that reproduces it in simulation, 2 ranks): "
            "DTENSOR_WORLD_SIZES=2 DTENSOR_MUTANT=gather_drops_last_uneven_shard torchrun "
            f"--nproc_per_node=2 -m pytest '{test}[2ranks]'") in out, out[-3000:]
    assert "Confirmation: reproduced on a real 2-rank world (a runtime bug)" in out, out[-3000:]


LITERALS = """
VALUES = [987654321, 24680, 13579, 4096, 65536, 0.123456789, 31415.9265, -271828, 1e-7]
NAMES = ["alpha", "beta", "gamma"]
"""

DRAWS = """
import os

import pytest
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

if os.environ.get("EXTRA"):
    import literals  # noqa: F401  (a local module full of literals)


@pytest.mark.world_size(2)
@settings(max_examples=200, derandomize=True, database=None)
@given(st.integers(), st.floats(allow_nan=False))
def test_draws(x, y):
    if dist.get_rank() == 0:
        with open(os.environ["OUT"], "a") as f:
            f.write(f"{x} {y!r}\\n")
"""


def test_a_seed_draws_the_same_examples_whatever_modules_are_loaded(child, tmp_path,
                                                                    monkeypatch) -> None:
    """Hypothesis draws some numbers from the literals of the local modules a
    process has imported; the service pins that pool where examples must
    match another process's (a rank, a simulated world), so there one seed
    draws the same examples whatever local modules are loaded (a planted bug once passed simulated and failed real because a number added
    to the simulator moved the examples)."""
    outs = []
    for extra in ("", "1"):
        out = tmp_path / f"draws{extra or 0}.txt"
        monkeypatch.setenv("OUT", str(out))
        monkeypatch.setenv("EXTRA", extra)
        r = child({"test_d.py": DRAWS, "literals.py": LITERALS}, "-m", "pytest", "-q",
                  "--dist-sim", "-p", "no:cacheprovider", "test_d.py")
        assert r.rc == 0, r.out
        outs.append(out.read_text().splitlines())
    assert len(outs[0]) >= 100, outs[0][:5]
    assert outs[0] == outs[1], "the drawn examples depend on which local modules are loaded"


pytestmark = [pytestmark, pytest.mark.slow]  # real and simulated property runs: the full run
