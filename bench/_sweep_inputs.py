"""The inputs of the OpInfo sweep (``bench/opinfo_sweep.py``) and the
communication audit (``bench/comm_audit.py``): which ops and samples run,
the layouts each sample's tensors take (alike, mixed, pieces of a
``Partial``), and whether an op is random.
"""

from __future__ import annotations


def _name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _select(op_db, names):
    ops = sorted(op_db, key=_name)
    if names:
        wanted = set(names.split(","))
        ops = [o for o in ops if o.name in wanted or _name(o) in wanted]
    return ops


def _samples(op, limit: int, torch):
    if torch.float32 not in op.supported_dtypes("cpu"):
        return []
    out = []
    for s in op.sample_inputs("cpu", torch.float32, requires_grad=False):
        out.append(s)
        if len(out) >= limit:
            break
    return out


def _layout_name(d) -> str:
    if isinstance(d, tuple):
        return "(" + ", ".join(_layout_name(x) for x in d) + ")"
    if isinstance(d, str):
        return f"P({d})"
    return "R" if d is None else f"S({d})"


PARTIAL_KINDS = ("sum", "avg", "max", "min")


def _audit_layouts(leaves, limit: int) -> list:
    """The layouts ``--audit`` runs: all inputs alike (R, S(d) for each dim), each
    input its own layout (as ``--mixed``), and every input a piece of
    ``Partial(kind)`` for each reduce kind; with two or more inputs also the
    first one partial and the others replicated."""
    dims = max(t.ndim for t in leaves)
    out: list = [None, *range(dims)]
    if len(leaves) > 1:
        out += _mixed_layouts(leaves, limit)
        out += [(k, *[None] * (len(leaves) - 1)) for k in PARTIAL_KINDS]
    return out + list(PARTIAL_KINDS)


def _partial_input(t, kind: str, rank: int, impl: str):
    """``t`` as 2 ranks' pieces of ``Partial(kind)`` (inexact pieces only where
    the kind needs them: sum and avg split ``t`` around a fixed offset)."""
    import torch
    from torch.distributed import tensor as theirs

    import dtensor as ours

    lib = ours if impl == "ours" else theirs
    mesh = lib.DeviceMesh("cpu", [0, 1])
    t = t.detach().clone()
    if t.is_floating_point() or t.is_complex():
        off = torch.full_like(t, 0.5)
    else:
        off = torch.ones_like(t)
    piece = {
        "sum": (t - off, off),
        "avg": (t - off, t + off),
        "max": (t, t - off),
        "min": (t, t + off),
    }[kind][rank] if t.dtype != torch.bool else t
    return lib.DTensor.from_local(piece, mesh, [lib.Partial(kind)], run_check=False)


def _mixed_layouts(leaves, limit: int) -> list[tuple]:
    """Each tensor leaf its own placement, R or S(d) for its dims: every
    combination, or ``limit`` of them spread evenly (the first and the last
    included), so an index sharded apart from its source is tried."""
    import itertools

    combos = list(itertools.product(*[[None, *range(t.ndim)] for t in leaves]))
    combos = [c for c in combos if len(set(c)) > 1]  # alike layouts: the plain sweep
    if len(combos) > limit:
        step = (len(combos) - 1) / (limit - 1)
        combos = [combos[round(i * step)] for i in range(limit)]
    return combos


def _convert(sample, convert):
    """The sample's (input, args, kwargs) with every tensor passed through ``convert``."""
    import torch
    from torch.utils._pytree import tree_map

    def m(x):
        return convert(x) if isinstance(x, torch.Tensor) else x

    return tree_map(m, sample.input), tree_map(m, sample.args), tree_map(m, sample.kwargs)


def _call(op, sample, convert):
    inp, args, kwargs = _convert(sample, convert)
    return op.op(inp, *args, **kwargs)


def _is_random(op, sample, torch) -> bool:
    from torch.utils._python_dispatch import TorchDispatchMode

    seeded = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if torch.Tag.nondeterministic_seeded in func.tags:
                seeded.append(func)
            return func(*args, **(kwargs or {}))

    try:
        with Watch():
            _call(op, sample, lambda t: t.clone())
    except Exception:
        pass
    if seeded:
        return True
    results = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        try:
            results.append(_call(op, sample, lambda t: t.clone()))
        except Exception:
            return False
    from torch.utils._pytree import tree_flatten

    a, b = tree_flatten(results[0])[0], tree_flatten(results[1])[0]
    for x, y in zip(a, b, strict=False):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or not torch.equal(
                torch.nan_to_num(x.float() if not x.is_complex() else x, nan=0.0),
                torch.nan_to_num(y.float() if not y.is_complex() else y, nan=0.0),
            ):
                return True
    return False
