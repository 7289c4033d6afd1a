"""Pointwise ``_foreach_*`` ops (what ``torch.optim`` and ``clip_grad_*`` call)
and the fused optimizer kernels (``fused=True``): one rule for the whole
list, decided element by element.

Element ``i`` of a foreach call is the ``i``-th member of every ``Tensor[]``
argument, plus the arguments shared by all elements (a ``Tensor`` such as
the clip coefficient of ``_foreach_mul_.Tensor``, scalars). Where an
element's members share one layout and shape (parameters, gradients and
optimizer states always do), the op runs on the local pieces as they are and
each result keeps that layout: a whole optimizer update never communicates.
Otherwise the element's members are brought to its first member's layout,
with partial values reduced (scaling by a scalar is linear and keeps them),
and members whose shapes differ (broadcasting) are replicated. A shared
tensor must be replicated (it meets every element).

``_foreach_norm`` and ``_foreach_max`` reduce: see ``norms.py``
(``_foreach_max`` has no rule and takes the replicate fallback).
"""

from __future__ import annotations

import torch

from dtensor.placement import (
    Partial,
    Replicate,
    is_linear_partial,
    partial_to_replicate,
)
from dtensor.sharding import Sharding

__all__ = ["RULES", "foreach_rule"]

aten = torch.ops.aten

# Scaling every element by a scalar (or a replicated 0-d tensor) is linear, so
# partial sums may stay partial.
_SCALING_PACKETS = {"_foreach_mul", "_foreach_mul_", "_foreach_div", "_foreach_div_",
                    "_foreach_neg", "_foreach_neg_"}


def _operand(x) -> bool:
    """An operand in the key form of the arguments (a spec, or a plain key)."""
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, torch.Tensor)


def _layout(func):
    """Per argument: 'list' (Tensor[]), 'one' (Tensor) or None, by schema."""
    kinds = {}
    for a in func._schema.arguments:
        t = a.type
        if isinstance(t, torch.OptionalType):
            t = t.getElementType()
        if isinstance(t, torch.ListType) and isinstance(t.getElementType(), torch.TensorType):
            kinds[a.name] = "list"
        elif isinstance(t, torch.TensorType):
            kinds[a.name] = "one"
    return kinds


_layouts: dict = {}


def _columns(call):
    """(lists, shared): operand indices per ``Tensor[]`` argument (one tuple per
    list, in argument order) and the indices of shared ``Tensor`` operands.

    Operands are numbered as dispatch flattens them: positional arguments,
    then keyword arguments, lists member by member.
    """
    func = call.func
    kinds = _layouts.get(func)
    if kinds is None:
        kinds = _layouts[func] = _layout(func)
    names = [a.name for a in func._schema.arguments]
    items = [(names[i] if i < len(names) else None, v) for i, v in enumerate(call.args)]
    items += list(call.kwargs.items())
    lists, shared = [], []
    k = 0
    for name, v in items:
        kind = kinds.get(name)
        if isinstance(v, tuple):
            idx = []
            for x in v:
                if _operand(x):
                    idx.append(k)
                    k += 1
            if kind == "list":
                lists.append(tuple(idx))
            else:
                shared.extend(idx)
        elif _operand(v):
            shared.append(k)
            k += 1
    return lists, shared


def foreach_rule(call):
    specs = call.specs
    lists, shared = _columns(call)
    lists = [col for col in lists if col]  # optional lists (max_exp_avg_sqs) may be empty
    if not lists or any(len(col) != len(lists[0]) for col in lists):
        return None
    # Only a scalar or a shared (replicated) tensor scales: a second list's
    # members would be moved to the Partial too, and pieces times pieces is
    # not the product.
    scaling = call.func.overloadpacket.__name__ in _SCALING_PACKETS and len(lists) == 1
    want: list = [None] * len(specs)
    outs, shapes = [], []
    for i in range(len(lists[0])):
        members = [col[i] for col in lists]
        first = specs[members[0]]
        # 0-d members (a fused optimizer's step counts) meet the element
        # like a scalar: replicated, and they never decide the layout.
        scalars = [j for j in members if not specs[j].shape and first.shape]
        members = [j for j in members if j not in scalars]
        shared_i = shared + scalars
        same = all(specs[j].shape == first.shape for j in members)
        if same:
            target = first.placements
            if any(isinstance(p, Partial) for p in target) and not (
                scaling and all(is_linear_partial(p) or not isinstance(p, Partial)
                                for p in target)
            ):
                target = partial_to_replicate(target)
        else:
            target = (Replicate(),) * first.mesh.ndim
        for j in members:
            want[j] = target
        for j in shared_i:  # NOTE: replicated, so a partial element times it stays partial
            want[j] = (Replicate(),) * specs[j].mesh.ndim
        outs.append(target)
        shapes.append(first.shape)
    n = len(call.func._schema.returns)
    if n == 0:  # in place: results are the first list's members
        return Sharding(tuple(want), ())
    return Sharding(tuple(want), tuple(outs), shapes=tuple(shapes))


# The pointwise foreach ops that torch.optim (SGD, Adam, AdamW: foreach and
# capturable paths, amsgrad, weight decay, momentum) and clip_grad_norm_ /
# clip_grad_value_ call, each run by a distributed test against single device
# (tests/test_optim_dist.py; tests/test_rules.py checks it). Other _foreach_*
# ops keep the replicate fallback (correct; it gathers) until they get a test.
_OPTIM_PACKETS = (
    "_foreach_add_", "_foreach_addcdiv_", "_foreach_addcmul_", "_foreach_clamp_max_",
    "_foreach_clamp_min_", "_foreach_div_", "_foreach_lerp_", "_foreach_maximum_",
    "_foreach_mul_", "_foreach_sqrt",
)


def _pointwise_foreach_packets():
    return [getattr(aten, name) for name in _OPTIM_PACKETS]


# Fused optimizer kernels are elementwise over the same columns (params,
# grads, states; step counts and lr as scalars).
_FUSED = [aten._fused_adam_, aten._fused_adamw_, aten._fused_sgd_]

RULES: dict = dict.fromkeys([*_pointwise_foreach_packets(), *_FUSED], foreach_rule)
