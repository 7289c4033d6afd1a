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

Elements may live on different meshes (a model whose parameters sit on a
tensor-parallel mesh and a data-parallel one): ``per_mesh`` runs the call
once per mesh, on that mesh's elements, and puts the results back in order.
Each element's members and the shared tensors must still share its mesh.
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

__all__ = ["RULES", "foreach_rule", "per_mesh"]

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


def per_mesh(func, args: tuple, kwargs: dict, mesh_of):
    """``func(*args, **kwargs)`` for a foreach op whose elements live on
    several meshes: one call per mesh on its elements, results in order
    (an empty list for an op that returns nothing).

    ``mesh_of(x)``: the mesh of a DTensor, None for anything else. None where
    ``func`` is no foreach op, or an element's members (or a shared tensor
    and an element) live on different meshes: the caller's error stands.

    Example (``a`` on one mesh, ``b`` on another):
        >>> na, nb = per_mesh(aten._foreach_norm.Scalar, ([a, b], 2), {}, mesh_of)
    """
    name = func.overloadpacket.__name__
    if not name.startswith(("_foreach_", "_fused_")):
        return None
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args, strict=False)) | kwargs
    per_elem = [n for n in names if n in bound and _elementwise(func, n, bound[n])]
    if not per_elem:
        return None
    n = len(bound[per_elem[0]])
    per_elem = [k for k in per_elem if len(bound[k]) == n]  # empty optional lists pass
    groups: dict = {}
    for i in range(n):
        meshes = {mesh_of(bound[k][i]) for k in per_elem} - {None}
        if len(meshes) > 1:
            return None
        groups.setdefault(next(iter(meshes), None), []).append(i)
    # A DTensor met by every element (a clip coefficient) lives on one mesh:
    # the elements of the others cannot meet it.
    if len(groups) < 2 or any(mesh_of(v) is not None for k, v in bound.items()
                              if k not in per_elem):
        return None
    out: list = [None] * n
    returns = bool(func._schema.returns)
    for idx in groups.values():
        sub = dict(bound)
        for k in per_elem:
            seq = bound[k]
            sub[k] = seq[idx] if isinstance(seq, torch.Tensor) else [seq[i] for i in idx]
        pos = [sub.pop(k) for k in names[:len(args)]]
        res = func(*pos, **sub)
        if returns:
            for i, r in zip(idx, res, strict=True):
                out[i] = r
    return out if returns else []


def _elementwise(func, name: str, value) -> bool:
    """Whether argument ``name`` holds one value per element: a list of
    tensors or scalars, or the 1-D ``scalars`` tensor of ``_foreach_addcdiv``."""
    if name == "scalars" and isinstance(value, torch.Tensor):
        return value.dim() == 1
    kinds = _layouts.get(func)
    if kinds is None:
        kinds = _layouts[func] = _layout(func)
    return kinds.get(name) == "list" or (
        isinstance(value, (list, tuple)) and any(isinstance(v, (int, float, complex))
                                                 for v in value))
