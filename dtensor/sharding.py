"""The sharding-rule contract: what a rule sees (``OpCall``) and answers (``Sharding``).

Rules (``dtensor/rules/``) and users' own rules import from here only; the
dispatcher consumes these values. Both are plain immutable values: a rule is a
pure function ``rule(call: OpCall) -> Sharding | None``. Users add rules with
``register_rule``; the built-in tables are merged in ``dtensor/rules/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dtensor.errors import UnsupportedOpError
from dtensor.placement import Placement
from dtensor.spec import DTensorSpec

__all__ = [
    "OpCall",
    "Sharding",
    "on_register",
    "register_rule",
    "registered_rule",
    "writes_self",
]


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
    math that spares dispatch running the op on meta tensors for a new shape;
    they apply to contiguous operands only, unless ``any_strides``: the op
    makes fresh contiguous outputs whatever its operands' strides (products:
    ``linear`` hands ``addmm`` a transposed weight). ``settled``, if given,
    are the placements the outputs are returned with (one tuple per output,
    like ``outputs``): each output is computed in its ``outputs`` layout,
    then redistributed to it (a ``local`` function gets the ``outputs``
    specs). A sum of ``Partial("avg")`` pieces uses it to reduce its small
    output once rather than hand on pieces that every later whole read would
    reduce again.
    """

    inputs: tuple[tuple[Placement, ...] | None, ...]
    outputs: tuple[tuple[Placement, ...], ...]
    scalar_reduce: str | None = None
    local: Any = None
    shapes: tuple[tuple[int, ...], ...] | None = None
    any_strides: bool = False
    settled: tuple[tuple[Placement, ...], ...] | None = None


def writes_self(func) -> bool:
    """``func`` writes its first argument (``add_``, ``copy_``): the one
    definition of "in-place" that rules and dispatch share (dispatch reads it
    once per overload, into its op record)."""
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


# Users' rules --------------------------------------------------------------------
# The registry holds only what users registered; lookups of built-in rules and
# what dispatch caches live elsewhere. Dispatch subscribes to registrations
# (``on_register``) so that a rule registered after its op ran is not shadowed
# by a cached answer.
_by_overload: dict = {}
_by_packet: dict = {}
_listeners: list[Callable[[frozenset], None]] = []


def register_rule(*ops):
    """Decorator: ``rule(call: OpCall) -> Sharding | None`` for these ops.

    ``ops`` may be overloads (``aten.add.Tensor``) or packets (``aten.add``,
    every overload). Returning ``None`` falls back to replication. A rule may
    read the *type* of a float or complex argument but not its value: cached
    results are shared across values (``x * 0.5`` and ``x * 0.25``). A rule
    registered for an op that already ran replaces what was cached for it.

    Example:
        >>> @register_rule(torch.ops.mylib.scale.default)
        ... def scale_rule(call):
        ...     (spec,) = call.specs
        ...     return Sharding(inputs=(None,), outputs=(spec.placements,))
    """

    def wrap(rule):
        for op in ops:
            if isinstance(op, torch._ops.OpOverloadPacket):
                _by_packet[op] = rule
            elif isinstance(op, torch._ops.OpOverload):
                _by_overload[op] = rule
            else:
                raise UnsupportedOpError(
                    f"register_rule: expected an op overload (torch.ops.aten.add.Tensor) "
                    f"or packet (torch.ops.aten.add), got {op!r}"
                )
        changed = frozenset(o for op in ops for o in overloads_of(op))
        for listener in _listeners:
            listener(changed)
        return rule

    return wrap


def registered_rule(func):
    """The user's rule for overload ``func`` (its own, else its packet's), or None."""
    rule = _by_overload.get(func)
    if rule is None:
        rule = _by_packet.get(func.overloadpacket)
    return rule


def on_register(listener: Callable[[frozenset], None]) -> None:
    """Call ``listener(overloads)`` whenever rules for ``overloads`` are registered."""
    _listeners.append(listener)


def overloads_of(op) -> tuple:
    """The overloads an op names: itself, or every overload of a packet."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        return tuple(getattr(op, name) for name in op.overloads())
    return (op,)
