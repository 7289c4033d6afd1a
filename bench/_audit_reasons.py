"""Why ours may still send more than PyTorch's DTensor in some audit cases
(``bench/comm_audit.py``): the excesses that remain, by reason, and the
accepted differences, where PyTorch sends less only by computing something
else. docs/ops.md ("Communication audit") lists both.
"""

from __future__ import annotations

# Ops where ours still sends more than PyTorch in some case, by reason
# (docs/ops.md, "Communication audit"). ``tests/test_comm_audit.py`` fails
# on an excess of an op listed nowhere here.
# None remain: every op case sends no more than PyTorch's DTensor. A new
# excess is listed here as {reason: ("<op>` sample <i> <layout>", ...)}.
_REASONS: dict[str, tuple[str, ...]] = {}
EXCEPTIONS: dict[str, str] = {
    f"op `{name}": why for why, names in _REASONS.items() for name in names
}

# Accepted differences: cases where PyTorch sends less only by computing
# something else. Counted apart from the excesses (``summarise``); each
# reason is shown by a test in tests/test_comm_audit_fixes_dist.py.
# (op, layouts whose name contains one of these) -> reason
_CAST_WRAPS = ("integer casts of Partial(max/min) pieces: PyTorch casts each "
               "piece, then reduces; a cast that wraps (negative or out-of-range "
               "values to uint8/int8) is not monotone, so its max is wrong "
               "(pieces -1.0 and 0.0 as Partial(max): .byte() gives 255, the plain "
               "op 0); ours reduces the float pieces first")
_FFT_OF_MAX = ("FFTs of Partial(max/min) pieces: PyTorch transforms each piece, "
               "then takes the max; an FFT is not monotone, so that max is wrong "
               "(tests/test_comm_audit_spatial_dist.py shows a case); ours reduces "
               "the pieces first. The samples' pieces differ by a constant, which "
               "moves only the zero-frequency term, so PyTorch happens to be right")
_LOCAL_ANY = ("gaussian_nll_loss checks any(var < 0) before it computes; PyTorch's "
              "any() of a sharded tensor is Partial(sum) and bool() reads each "
              "rank's own block (ranks disagree: tests/test_comm_audit_losses_dist.py); "
              "ours combines the ranks' answers (one small collective)")
_STATS_DROPPED = ("batch norm in training mode with a replicated running mean or variance: "
                  "PyTorch's DTensor slices them to the channel shard for the op and drops "
                  "their update (its running statistics stay at their old values: "
                  "tests/test_comm_audit_norm_dist.py); ours updates them, one all-gather "
                  "of the updated slices")
# Where each batch-norm form takes its running mean and variance.
_RUNNING_STATS = {"nn.functional.batch_norm": (1, 2), "native_batch_norm": (3, 4),
                  "_native_batch_norm_legit": (3, 4), "_batch_norm_with_update": (3, 4)}


def _replicated_stats(op: str, layout: str) -> bool:
    """A layout of batch-norm ``op`` whose running statistics are replicated:
    one per input, or all alike on a dim the 1-D statistics lack."""
    if not layout.startswith("("):
        return layout in ("R", "S(1)", "S(2)", "S(3)")
    parts = [p.strip() for p in layout.strip("()").split(", ")]
    return any(i < len(parts) and parts[i] == "R" for i in _RUNNING_STATS[op])


_ANY_OF_SUMS = ("any() of Partial(sum/avg) pieces: PyTorch takes any() of each piece and "
                "keeps the bools as Partial(sum), so pieces that cancel (1 and -1) read "
                "True where the plain op gives False (tests/test_comm_audit_misc_dist.py); "
                "ours reduces the pieces first (4 B a value where PyTorch sends 1 B)")
ACCEPTED: dict[tuple[str, tuple[str, ...]], str] = {
    ("any", ("P(sum)", "P(avg)")): _ANY_OF_SUMS,
    ("nn.functional.gaussian_nll_loss", ("S(",)): _LOCAL_ANY,
    ("byte", ("P(max)", "P(min)")): _CAST_WRAPS,
    ("char", ("P(max)", "P(min)")): _CAST_WRAPS,
    **{(f"fft.{kind}{n}", ("P(max)", "P(min)")): _FFT_OF_MAX
       for kind in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft") for n in ("", "2", "n")},
}


_PARTIAL_TOL = ("linalg.pinv with a Partial rtol/atol tensor: PyTorch computes each rank's "
                "pinv with that rank's own piece of the 0-d tolerance (never reduced), so "
                "ranks disagree where the pieces fall on different sides of a singular value "
                "(pieces 0.3 and 0.8 as Partial(min): rank 1 differs, "
                "tests/test_comm_audit_linalg_dist.py); the sample's rtol 1.0/1.5 happens to "
                "give equal results. Ours reduces the tolerance first (one 4 B collective)")
_MEAN_OF_MEANS = ("mean cross entropy of a batch cut over ranks: PyTorch averages the "
                  "ranks' local means (Partial(avg), 4 B), wrong wherever the ranks count "
                  "different totals of target weight (ignored targets, class weights: "
                  "tests/test_comm_audit_losses_dist.py); ours all-reduces each rank's sum "
                  "and weight total together (8 B)")
# (op, exact layout) -> reason, where a substring would also match real excesses
# The batch (input S(0)) cut in every one; the class weight or targets may be
# cut on other dims, gathered alike by both runtimes before the loss.
_CUT_BATCH_LINEAR = ("(S(0), R, S(0))", "(S(0), S(1), S(0))", "(S(0), R, S(1))",
                     "(S(0), S(1), S(1))", "(S(0), S(2), R)", "(S(0), S(2), S(1))")
ACCEPTED_EXACT: dict[tuple[str, str], str] = {
    **{("nn.functional.cross_entropy", lay): _MEAN_OF_MEANS
       for lay in ("S(0)", "(S(0), R)", "(S(0), S(1))")},
    **{("nn.functional.linear_cross_entropy", lay): _MEAN_OF_MEANS
       for lay in ("S(0)", "(S(0), R, R)", "(S(0), S(0), R)", "(S(0), S(1), R)",
                   *_CUT_BATCH_LINEAR)},
    **{("linalg.pinv", lay): _PARTIAL_TOL for lay in ("P(sum)", "P(avg)", "P(max)", "P(min)")},
    **{("nn.functional.linear_cross_entropy.chunked", lay): _MEAN_OF_MEANS
       for lay in ("(S(0), R, R)", *_CUT_BATCH_LINEAR)},
}


def accepted(op: str, layout: str) -> str | None:
    """The reason an excess of ``op`` in ``layout`` is an accepted difference."""
    if op in _RUNNING_STATS and _replicated_stats(op, layout):
        return _STATS_DROPPED
    if (op, layout) in ACCEPTED_EXACT:
        return ACCEPTED_EXACT[(op, layout)]
    for (name, kinds), why in ACCEPTED.items():
        if name == op and any(k in layout for k in kinds):
            return why
    return None
