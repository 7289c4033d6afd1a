"""Sharding rules, one module per op family; merged here explicitly.

Each family module exports ``RULES``: a dict from op overload or packet to a
pure rule ``rule(call: OpCall) -> Sharding | None``. Ops tagged
``torch.Tag.pointwise`` without an explicit entry use the pointwise rule.
Users' rules (``dtensor.register_rule``) take precedence over these tables.
"""

from __future__ import annotations

import torch

from dtensor.rules import (
    batch_norm,
    batched,
    bucketize,
    extremes,
    foreach,
    join,
    linalg,
    matmul,
    nn,
    norms,
    pointwise,
    reduction,
    scatter,
    spatial,
    tensor_ops,
    view,
)
from dtensor.sharding import registered_rule

__all__ = ["RULES", "rule_for", "rule_for_tags"]

RULES: dict = {}
_FAMILIES = (pointwise, tensor_ops, reduction, extremes, matmul, view, join, nn, norms,
             foreach, batched, spatial, scatter, batch_norm, bucketize,
             linalg)
for _family in _FAMILIES:
    RULES.update(_family.RULES)


def rule_for_tags(func):
    """The built-in rule for ``func``: from the merged table, or from its tags."""
    rule = RULES.get(func) or RULES.get(func.overloadpacket)
    if rule is None and torch.Tag.pointwise in func.tags:
        rule = pointwise.pointwise_rule
    return rule


def rule_for(func):
    """The rule dispatch uses for ``func``: the user's, else the built-in one."""
    return registered_rule(func) or rule_for_tags(func)
