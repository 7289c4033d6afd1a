"""Deliberately broken runtimes: the property suite must catch each one.

``apply(name)`` monkeypatches one bug into the runtime of this process; the
property suite's conftest (``tests/properties/conftest.py``) calls it on every rank when
``DTENSOR_MUTANT=name`` is set. Run as a script, it runs the property suite
once per mutant and reports whether a test that passes on the unmutated
runtime now fails, with Hypothesis' minimal example:

    python tools/mutants.py                       # every mutant, 2 ranks
    python tools/mutants.py --nproc 4 gather_drops_last_uneven_shard

Mutants:
    gather_drops_last_uneven_shard  uneven all-gather loses the last shard
    partial_to_replicate_skips_reduce  P -> R forgets the all-reduce
    random_same_offset_on_every_shard  every shard draws the numbers of the
        first block (the same random offset on every shard)
    outsider_joins_collective  a rank outside the mesh issues a collective
        when redistributing (a one-rank group here, so it is counted, not hung)
    nonlinear_op_keeps_partial  a sharding rule keeps ``abs`` of a Partial
        input partial (abs is not linear)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _gather_drops_last_uneven_shard() -> None:
    import torch

    from dtensor import _comm, redistribute
    from dtensor.spec import shard_range

    def _gather(local, step, global_shape, mesh_shape, coord, group):
        dim = step.src.dim
        n = mesh_shape[step.axis]
        _, length = redistribute._outer_range(step, global_shape, mesh_shape, coord, dim)
        piece = -(-length // n)
        if dim == 0 and piece * n == length:
            return _comm.all_gather_cat(local, group)
        lengths = [shard_range(length, n, i)[1] for i in range(n)]
        if local.shape[dim] != piece:
            pad = list(local.shape)
            pad[dim] = piece - local.shape[dim]
            local = torch.cat([local, local.new_zeros(pad)], dim=dim)
        pieces = _comm.all_gather(local, group)
        pieces = [p.narrow(dim, 0, k) for p, k in zip(pieces, lengths, strict=True)]
        if lengths[-1] != piece:  # BUG: the last, shorter shard is dropped
            pieces = pieces[:-1]
        return torch.cat(pieces, dim=dim)

    redistribute._gather = _gather


def _partial_to_replicate_skips_reduce() -> None:
    from dtensor import redistribute, tensor

    original = redistribute.execute

    def execute(local, steps, global_shape, mesh):
        # BUG: Partial -> Replicate steps are dropped (no all-reduce).
        return original(local, [s for s in steps if s.kind != "reduce"], global_shape, mesh)

    redistribute.execute = execute
    tensor.execute = execute


def _random_same_offset_on_every_shard() -> None:
    from dtensor import _random_blocks as rng

    original = rng._generate

    def _generate(seed, offset, gs, lo, ls, *args, **kwargs):
        # BUG: every block starts at global index 0.
        return original(seed, offset, gs, (0,) * len(lo), ls, *args, **kwargs)

    rng._generate = _generate


def _outsider_joins_collective() -> None:
    import torch

    from dtensor import _comm, redistribute, tensor
    from dtensor.dispatch import execute, random_ops

    original = redistribute.redistribute_local

    def redistribute_local(local, src, dst):
        if src.mesh.get_coordinate() is None and src.placements != dst.placements:
            # BUG: the outsider takes part in a collective.
            _comm.all_reduce(torch.zeros(1), "sum", _comm.group_for((_comm.get_rank(),)))
        return original(local, src, dst)

    for module in (redistribute, tensor, execute, random_ops):
        module.redistribute_local = redistribute_local


def _nonlinear_op_keeps_partial() -> None:
    import torch

    from dtensor.sharding import Sharding, register_rule

    @register_rule(torch.ops.aten.abs.default)
    def abs_rule(call):
        # BUG: abs is not linear, yet the rule keeps Partial inputs partial.
        (spec,) = call.specs
        return Sharding(inputs=(None,), outputs=(spec.placements,))


MUTANTS = {
    "gather_drops_last_uneven_shard": (_gather_drops_last_uneven_shard,
                                       "tests/properties/test_redistribute.py"),
    "partial_to_replicate_skips_reduce": (_partial_to_replicate_skips_reduce,
                                          "tests/properties/test_redistribute.py"),
    "random_same_offset_on_every_shard": (_random_same_offset_on_every_shard,
                                          "tests/properties/test_random.py"),
    "outsider_joins_collective": (_outsider_joins_collective,
                                  "tests/properties/test_outsiders.py"),
    "nonlinear_op_keeps_partial": (_nonlinear_op_keeps_partial,
                                   "tests/properties/test_ops.py"),
}


def apply(name: str) -> None:
    """Monkeypatch mutant ``name`` into this process's runtime."""
    if name not in MUTANTS:
        raise SystemExit(f"DTENSOR_MUTANT={name!r}: unknown mutant; one of {sorted(MUTANTS)}")
    MUTANTS[name][0]()


def _pytest(target: str, nproc: int, profile: str, mutant: str | None) -> tuple[set, float, str]:
    """(failed test ids, seconds, output) of the suite at ``target``."""
    cmd = ["torchrun", f"--nproc_per_node={nproc}", "-m", "pytest", "-p",
           "launch.hypothesis_lockstep", target, "-q", "-rf", "-p", "no:cacheprovider",
           f"--hypothesis-profile={profile}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DTENSOR_MUTANT", None)
    if mutant:
        env["DTENSOR_MUTANT"] = mutant
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    failed = set(re.findall(r"^FAILED (\S+)", out, re.M))
    return failed, time.monotonic() - t0, out


def run(name: str, nproc: int, target: str | None, profile: str,
        baseline: dict[str, set]) -> tuple[bool, float, str]:
    """Run ``target`` with mutant ``name``: caught when a test that passes on
    the unmutated runtime (``baseline``, filled on demand) fails."""
    target = target or MUTANTS[name][1]
    if target not in baseline:
        baseline[target] = _pytest(target, nproc, profile, None)[0]
    failed, dt, out = _pytest(target, nproc, profile, name)
    new = sorted(failed - baseline[target])
    return bool(new), dt, _excerpt(out, new)


def _excerpt(out: str, new: list[str]) -> str:
    """The first new failure's minimal example, first error line and replay command."""
    lines = out.splitlines()
    keep: list[str] = [f"newly failing: {new}"]
    for i, line in enumerate(lines):
        if "RankFailure: example failed" in line and any(
                n.split("::")[-1] in "\n".join(lines[i:i + 80]) for n in new):
            keep.append(line.split("RankFailure: ", 1)[1].strip())
            errs = [x for x in lines[i + 1:i + 40] if re.match(r"E\s+\w*(Error|Exception):", x)]
            keep += [e[1:].strip() for e in errs[:1]]
            rep = [x for x in lines[i + 1:i + 80] if "Replay:" in x]
            keep += [r[1:].strip() for r in rep[:1]]
            break
    summary = [x for x in lines if re.search(r"\d+ (passed|failed)", x)]
    return "\n".join(keep + summary[-1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help=f"mutants (default: all): {sorted(MUTANTS)}")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--target", default=None, help="pytest target (default: per mutant)")
    ap.add_argument("--profile", default="ci")
    args = ap.parse_args()
    names = args.names or list(MUTANTS)
    missed: list[str] = []
    baseline: dict[str, set] = {}
    for name in names:
        caught, dt, excerpt = run(name, args.nproc, args.target, args.profile, baseline)
        print(f"== {name}: {'CAUGHT' if caught else 'NOT CAUGHT'} ({dt:.1f}s)")
        print("   " + excerpt.replace("\n", "\n   "))
        if not caught:
            missed.append(name)
    print(f"{len(names) - len(missed)}/{len(names)} mutants caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
