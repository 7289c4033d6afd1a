"""The sharding-rule contract: what a rule sees (``OpCall``) and answers (``Sharding``).

Rules (``dtensor/rules/``) and users' own rules import from here only; the
dispatcher consumes these values. Both are plain immutable values: a rule is a
pure function ``rule(call: OpCall) -> Sharding | None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtensor.placement import Placement
from dtensor.spec import DTensorSpec

__all__ = ["OpCall", "Sharding"]


@dataclass(frozen=True, slots=True)
class OpCall:
    """What a rule sees: the op, the input specs, and the other arguments.

    ``specs`` lists the DTensor (and implicitly replicated plain tensor)
    operands in the order they appear in ``args`` then ``kwargs``, flattened;
    ``args``/``kwargs`` hold each such operand's spec in its place.
    """

    func: Any
    specs: tuple[DTensorSpec, ...]
    args: tuple
    kwargs: dict


@dataclass(frozen=True, slots=True)
class Sharding:
    """A rule's answer: placements the inputs need, and the outputs' placements.

    ``inputs[i]`` is the placement tuple operand ``i`` must have (``None``:
    keep it). ``outputs`` is one placement tuple per tensor output, in pytree
    order of the op's result (for an op returning ``Tensor[]``, one tuple
    stands for every element). ``scalar_reduce`` names how a Python-scalar
    result is combined over the mesh ("all" for and-ing bools), if at all.
    ``local``, if given, computes this rank's outputs instead of calling the
    op on the local blocks: ``local(func, coord, out_specs, args, kwargs)``
    with local tensors in ``args``/``kwargs`` (e.g. a view whose size
    argument must be this rank's block shape). ``shapes``, if given, are the
    outputs' global shapes (one per output, like ``outputs``): pure shape
    math that spares dispatch running the op on meta tensors for a new shape.
    """

    inputs: tuple[tuple[Placement, ...] | None, ...]
    outputs: tuple[tuple[Placement, ...], ...]
    scalar_reduce: str | None = None
    local: Any = None
    shapes: tuple[tuple[int, ...], ...] | None = None
