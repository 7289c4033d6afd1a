"""``certify_rule``: every case up to a bound, exhaustively, against single device.

Where ``verify_rule`` draws cases, ``certify_rule`` runs all of them: every
base shape up to ``max_size`` per side, on every mesh shape given, with
every combination of placements for the op's tensor arguments (every
``Shard`` dim, ``Replicate``, ``Partial`` of each reduce op, on every mesh
axis). Each case is ``rule_case.run_case`` (random ``Partial`` pieces held
by the last coordinate of each axis, the per-rank oracle, values), and the
ranks agree on each verdict, so every rank counts the same. The answer is a
``Certificate``: "N cases, 0 wrong", or the first wrong case.

Example:
    >>> cert = certify_rule(torch.ops.mylib.rowscale.default, max_size=3)
    >>> print(cert)   # certificate: dtensor, mylib.rowscale.default: N cases, 0 wrong
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtensor.placement import REDUCE_OPS, Partial, Placement, Replicate, Shard
from dtensor.testing.impl import Impl, get_impl
from dtensor.testing.meshes import MeshLayout
from dtensor.testing.partial_inputs import PartialSplit
from dtensor.testing.rule_case import (
    Case,
    InvalidCall,
    RuleCounterexample,
    _agree,
    as_sample,
    first_message,
    tensor_leaves_of,
)
from dtensor.testing.rule_case import run_case as _run_case
from dtensor.testing.verify import world_size_now

__all__ = ["Certificate", "all_placements", "base_shapes", "certify_rule",
           "default_meshes"]


@dataclass(frozen=True)
class Certificate:
    """What ``certify_rule`` checked and found."""

    op: str
    impl: str
    cases: int  # cases run (valid calls)
    wrong: int
    invalid: int  # samples single device refuses (not cases of the rule)
    mesh_shapes: tuple[tuple[int, ...], ...]
    shapes: int  # base shapes
    seconds: float
    first_wrong: str | None = None

    @property
    def ok(self) -> bool:
        return self.wrong == 0

    def __str__(self) -> str:
        head = (f"certificate: {self.impl}, {self.op}: {self.cases} cases, "
                f"{self.wrong} wrong ({self.shapes} base shapes on meshes "
                f"{', '.join(map(str, self.mesh_shapes))}; {self.invalid} samples "
                f"single device refuses; {self.seconds:.1f} s)")
        return head if self.first_wrong is None else f"{head}\nfirst wrong case:\n" \
            f"{self.first_wrong}"


def base_shapes(*, max_size: int, min_dims: int = 1, max_dims: int = 2
                ) -> list[tuple[int, ...]]:
    """Every shape with ``min_dims..max_dims`` dims and sides ``0..max_size``."""
    return [s for nd in range(min_dims, max_dims + 1)
            for s in itertools.product(range(max_size + 1), repeat=nd)]


def default_meshes(world: int) -> list[tuple[int, ...]]:
    """The whole world as a 1-D mesh, and every 2-D split without size-1 axes."""
    out = [(world,)]
    out += [(a, world // a) for a in range(2, world)
            if world % a == 0 and world // a > 1]
    return out


def all_placements(mesh_ndim: int, tensor_ndim: int, reduce_ops: Sequence[str],
                   mixed_reduce_ops: bool = True) -> list[tuple[Placement, ...]]:
    """Every placement tuple for a ``tensor_ndim``-D tensor on a mesh of
    ``mesh_ndim`` axes (without mixed reduce ops unless ``mixed_reduce_ops``)."""
    one: list[Placement] = [Replicate(), *(Shard(d) for d in range(tensor_ndim)),
                            *(Partial(op) for op in reduce_ops)]
    out = []
    for ps in itertools.product(one, repeat=mesh_ndim):
        ops = {p.reduce_op for p in ps if isinstance(p, Partial)}
        if mixed_reduce_ops or len(ops) <= 1:
            out.append(ps)
    return out


def base_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Distinct small integers, negative and positive: exact in every dtype."""
    n = math.prod(shape)
    t = torch.arange(n, dtype=torch.int64) - n // 2
    if dtype == torch.bool:
        return (t.remainder(2) == 0).reshape(tuple(shape))
    return t.to(dtype).reshape(tuple(shape))


def certify_rule(
    op: Any,
    make_args: Callable[[torch.Tensor], Any] | None = None,
    *,
    max_size: int = 3,
    min_dims: int = 1,
    max_dims: int = 2,
    shapes: Iterable[Sequence[int]] | None = None,
    mesh_shapes: Iterable[Sequence[int]] | None = None,
    dtype: torch.dtype = torch.float32,
    reduce_ops: Sequence[str] = REDUCE_OPS,
    impl: str | Impl = "dtensor",
    rtol: float | None = None,
    atol: float | None = None,
    raise_on_wrong: bool = True,
    name: str | None = None,
) -> Certificate:
    """Run ``op`` on every case up to the bounds; a ``Certificate`` of the result.

    Args:
        op: the op overload, or a callable on tensors.
        make_args: builds the call from one base tensor ``x`` (every base
            shape, distinct small integers of ``dtype``): a ``Sample``, a
            tuple of args or a tensor. Default ``(x,)``. Every tensor in the
            call gets every placement tuple, independently.
        max_size, min_dims, max_dims: base shapes: every shape with that many
            dims, sides ``0..max_size`` (uneven and empty blocks). Or ``shapes``.
        mesh_shapes: default ``default_meshes(world)``; a mesh smaller than
            the world leaves the last ranks out (dtensor only).
        reduce_ops: ``Partial`` reduce ops placed on the inputs.
        impl: ``"dtensor"`` or ``"torch"`` (no mixed reduce ops there).
        raise_on_wrong: raise ``RuleCounterexample`` on every rank at the
            first wrong case (else count them all and return).
        name: what the certificate calls the op (default: its name).

    Example:
        >>> assert certify_rule(torch.ops.aten.relu.default).ok
    """
    the_impl = get_impl(impl) if isinstance(impl, str) else impl
    world = world_size_now("certify_rule")
    meshes = tuple(tuple(m) for m in (mesh_shapes or default_meshes(world)))
    for m in meshes:
        if math.prod(m) > world or (math.prod(m) < world and not the_impl.sub_meshes):
            raise ValueError(
                f"certify_rule: mesh shape {m} needs {math.prod(m)} ranks; the "
                f"world has {world}"
                f"{'' if the_impl.sub_meshes else ' and torch meshes take all'}; "
                "pass mesh_shapes that fit")
    base = [tuple(s) for s in shapes] if shapes is not None else base_shapes(
        max_size=max_size, min_dims=min_dims, max_dims=max_dims)
    build = make_args or (lambda x: (x,))
    start = time.perf_counter()
    cases = wrong = invalid = 0
    first = None
    for mshape in meshes:
        layout = MeshLayout(mshape, tuple(range(math.prod(mshape))))
        split = PartialSplit(tuple(n - 1 for n in mshape), 0)
        for shape in base:
            sample = as_sample(build(base_tensor(shape, dtype)))
            choices = [all_placements(len(mshape), t.ndim, reduce_ops,
                                      the_impl.mixed_partials)
                       for t in tensor_leaves_of(sample)]
            for ps in itertools.product(*choices):
                split = PartialSplit(split.holders, cases)
                case = Case(op, sample, layout, tuple(ps), split)
                err = None
                try:
                    _run_case(the_impl, case, rtol=rtol, atol=atol)
                except InvalidCall:
                    invalid += 1
                    break  # the sample itself is refused: its other layouts too
                except RuleCounterexample as e:
                    err = e
                cases += 1
                if _agree(err is not None):
                    wrong += 1
                    if first is None:
                        first = first_message(err)
                    if raise_on_wrong:
                        raise RuleCounterexample(
                            f"certify_rule: {_name(op)} wrong after {cases} cases:\n"
                            f"{first}")
    return Certificate(name or _name(op), the_impl.name, cases, wrong, invalid, meshes,
                       len(base),
                       time.perf_counter() - start, first)


def _name(op: Any) -> str:
    return str(op) if isinstance(op, torch._ops.OpOverload) else getattr(
        op, "__qualname__", repr(op))
