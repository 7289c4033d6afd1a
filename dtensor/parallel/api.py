"""``parallelize_module``: apply a plan of parallel styles to a module tree.

The whole plan is resolved and checked before any parameter moves, so a
wrong entry (a name matching no submodule, a style on a module type it cannot
shard) raises the same error on every rank before any communication; the
members compare their plans' outcomes through the store first, so a plan that
fails or differs on one rank raises a ``PlanError`` on every member too.
"""

from __future__ import annotations

import copy
import hashlib
import warnings
from fnmatch import fnmatch

import torch
from torch import nn

from dtensor import _comm, _seeding
from dtensor.mesh import DeviceMesh
from dtensor.parallel.errors import PlanError
from dtensor.parallel.style import ParallelStyle
from dtensor.tensor import DTensor, _resolve_mesh

__all__ = ["parallelize_module"]


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Parallelize ``module`` (in place) over a 1-D mesh by a plan.

    Args:
        module: the module to parallelize.
        device_mesh: a 1-D mesh (slice an N-D one: ``mesh["tp"]``); default the
            current mesh.
        parallelize_plan: a ``ParallelStyle`` for ``module`` itself, or a dict
            from submodule paths to styles. Path components may be
            ``fnmatch`` patterns (``"layers.*.attention.wq"``); ``""`` is the
            module itself.
        src_data_rank: where parameter values come from (mesh index 0: the
            single-device values; ``None``: every rank's own).

    Raises:
        PlanError: a path matches no submodule, the mesh is not 1-D, or the
            plan is malformed. ``UnsupportedModuleError``: a style on a module
            type it cannot shard. Both before any communication.

    Example:
        >>> parallelize_module(model, mesh["tp"], {
        ...     "layers.*.mlp.w1": ColwiseParallel(),
        ...     "layers.*.mlp.w2": RowwiseParallel(),
        ... })
    """
    mesh = _resolve_mesh(device_mesh, "parallelize_module")
    if mesh.ndim != 1:
        raise PlanError(
            f"parallelize_module: expected a 1-D mesh, got {mesh}. Pass the "
            "tensor-parallel axis, e.g. mesh['tp'], and handle the other axes "
            "(data parallel) separately."
        )
    if parallelize_plan is None:
        warnings.warn(
            "parallelize_module: no parallelize_plan given; the module is unchanged",
            stacklevel=2,
        )
        return module
    try:
        targets = _resolve(module, parallelize_plan)
        for fqn, sub, style in targets:
            style._check(sub, fqn)
    except Exception as e:
        _agree_on_plan(mesh, f"error: {type(e).__name__}: {e}")
        raise
    _agree_on_plan(mesh, "plan: " + hashlib.sha1(
        repr([(fqn, type(sub).__name__, _describe(style)) for fqn, sub, style in targets])
        .encode()).hexdigest()[:16])
    sources = _receive_sources([sub for _, sub, _ in targets], mesh, src_data_rank)
    for _fqn, sub, style in targets:
        # A copy, so a style object shared by several entries or plans keeps its own
        # src_data_rank (torch sets it on the caller's object).
        style = copy.copy(style)
        style.src_data_rank = src_data_rank
        style._sources = sources
        style._apply(sub, mesh)
    return module


def _describe(style: ParallelStyle) -> str:
    """What a style does, equal on every rank given the same plan (a style
    without a ``__repr__`` of its own: its class; its address differs)."""
    r = repr(style)
    return f"{type(style).__module__}.{type(style).__qualname__}" if " at 0x" in r else r


def _agree_on_plan(mesh: DeviceMesh, outcome: str) -> None:
    """The members' plan outcomes must match before any parameter moves.

    Compared through the store, not a collective: a rank whose plan raised
    (or differs) would otherwise leave the others in the parameters'
    broadcast, which then fails with a transport error instead of the plan
    error. Every member raises the same ``PlanError``, naming the ranks.
    """
    try:
        got = _seeding.exchange_among(mesh, "plan", outcome)
    except TimeoutError as e:
        raise PlanError(f"parallelize_module on {mesh}: not every member of the mesh "
                        f"called it ({e}); call it on every rank of the mesh") from None
    if got is None or len(set(got)) == 1:
        return
    ranks = mesh.ranks
    errors = [(r, v) for r, v in zip(ranks, got, strict=True) if v.startswith("error: ")]
    if errors:
        r, v = errors[0]
        raise PlanError(f"parallelize_module on {mesh}: the plan failed on rank(s) "
                        f"{[r for r, _ in errors]}; rank {r}: {v.removeprefix('error: ')}")
    groups: dict[str, list[int]] = {}
    for r, v in zip(ranks, got, strict=True):
        groups.setdefault(v, []).append(r)
    raise PlanError(f"parallelize_module on {mesh}: the ranks were given different plans "
                    f"(ranks grouped by plan: {sorted(groups.values())}); give every rank "
                    "the same plan for the same module")


def _receive_sources(subs: list[nn.Module], mesh: DeviceMesh, src_data_rank) -> dict | None:
    """The source rank's values of the plan's plain parameters: one broadcast
    per dtype for the whole plan instead of one per parameter (each a
    synchronous round trip; measured: most of the setup time).

    Returns id(param) -> its received values, or None where nothing is sent
    (``src_data_rank=None``, a one-rank mesh, ranks outside the mesh).
    """
    if src_data_rank is None or mesh.size() == 1 or mesh.get_coordinate() is None:
        return None
    params, seen = [], set()
    for sub in subs:
        for p in sub.parameters(recurse=False):
            if not isinstance(p, DTensor) and not p.is_meta and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    by_kind: dict = {}
    for p in params:
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    group = mesh.axis_group(0)
    out = {}
    for group_params in by_kind.values():
        flat = torch.cat([p.detach().reshape(-1) for p in group_params])
        flat = _comm.broadcast(flat, src_data_rank, group)
        for p, piece in zip(group_params, flat.split([p.numel() for p in group_params]),
                            strict=True):
            out[id(p)] = piece.view(p.shape)
    return out


def _resolve(module: nn.Module, plan) -> list[tuple[str, nn.Module, ParallelStyle]]:
    """Every (path, submodule, style) the plan names, in plan order."""
    if isinstance(plan, ParallelStyle):
        return [("", module, plan)]
    if not isinstance(plan, dict):
        raise PlanError(
            "parallelize_module: expected a ParallelStyle or a dict of module paths "
            f"to ParallelStyles as parallelize_plan, got {type(plan).__name__}"
        )
    out = []
    for path, style in plan.items():
        if not isinstance(path, str) or not isinstance(style, ParallelStyle):
            raise PlanError(
                "parallelize_module: each plan entry must map a module path (str) to a "
                f"ParallelStyle, got {path!r}: {style!r}"
            )
        out += [(fqn, sub, style) for fqn, sub in _match(module, path)]
    return out


def _match(module: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    if path == "":
        return [("", module)]
    found = [("", module)]
    for depth, token in enumerate(path.split(".")):
        nxt = []
        for prefix, mod in found:
            nxt += [(f"{prefix}.{name}" if prefix else name, child)
                    for name, child in mod.named_children() if fnmatch(name, token)]
        if not nxt:
            seen = sorted({name for _, mod in found for name, _ in mod.named_children()})
            where = ".".join(path.split(".")[:depth]) or "the root module"
            raise PlanError(
                f"parallelize_module: plan key {path!r} matches no submodule: no child "
                f"of {where!r} matches {token!r} (children: {seen or 'none'}). Fix the "
                "key; print(model) shows the module names."
            )
        found = nxt
    return found
