"""One case of a rule check: an op on placed inputs against single device.

``run_case`` is what ``verify_rule`` (drawn cases) and ``certify_rule``
(every case up to a bound) run on every rank of the world, in lockstep:
build each tensor argument from this rank's block (random ``Partial``
pieces, ``dtensor.testing.partial_inputs``), run the op through the
runtime under the op's rule, and compare every output's global shape,
dtype, this rank's block and offset (the per-rank oracle) and the reduced
values with the op on the full tensors. Ranks agree on whether the op
raised before any further collective, so a rank failing alone never leaves
the others waiting; a wrong case raises ``RuleCounterexample`` naming the
op, the mesh, the input placements, what the rule claimed and what single
device gives.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from dtensor.placement import Partial, Placement, Replicate
from dtensor.testing.impl import exact_split
from dtensor.testing.oracle import assert_layout
from dtensor.testing.partial_inputs import PartialSplit, from_pieces

__all__ = ["Case", "RuleCounterexample", "Sample", "agree_failed", "first_message",
           "run_case", "tensor_leaves_of"]


class RuleCounterexample(AssertionError):
    """A rule (or plan) gives a result that differs from single device."""


@dataclass(frozen=True)
class Sample:
    """The arguments of one call: ``Sample((x, 1), {"keepdim": True})``."""

    args: tuple
    kwargs: dict

    def __repr__(self) -> str:
        parts = [_short(a) for a in self.args]
        parts += [f"{k}={_short(v)}" for k, v in self.kwargs.items()]
        return f"Sample({', '.join(parts)})"


def as_sample(value: Any) -> Sample:
    """A drawn value as a ``Sample``: a Sample, a tuple of args, or one tensor."""
    if isinstance(value, Sample):
        return value
    if isinstance(value, torch.Tensor):
        return Sample((value,), {})
    if isinstance(value, tuple):
        return Sample(value, {})
    raise ValueError(f"sample_inputs must draw a Sample, a tuple of arguments or a "
                     f"tensor; got {type(value).__name__}: {value!r}")


@dataclass(frozen=True)
class Case:
    """An op call on a mesh: the arguments and each tensor argument's placements."""

    op: Any
    sample: Sample
    layout: Any  # MeshLayout
    placements: tuple[tuple[Placement, ...], ...]  # per tensor leaf, in pytree order
    split: PartialSplit

    def describe(self) -> str:
        leaves = tensor_leaves_of(self.sample)
        ins = "; ".join(f"{_short(t)} as {_pstr(p)}"
                        for t, p in zip(leaves, self.placements, strict=True))
        return (f"{_op_name(self.op)}{_non_tensors(self.sample)} on mesh "
                f"{self.layout}: {ins}; {self.split}")


def tensor_leaves_of(sample: Sample) -> list[torch.Tensor]:
    flat, _ = pytree.tree_flatten((sample.args, sample.kwargs))
    return [x for x in flat if isinstance(x, torch.Tensor)]


def _op_name(op: Any) -> str:
    return str(op) if isinstance(op, torch._ops.OpOverload) else getattr(
        op, "__qualname__", repr(op))


def _pstr(ps: Sequence[Any]) -> str:
    out = []
    for p in ps:
        name = type(p).__name__
        out.append(f"S({p.dim})" if name == "Shard" else "R" if name == "Replicate"
                   else f"P({getattr(p, 'reduce_op', '?')})")
    return "(" + ", ".join(out) + ")"


def _short(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        dt = str(v.dtype).removeprefix("torch.")
        body = ", ".join(map(repr, v.detach().flatten()[:12].tolist()))
        more = ", ..." if v.numel() > 12 else ""
        return f"{dt}{list(v.shape)} [{body}{more}]"
    if isinstance(v, (list, tuple)):
        inner = ", ".join(_short(x) for x in v)
        return f"[{inner}]" if isinstance(v, list) else f"({inner})"
    return repr(v)


def first_message(err: BaseException | None) -> str:
    """The lowest failing rank's message, on every rank (call after a failure)."""
    import torch.distributed as dist

    mine = None if err is None else str(err)
    if not (dist.is_available() and dist.is_initialized()):
        return mine or ""
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    return next((m for m in got if m is not None), "")


def agree_failed(failed: bool) -> int:
    """How many ranks of the world failed (one tiny all-reduce; 0 without a world)."""
    return _agree(failed)


def _agree(failed: bool) -> int:
    """How many ranks of the world failed (one tiny all-reduce; 0 without a world)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return int(failed)
    t = torch.tensor([int(failed)])
    dist.all_reduce(t)
    return int(t.item())


def _replicated(dt: Any) -> Any:
    """``dt`` with its Partial axes reduced (a collective over its mesh)."""
    ps = tuple(dt.placements)
    if not any(type(p).__name__ == "Partial" for p in ps):
        return dt
    rep = type(ps[0]).__module__
    import importlib

    R = importlib.import_module(rep).Replicate
    return dt.redistribute(dt.device_mesh, [R() if type(p).__name__ == "Partial" else p
                                            for p in ps])


def run_case(impl: Any, case: Case, *, rtol: float | None = None,
             atol: float | None = None, replay: str = "") -> None:
    """Check one case on every rank; raise ``RuleCounterexample`` on every rank
    if any rank's result differs. Returns quietly when single device raises
    too (the case is not a valid call): see ``single_device``."""
    expected = single_device(case)
    mesh = impl.mesh(case.layout)
    leaves = tensor_leaves_of(case.sample)
    exact = all(exact_split(x) for x in leaves)
    flat, tree = pytree.tree_flatten((case.sample.args, case.sample.kwargs))
    it = iter(case.placements)
    # Each operand its own pieces: one shared seed would put every operand's
    # max/min extremes on the same coordinates.
    k = itertools.count()
    dflat = [from_pieces(impl, x, mesh, next(it), case.split.for_operand(next(k)), exact=exact)
             if isinstance(x, torch.Tensor) else x for x in flat]
    dargs, dkwargs = pytree.tree_unflatten(dflat, tree)
    err: BaseException | None = None
    out = None
    try:
        out = case.op(*dargs, **dkwargs)
    except Exception as e:  # a rule error, a guard error, a local op error
        err = e
    n_failed = _agree(err is not None)
    if n_failed:
        why = (f"raised {type(err).__name__}: {err}" if err is not None
               else f"raised on {n_failed} other rank(s) (their errors say why)")
        raise RuleCounterexample(_report(case, expected, None, why, replay)) from err
    got = [x for x in pytree.tree_leaves(out) if isinstance(x, impl.DTensor)]
    want = [x for x in pytree.tree_leaves(expected) if isinstance(x, torch.Tensor)]
    problem = None
    if len(got) != len(want):
        problem = f"{len(got)} DTensor outputs, single device gives {len(want)} tensors"
    else:
        # Pieces' layout first (local), then every output's Partial axes reduced
        # (collectives, every member joins), then the values (local).
        reduced = []
        for j, (g, w) in enumerate(zip(got, want, strict=True)):
            if problem is None:
                problem = _meta_problem(j, g, w)
            partial = any(type(p).__name__ == "Partial" for p in g.placements)
            if problem is None and partial:
                try:
                    assert_layout(g, None, msg=f"output {j}")
                except AssertionError as e:
                    problem = str(e)
            ok_meta = tuple(g.shape) == tuple(w.shape)
            inside = g.device_mesh.get_coordinate() is not None
            reduced.append(_replicated(g) if ok_meta and inside else g)
        for j, (g, w) in enumerate(zip(reduced, want, strict=True)):
            if problem is not None:
                break
            try:
                assert_layout(g, w, rtol=rtol, atol=atol, msg=f"output {j}")
            except AssertionError as e:
                problem = str(e)
    if problem is not None:
        raise RuleCounterexample(_report(case, expected, got, problem, replay))


def _meta_problem(j: int, g: Any, w: torch.Tensor) -> str | None:
    if tuple(g.shape) != tuple(w.shape):
        return (f"output {j}: global shape {list(g.shape)}, single device "
                f"{list(w.shape)}")
    if g.dtype != w.dtype:
        return f"output {j}: dtype {g.dtype}, single device {w.dtype}"
    return None


class InvalidCall(Exception):
    """Single device raises on this sample: not a case of the rule."""


def single_device(case: Case) -> Any:
    """The op on the full tensors; ``InvalidCall`` if it raises there."""
    try:
        return case.op(*case.sample.args, **case.sample.kwargs)
    except Exception as e:
        raise InvalidCall(f"{type(e).__name__}: {e}") from e


def _report(case: Case, expected: Any, got: Any, problem: str, replay: str) -> str:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    claimed = ("none (the call raised)" if got is None else
               "; ".join(f"{_pstr(g.placements)} of shape {list(g.shape)} {g.dtype}"
                         for g in got))
    lines = [
        f"sharding rule counterexample for {_op_name(case.op)} (rank {rank}):",
        f"  mesh: {case.layout}",
        "  inputs: " + "; ".join(
            f"{_short(t)} placed {_pstr(p)}"
            for t, p in zip(tensor_leaves_of(case.sample), case.placements,
                            strict=True)),
        f"  non-tensor arguments: {_non_tensors(case.sample)}",
        f"  Partial pieces: {case.split} (random pieces reducing to each input)",
        f"  the rule claimed: {claimed}",
        f"  single device gives: {_short_tree(expected)}",
        f"  what differs: {problem}",
    ]
    if replay:
        lines.append(replay)
    return "\n".join(lines)


def _non_tensors(sample: Sample) -> str:
    args = [("tensor" if isinstance(a, torch.Tensor) else repr(a)) for a in sample.args]
    args += [f"{k}={'tensor' if isinstance(v, torch.Tensor) else repr(v)}"
             for k, v in sample.kwargs.items()]
    return "(" + ", ".join(args) + ")"


def _short_tree(v: Any) -> str:
    leaves = [x for x in pytree.tree_leaves(v) if isinstance(x, torch.Tensor)]
    return "; ".join(_short(x) for x in leaves) or repr(v)


def replicate_all(n: int) -> tuple[Placement, ...]:
    return tuple(Replicate() for _ in range(n))


def has_partial(ps: Sequence[Placement]) -> bool:
    return any(isinstance(p, Partial) for p in ps)
