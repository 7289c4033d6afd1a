"""The guard on users' rules: every rank's output block has the claimed shape.

Dispatch wraps a rank's local result in the spec its rule claims. A wrong
user rule (``Shard(0)`` claimed for a column sum) would give a DTensor whose
blocks do not fit its spec: ``full_tensor()`` returns a tensor of another
shape, or ranks send collectives of different sizes and one dies. So, once
per new plan (the call table keeps plans, so later calls pay nothing), the
op is run on meta tensors of each distinct set of local input shapes the
mesh holds, and each output's local shape and dtype is compared with what
the claimed spec says at that coordinate. Every rank runs the same check on
the same plan over *every* coordinate, so every rank reaches the same
verdict with no communication, and raises ``RuleOutputError`` together.

Rules registered by users (``dtensor.register_rule``,
``dtensor.experimental.register_sharding``) always get it; built-in rules
get it under ``dtensor.dispatch.check_builtin_rules(True)`` (or env
``DTENSOR_CHECK_RULES=all``).

Example:
    >>> dtensor.dispatch.check_builtin_rules(True)   # every new plan checked
"""

from __future__ import annotations

import itertools
import os

import torch

from dtensor.dispatch.call import Call, tensor_leaves
from dtensor.errors import ShardingError
from dtensor.placement import format_placements

__all__ = ["RuleOutputError", "check_all", "check_outputs", "guarded", "rule_name"]

_CHECK_ALL = [os.environ.get("DTENSOR_CHECK_RULES", "") == "all"]


class RuleOutputError(ShardingError):
    """A sharding rule's claimed output layout does not fit what the op gives."""


def check_all(on: bool) -> None:
    """Set whether built-in rules are checked too (records made from now on;
    ``dtensor.dispatch.check_builtin_rules`` also drops the existing ones)."""
    _CHECK_ALL[0] = bool(on)


def guarded(user_rule: bool) -> bool:
    """Whether plans made by this op's rule are checked."""
    return user_rule or _CHECK_ALL[0]


def rule_name(rule) -> str:
    """A rule's name for messages (``register_sharding`` rules: the user's function)."""
    fn = rule
    while hasattr(fn, "func") and hasattr(fn, "args"):  # functools.partial
        fn = fn.args[0] if fn.args and callable(fn.args[0]) else fn.func
    mod = getattr(fn, "__module__", None) or "?"
    return f"{mod}.{getattr(fn, '__qualname__', repr(fn))}"


def check_outputs(call: Call, rule, in_specs, out_specs) -> None:
    """Raise ``RuleOutputError`` (on every rank) if, at any mesh coordinate, the
    op on that coordinate's input blocks gives an output block whose shape or
    dtype differs from what ``out_specs`` (the rule's claim) says.

    ``in_specs``: each operand's spec as the op will see it (after the plan's
    redistributions). Coordinates sharing input block shapes are run once.
    An op that cannot run on meta tensors is not checked.
    """
    if not out_specs:
        return
    mesh = out_specs[0].mesh
    seen = set()
    for coord in itertools.product(*(range(n) for n in mesh.shape)):
        shapes = tuple(s.local_shape(coord) for s in in_specs)
        if shapes in seen:
            continue
        seen.add(shapes)
        metas = [torch.empty(shape, dtype=s.dtype, device="meta")
                 for shape, s in zip(shapes, in_specs, strict=True)]
        margs, mkwargs = call.replace(metas)
        if mkwargs.get("device") is not None:
            mkwargs["device"] = "meta"
        try:
            leaves = tensor_leaves(call.func(*margs, **mkwargs))
        except Exception:  # no meta kernel, or index data needed: cannot tell
            return
        if len(leaves) != len(out_specs):
            return
        for j, (got, spec) in enumerate(zip(leaves, out_specs, strict=True)):
            want = spec.local_shape(coord)
            if tuple(got.shape) != tuple(want) or got.dtype != spec.dtype:
                raise RuleOutputError(_message(call, rule, in_specs, shapes, coord, j,
                                               got, spec, want))


def _message(call, rule, in_specs, shapes, coord, j, got, spec, want) -> str:
    ins = ", ".join(f"{format_placements(s.placements)} block {list(sh)}"
                    for s, sh in zip(in_specs, shapes, strict=True))
    return (
        f"{call.func}: the sharding rule {rule_name(rule)} claims output {j} is "
        f"{format_placements(spec.placements)} of global shape {list(spec.shape)} "
        f"({spec.dtype}), so mesh coordinate {coord} of {tuple(spec.mesh.shape)} "
        f"should hold a block of shape {list(want)}; but the op on that coordinate's "
        f"inputs ({ins}) gives a block of shape {list(got.shape)} ({got.dtype}). The "
        "rule is wrong for these input placements: fix its output placements (or "
        "the input placements it asks for), e.g. check it with "
        "dtensor.testing.verify_rule(op, ...)."
    )
