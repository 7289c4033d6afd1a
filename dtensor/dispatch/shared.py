"""Plans shared by the ranks of a simulated world: one propagation per op, not per rank.

A call key holds its operands' specs, and a spec's mesh carries its rank
(``dtensor.mesh``), so each of the n rank threads of a simulated world
(``launch/sim/``) misses the call table once per new call and would
propagate it: ask the rule, infer the outputs' metadata, check a user
rule's outputs at every coordinate. None of that reads the rank: rules are
pure functions of global specs and arguments (``dtensor.sharding``), the
metadata is global, the guard checks every coordinate alike, and a rule's
``local`` function is handed the rank's coordinate and output specs when it
runs (``execute.run``, ``form.Fast``), never at planning time.

So ``SHARED`` (``dtensor.dispatch.cache``) keeps one plan per *shared key*:
the call key with each spec in rank-free form (its mesh as device type,
layout, axis names and world: everything ``DeviceMesh.__eq__`` compares but
the rank). A rank that misses the call table but finds its shared key takes
that plan with every spec re-bound to its own mesh; its fast form is still
its own (``form.fast_form`` reads the rank's operands and mesh).

Only plans whose specs all sit on the mesh of the call that made them are
kept (re-binding maps that one mesh). A process that hosts one rank (a real
world) never finds a shared key its call table lacks, so it keeps none.
"""

from __future__ import annotations

from dtensor._rank_state import is_sim_rank
from dtensor.dispatch.cache import CACHE_LIMIT, SHARED
from dtensor.dispatch.propagate import Plan
from dtensor.spec import DTensorSpec

__all__ = ["share", "shared_key", "shared_plan"]

_SPEC = object()  # key marker: a spec in rank-free form follows


def shared_key(key: tuple) -> tuple | None:
    """``key`` (a call key) with every spec in rank-free form; None in a
    process of one rank, where nothing is shared."""
    if not is_sim_rank():
        return None
    return _rank_free(key)


def _rank_free(k):
    t = type(k)
    if t is DTensorSpec:
        m = k.mesh
        # The layout object stands for ranks and shape: one per layout in the
        # process (dtensor._mesh_layout); an evicted one only shares less.
        return (_SPEC, m.device_type, m._layout, m.mesh_dim_names, m._world,
                k.placements, k.tensor_meta)
    if t is tuple:
        return tuple([_rank_free(x) for x in k])
    return k


def shared_plan(skey: tuple, mesh) -> Plan | None:
    """The plan another rank made for ``skey``, re-bound to ``mesh`` (this
    call's), or None."""
    hit = SHARED.get(skey)
    if hit is None:
        return None
    src, plan = hit
    # NOTE: a new Plan even for the same mesh: the kept one carries its
    # maker's fast form, which the caller builds anew.
    targets, out_specs, computed = plan.targets, plan.out_specs, plan.computed
    if mesh is not src:
        targets = tuple(None if t is None else DTensorSpec(mesh, t.placements, t.tensor_meta)
                        for t in targets)
        out_specs = tuple(DTensorSpec(mesh, s.placements, s.tensor_meta) for s in out_specs)
        if computed is not None:
            computed = tuple(DTensorSpec(mesh, s.placements, s.tensor_meta) for s in computed)
    return Plan(targets, out_specs, plan.fallback, plan.scalar_reduce, plan.local,
                plan.write_back, computed=computed)


def share(skey: tuple, plan: Plan, mesh) -> None:
    """Keep ``plan``, just made for a call on ``mesh``, for the other ranks."""
    if mesh is None:
        return
    for s in (*plan.targets, *plan.out_specs, *(plan.computed or ())):
        if s is not None and s.mesh is not mesh and s.mesh != mesh:
            return  # a spec on another mesh: re-binding to one mesh would move it
    if len(SHARED) >= CACHE_LIMIT:
        SHARED.clear()
    SHARED[skey] = (mesh, plan)
