"""Covers: bench/comm_audit.py's recorded table (``bench/comm_audit.json``)
as a guard: a subset of its cases re-run with dtensor alone must send no more
collectives and no more wire bytes than recorded, and the recorded table
itself must show no case where ours sends more than PyTorch's DTensor
outside the listed exceptions (docs/ops.md, "Communication audit"), and
accepted differences (``ACCEPTED``) count apart from excesses.

The op samples run on a 2-rank world; the redistribute pairs on a fake
process group in a fresh interpreter (one process: rank 0's collectives).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "bench" / "comm_audit.json"
sys.path.insert(0, str(ROOT / "bench"))

# A fast subset of the recorded OpInfo entries: each family of rules once.
OPS = ["add", "mul", "maximum", "sum", "mean", "linalg.vector_norm", "mm",
       "nn.functional.layer_norm", "cat", "softmax", "where", "as_strided",
       "nn.functional.gaussian_nll_loss"]
EPS = 1e-6


def _record() -> dict:
    return json.loads(RECORD.read_text())


def test_recorded_table_shows_no_unexplained_excess() -> None:
    import comm_audit

    data = _record()
    _, excesses = comm_audit.summarise(data["ops"], data["pairs"])
    allowed = comm_audit.EXCEPTIONS
    unexplained = [e for e in excesses if not any(key in e for key in allowed)]
    assert not unexplained, "\n".join(unexplained[:20])


def test_accepted_differences_are_counted_apart_from_excesses() -> None:
    """An excess of an op and layout in ``ACCEPTED`` is listed as accepted,
    the same numbers for another op or layout as an excess; a partial
    layout counts in the partial row only."""
    import comm_audit

    case = [0, "P(max)", 1, 4.0, 1, 1.0, True, True]
    ops = {"byte": [case], "exp": [case], "char": [[0, "P(sum)", *case[2:]]]}
    agreed: list[str] = []
    table, excesses = comm_audit.summarise(ops, [], agreed)
    assert [e.split("`")[1] for e in excesses] == ["exp", "char"], excesses
    assert [e.split("`")[1] for e in agreed] == ["byte"], agreed
    rows = {r.split("|")[1].strip(): r.split("|")[2:7] for r in table.splitlines()[2:]}
    assert [c.strip() for c in rows["ops, partial"]] == ["3", "3", "2", "1", "0"]
    assert [c.strip() for c in rows["ops, alike"]] == ["0", "0", "0", "0", "0"]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("name", OPS)
def test_op_samples_send_no_more_than_recorded(world, name) -> None:
    import comm_audit

    data = _record()
    recorded = {(si, lay): (oc, ow) for si, lay, oc, ow, _, _, ok, _ in data["ops"].get(name, [])
                if ok}
    if not recorded:
        pytest.skip(f"{name}: no case recorded in {RECORD.name}")  # not in this torch's op_db
    meta = data["meta"]
    got = comm_audit.ours_op_counts(name, meta["max_samples"], meta["max_layouts"], world.rank)
    worse = [f"sample {k[0]} {k[1]}: {got[k][0]} collectives / {got[k][1]:.0f} B, recorded "
             f"{rec[0]} / {rec[1]:.0f} B" for k, rec in recorded.items()
             if k in got and (got[k][0] > rec[0] or got[k][1] > rec[1] + EPS)]
    assert not worse, "\n".join(worse)
    assert set(recorded) <= set(got), sorted(set(recorded) - set(got))[:5]


_PAIRS_SCRIPT = r"""
import json, sys, logging, warnings
sys.path.insert(0, {bench!r})
warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import comm_audit
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
rows = []
for mesh, shape, src, dst, got in comm_audit.pair_cases(
        meshes=[m for m in comm_audit.PAIR_MESHES if len(m[0]) <= 2], libs=("ours",)):
    o = got["ours"]
    rows.append([mesh, shape, src, dst, *(o if isinstance(o, tuple) else (o, None))])
print(json.dumps(rows))
"""


def test_redistribute_pairs_send_no_more_than_recorded(fresh_process) -> None:
    p = fresh_process(_PAIRS_SCRIPT.format(bench=str(ROOT / "bench")))
    assert p.returncode == 0, p.stderr[-3000:]
    got = {tuple(r[:4]): (r[4], r[5]) for r in json.loads(p.stdout.splitlines()[-1])}
    recorded = {tuple(r[:4]): (r[4], r[5]) for r in _record()["pairs"]}
    assert got, "no pair ran"
    worse = []
    for key, (oc, ow) in got.items():
        rc, rw = recorded[key]
        if ow is None or rw is None:
            assert (ow is None) == (rw is None), (key, oc, rc)  # refused as recorded
            continue
        if oc > rc or ow > rw + EPS:
            worse.append(f"{key}: {oc} collectives / {ow:.0f} B, recorded {rc} / {rw:.0f} B")
    assert not worse, "\n".join(worse[:20])
