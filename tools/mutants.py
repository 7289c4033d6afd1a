"""Deliberately broken runtimes: README's main job must catch each one.

``apply(name)`` monkeypatches one bug into the runtime of this process; the
property suite's conftest (``tests/properties/conftest.py``) calls it on every rank when
``DTENSOR_MUTANT=name`` is set (never otherwise). Run as a script, it runs
README's main job (``torchrun --nproc_per_node=4 -m pytest tests/properties
--hypothesis-profile=ci``) once unmutated and once per mutant (stopping at the
first failure), counts a mutant caught when a test that passes unmutated
fails, prints its minimal example and ``Replay:`` line, and ends with
"N/M planted bugs caught by the main job":

    python tools/mutants.py --lock /tmp/dtensor-suite.lock   # every mutant
    python tools/mutants.py --quick detach_returns_self       # its own file only

Mutants (docs/properties.md has the oracle that catches each):
    gather_drops_last_uneven_shard  uneven all-gather loses the last shard
    partial_to_replicate_skips_reduce  P -> R forgets the all-reduce
    random_same_offset_on_every_shard  every shard draws the numbers of the
        first block (the same random offset on every shard)
    outsider_joins_collective  a rank outside the mesh issues a collective
        when redistributing (a one-rank group here, so it is counted, not hung)
    nonlinear_op_keeps_partial  a sharding rule keeps ``abs`` of a Partial
        input partial (abs is not linear)
    max_pieces_added_elementwise  ``add``/``sub`` of two operands placed
        alike as ``Partial(max)`` (or ``min``) keep them partial (right only
        when one rank holds both extremes)
    bucketize_blocks_take_the_max  ``bucketize``/``searchsorted`` against
        boundaries cut along their sorted dim claim the blocks' counts as
        ``Partial(max)`` (they add up: ``Partial(sum)``)
    gather_zeroes_tail_of_dim2_on_4  gathering tensor dim 2 of length 5 over a
        mesh axis of 4 zeroes the last entry (rare: the ``ci`` profile misses
        it; ``python -m launch fuzz`` finds it, see docs/fuzzing.md)
    coordinate_wraps_past_127  a mesh coordinate kept in a signed byte (only a
        mesh axis of >= 129 ranks shows it: DTENSOR_WORLD_SIZES=256 --dist-sim)
    shard_range_balanced  shards split 2,1,1,1 (array_split), not torch.chunk's
        2,2,1,0; self-consistent, so every full value survives
    submesh_ignores_name_order  ``mesh["tp", "dp"]`` names its axes as asked
        but keeps the parent's rank grid
    get_local_rank_assumes_consecutive_ranks  ``get_local_rank`` computed
        from the rank as if the mesh held consecutive ranks
    detach_returns_self  ``detach()`` of a tensor without grad is the tensor
        itself, so an in-place view on one reshapes the other
    inplace_view_returns_new_tensor  ``t_()`` and friends return a reshaped
        tensor and leave ``self`` as it was
    fast_key_drops_value_kwargs  the fast-path cache keys ``keepdim=``,
        ``dtype=``, ``memory_format=`` by type alone
    propagation_cache_ignores_placements  the propagation cache keys a spec
        by mesh and metadata, not placements
    redistribute_grad_left_in_output_layout  the gradient through
        ``redistribute`` keeps the output's layout (values still right)
    to_local_ignores_grad_placements  ``to_local(grad_placements=...)`` is
        ignored
    run_check_trusts_each_rank  ``from_local(run_check=True)`` checks nothing
    random_run_start_ignores_inner_offsets  a block that is one contiguous
        run starts its stream at the offset of dim 0 alone
    random_strided_runs_start_at_column_zero  every run of a strided block
        starts at column 0 of the run dim
    random_empty_block_comes_back_flat  an empty block is returned as shape (0,)

One per input kind of the recently added code (the property that catches it):
    random_mid_row_run_drops_row_offset  a block that is one run starting
        mid-row keeps only its column offset
        (test_random.py::test_random_runs_that_start_mid_row)
    norm_order_zero_share_powered  order-0 norm pieces (counts) are raised to
        the 0th power when reduced
        (test_norms.py::test_vector_norm_of_every_order_matches_single_device)
    foreach_add_keeps_partial  ``_foreach_add_`` of a scalar keeps Partial(sum)
        members partial (test_foreach.py::test_every_foreach_case_on_every_partial_kind)
    run_check_broadcasts_first_replicate_axis_only  ``run_check`` makes
        replicas agree on the first Replicate axis only
        (test_run_check.py: accepts every layout, replicas agree on every axis)
    mixed_partials_reduce_in_any_order  every pair of reduce ops "commutes"
        (test_redistribute.py: mixed partial pieces reduce in axis order)
    plain_operand_key_drops_dtype  the call key holds a plain operand's shape,
        not its dtype (test_caches.py: plain operands of another dtype)
    permute_maps_shards_forward  permute moves shard dim d to dims[d], right
        for self-inverse permutations only (test_permute.py)
    mesh_boolean_reduces_first_axis_only  ``equal`` and friends agree over
        mesh axis 0 only (test_mesh_booleans.py::
        test_mesh_wide_booleans_see_a_block_on_a_later_axis_differ)
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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by file path too

from _mutants_layouts import (  # noqa: E402
    _gather_drops_last_uneven_shard,
    _partial_to_replicate_skips_reduce,
    _random_same_offset_on_every_shard,
    _outsider_joins_collective,
    _nonlinear_op_keeps_partial,
    _max_pieces_added_elementwise,
    _bucketize_blocks_take_the_max,
    _gather_zeroes_tail_of_dim2_on_4,
    _shard_range_balanced,
    _submesh_ignores_name_order,
    _get_local_rank_assumes_consecutive_ranks,
    _detach_returns_self,
    _inplace_view_returns_new_tensor,
    _fast_key_drops_value_kwargs,
    _propagation_cache_ignores_placements,
    _redistribute_grad_left_in_output_layout,
    _to_local_ignores_grad_placements,
    _run_check_trusts_each_rank,
)
from _mutants_ops import (  # noqa: E402
    _random_block_mutant,
    _inner_offsets_dropped,
    _runs_from_column_zero,
    _coordinate_wraps_past_127,
    _gather_zeroes_eighth_piece_on_wide_axis,
    _mid_row_offset_dropped,
    _norm_order_zero_share_powered,
    _foreach_add_keeps_partial,
    _run_check_broadcasts_first_replicate_axis_only,
    _mixed_partials_reduce_in_any_order,
    _plain_operand_key_drops_dtype,
    _permute_maps_shards_forward,
    _mesh_boolean_reduces_first_axis_only,
)


MUTANTS = {
    "coordinate_wraps_past_127": (_coordinate_wraps_past_127,
                                  "tests/properties/test_redistribute.py"),
    "gather_zeroes_eighth_piece_on_wide_axis": (_gather_zeroes_eighth_piece_on_wide_axis,
                                                "tests/properties/test_redistribute.py"),
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
    "max_pieces_added_elementwise": (_max_pieces_added_elementwise,
                                     "tests/properties/test_ops.py"),
    "bucketize_blocks_take_the_max": (_bucketize_blocks_take_the_max,
                                      "tests/properties/test_sorted_boundaries.py"),
    "gather_zeroes_tail_of_dim2_on_4": (_gather_zeroes_tail_of_dim2_on_4,
                                        "tests/properties/test_redistribute.py"),
    # bugs that leave full values intact or hide from generic draws
    "shard_range_balanced": (_shard_range_balanced, "tests/properties/test_redistribute.py"),
    "submesh_ignores_name_order": (_submesh_ignores_name_order,
                                   "tests/properties/test_layouts.py"),
    "get_local_rank_assumes_consecutive_ranks": (_get_local_rank_assumes_consecutive_ranks,
                                                 "tests/properties/test_outsiders.py"),
    "detach_returns_self": (_detach_returns_self, "tests/properties/test_aliasing.py"),
    "inplace_view_returns_new_tensor": (_inplace_view_returns_new_tensor,
                                        "tests/properties/test_aliasing.py"),
    "fast_key_drops_value_kwargs": (_fast_key_drops_value_kwargs,
                                    "tests/properties/test_caches.py"),
    "propagation_cache_ignores_placements": (_propagation_cache_ignores_placements,
                                             "tests/properties/test_caches.py"),
    "redistribute_grad_left_in_output_layout": (_redistribute_grad_left_in_output_layout,
                                                "tests/properties/test_grad_layouts.py"),
    "to_local_ignores_grad_placements": (_to_local_ignores_grad_placements,
                                         "tests/properties/test_grad_layouts.py"),
    "run_check_trusts_each_rank": (_run_check_trusts_each_rank,
                                   "tests/properties/test_run_check.py"),
    "random_run_start_ignores_inner_offsets": (
        lambda: _random_block_mutant(_inner_offsets_dropped), "tests/properties/test_random.py"),
    "random_strided_runs_start_at_column_zero": (
        lambda: _random_block_mutant(_runs_from_column_zero), "tests/properties/test_random.py"),
    "random_empty_block_comes_back_flat": (
        lambda: _random_block_mutant(flat_empty=True), "tests/properties/test_random.py"),
    # one per input kind; the property that catches each in the table
    # of docs/properties.md
    "random_mid_row_run_drops_row_offset": (
        lambda: _random_block_mutant(_mid_row_offset_dropped),
        "tests/properties/test_random.py"),
    "norm_order_zero_share_powered": (_norm_order_zero_share_powered,
                                      "tests/properties/test_norms.py"),
    "foreach_add_keeps_partial": (_foreach_add_keeps_partial,
                                  "tests/properties/test_foreach.py"),
    "run_check_broadcasts_first_replicate_axis_only": (
        _run_check_broadcasts_first_replicate_axis_only, "tests/properties/test_run_check.py"),
    "mixed_partials_reduce_in_any_order": (_mixed_partials_reduce_in_any_order,
                                           "tests/properties/test_redistribute.py"),
    "plain_operand_key_drops_dtype": (_plain_operand_key_drops_dtype,
                                      "tests/properties/test_caches.py"),
    "permute_maps_shards_forward": (_permute_maps_shards_forward,
                                    "tests/properties/test_permute.py"),
    "mesh_boolean_reduces_first_axis_only": (_mesh_boolean_reduces_first_axis_only,
                                             "tests/properties/test_mesh_booleans.py"),
}


# Planted for fuzzing sessions (docs/fuzzing.md): the ci profile misses them
# by design, so the default run (every mutant) leaves them out.
FUZZ_ONLY = {"gather_zeroes_tail_of_dim2_on_4"}
# Needs >= 8 ranks on one axis: caught by simulated worlds only (
# DTENSOR_WORLD_SIZES=16 pytest --dist-sim), so the 4-rank default run skips it.
FUZZ_ONLY |= {"gather_zeroes_eighth_piece_on_wide_axis"}
# Needs >= 129 ranks on one axis: DTENSOR_WORLD_SIZES=256 pytest --dist-sim only.
FUZZ_ONLY |= {"coordinate_wraps_past_127"}


def apply(name: str) -> None:
    """Monkeypatch mutant ``name`` into this process's runtime."""
    if name not in MUTANTS:
        raise SystemExit(f"DTENSOR_MUTANT={name!r}: unknown mutant; one of {sorted(MUTANTS)}")
    MUTANTS[name][0]()


#: README's main job: the property suite on a 4-rank world, ``ci`` profile.
MAIN_JOB = ("tests/properties", 4, "ci")


#: ``--lock PATH``: each pytest run waits for ``flock PATH`` (a shared machine).
LOCK: list[str] = []
#: ``--log-dir DIR``: each mutant's whole output goes to ``DIR/<name>.log``.
LOG_DIR: list[str] = []


def _pytest(target: str, nproc: int, profile: str, mutant: str | None,
            first_failure: bool = False) -> tuple[set, float, str]:
    """(failed test ids, pytest's seconds, output) of the suite at ``target``."""
    cmd = [*LOCK, "torchrun", f"--nproc_per_node={nproc}", "-m", "pytest", "-p",
           "launch.hypo.profiles", target, "-q", "-rf", "-p", "no:cacheprovider",
           f"--hypothesis-profile={profile}", *(["-x"] if first_failure else [])]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DTENSOR_MUTANT", None)
    if mutant:
        env["DTENSOR_MUTANT"] = mutant
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    took = re.findall(r"(?:passed|failed|error|errors)[^\n]* in ([\d.]+)s", out)
    # pytest's own time: the wall time would include waiting for the lock
    seconds = float(took[-1]) if took else time.monotonic() - t0
    failed = set(re.findall(r"^FAILED (\S+)", out, re.M))
    return failed, seconds, out


def run(name: str, nproc: int, target: str | None, profile: str,
        baseline: dict[str, set] | None) -> tuple[bool, float, str]:
    """Run ``target`` with mutant ``name``: caught when a test that passes on
    the unmutated runtime (``baseline``, filled on demand; None: every test
    passes unmutated) fails. The mutated run stops at its first failure."""
    target = target or MUTANTS[name][1]
    if baseline is None:
        baseline = {target: set()}
    elif target not in baseline:
        baseline[target], took, out = _pytest(target, nproc, profile, None)
        summary = [x for x in out.splitlines() if re.search(r"\d+ (passed|failed)", x)]
        print(f"== unmutated {target}: {summary[-1].strip() if summary else '?'} "
              f"({took:.1f}s); failing there: {sorted(baseline[target])}", flush=True)
    failed, dt, out = _pytest(target, nproc, profile, name, first_failure=True)
    if LOG_DIR:
        Path(LOG_DIR[0], f"{name}.log").write_text(out)
    new = sorted(failed - baseline[target])
    replay = (f"DTENSOR_MUTANT={name} torchrun --nproc_per_node={nproc} -m pytest "
              f"-p launch.hypo.profiles '{{test}}' --hypothesis-profile={profile}")
    return bool(new), dt, _excerpt(out, new, replay)


def _excerpt(out: str, new: list[str], replay: str = "") -> str:
    """The first new failure's minimal example, first error line and replay command.

    Three shapes of failure: a ``RankFailure`` (ranks disagree: the lockstep
    plugin prints the example and a ``Replay:`` line), a failure alike on every
    rank (Hypothesis's own "Failing test case" with its ``Draw`` lines), and a
    hang the test service's watchdog ends (no example: it cannot shrink).
    ``replay`` is the command printed when the output has no ``Replay:`` line.
    """
    lines = out.splitlines()
    keep: list[str] = [f"newly failing: {new}"]
    for i, line in enumerate(lines):
        if "RankFailure: example failed" in line and any(
                n.split("::")[-1] in "\n".join(lines[i:i + 300]) for n in new):
            keep.append(line.split("RankFailure: ", 1)[1].strip())
            errs = [x[1:].strip()[:400] for x in lines[i + 1:i + 200]
                    if re.match(r"E\s+(\w*(Error|Exception)|Failed):", x)]
            # Ranks may fail differently (one names the bug, the others may
            # only report that a peer failed): up to two distinct messages.
            keep += list(dict.fromkeys(errs))[:2]
            rep = [x for x in lines[i + 1:i + 300] if "Replay:" in x]
            keep += [r[1:].strip() for r in rep[:1]]
            break
    else:
        for i, line in enumerate(lines):
            if "Failing test case:" in line:
                errs = [x for x in lines[max(0, i - 5):i + 1]
                        if re.match(r"E\s+(\w*(Error|Exception)|Failed):", x)]
                draws = []
                for x in lines[i + 1:i + 80]:
                    if re.match(r"E\s+Draw \d+", x):
                        draws.append(x[1:].strip()[:300])
                    elif draws:
                        break
                keep += draws + [e[1:].strip()[:400] for e in errs[:1]]
                break
        for i, line in enumerate(lines):
            if line.startswith("launch: timed out"):
                keep.append(line.strip())
                keep += [x.strip() for x in lines[i + 1:i + 6]
                         if x.startswith("stuck ranks") or re.match(r"\s+rank \d+: ", x)]
                break
    if replay and new and not any(k.startswith("Replay:") for k in keep):
        keep.append(f"Replay: {replay.format(test=new[0])}")
    summary = [x for x in lines if re.search(r"\d+ (passed|failed)", x)]
    return "\n".join(keep + summary[-1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help=f"mutants (default: all): {sorted(MUTANTS)}")
    ap.add_argument("--quick", action="store_true",
                    help="run each mutant's own property file, not the whole main job")
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: 4, as README)")
    ap.add_argument("--target", default=None, help="pytest target (default: the main job)")
    ap.add_argument("--profile", default="ci")
    ap.add_argument("--lock", default=None, help="flock this file around each pytest run")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the unmutated run (when it is known to pass)")
    ap.add_argument("--log-dir", default=None, help="keep each mutant's output here")
    args = ap.parse_args()
    if args.lock:
        LOCK[:] = ["flock", args.lock]
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        LOG_DIR[:] = [args.log_dir]
    names = args.names or [n for n in MUTANTS if n not in FUZZ_ONLY]
    main_target, main_nproc, main_profile = MAIN_JOB
    nproc = args.nproc or main_nproc
    target = args.target or (None if args.quick else main_target)
    is_main = (target == main_target and nproc == main_nproc
               and args.profile == main_profile)
    missed: list[str] = []
    baseline: dict[str, set] | None = None if args.no_baseline else {}
    for name in names:
        caught, dt, excerpt = run(name, nproc, target, args.profile, baseline)
        print(f"== {name}: {'CAUGHT' if caught else 'NOT CAUGHT'} ({dt:.1f}s)", flush=True)
        print("   " + excerpt.replace("\n", "\n   "), flush=True)
        if not caught:
            missed.append(name)
    where = "the main job" if is_main else (
        f"{target or 'their own property files'} ({nproc} ranks, {args.profile})")
    skipped = f"; fuzz-only, not run: {sorted(FUZZ_ONLY)}" if not args.names else ""
    print(f"{len(names) - len(missed)}/{len(names)} planted bugs caught by {where}"
          + (f"; missed: {missed}" if missed else "") + skipped)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
