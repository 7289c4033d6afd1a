"""Bytes each redistribute plan moves: dtensor vs torch.distributed.tensor vs a lower bound.

Every source -> target pair of placements over {R, S(0), S(1), P(sum)} on a
2x2 and a 2x2x2 mesh, for an even and an uneven 2-D float32 tensor, is run on
a fake process group (one process, rank 0; collectives return at once, so
nothing but the plan is measured) with both runtimes under the same
``CommBytes`` dispatch mode (``bench/_comm_bytes.py``). Bytes are per rank,
ring model ("wire"; see ``_comm_bytes``).

The lower bound is the cheapest plan made of per-axis collectives, found by
a shortest-path search over placement states: P->R all-reduce, P->S
reduce-scatter, S->R all-gather, S(i)->S(j) all-to-all, R->S and R->P free;
a step may only touch the innermost axis sharding a tensor dim (so nested
shards stay in order). Block sizes are rank 0's (the largest, i.e. what a
padded collective moves on uneven shapes). ``bound_gloo`` is the same
search without all-to-all, which Gloo lacks.

``ours!=pred`` counts pairs where our measured bytes differ from what our
planner's cost model (``dtensor._plan_cost.plan_cost``) predicts for the
plan it chose: the model the planner compares orderings with must be the
bytes the executor really moves.

    python bench/redistribute_bytes.py            # summary + offending pairs
    python bench/redistribute_bytes.py --all      # every pair
    python bench/redistribute_bytes.py --markdown # tables for docs/train_step.md
    python bench/redistribute_bytes.py --mesh 2x2 # one mesh only
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import logging
import math
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _comm_bytes import CommBytes, wire_bytes

MESHES = [(2, 2), (2, 2, 2)]
SHAPES = {"even 8x8": (8, 8), "uneven 7x5": (7, 5)}
ITEM = 4  # float32
KINDS = ("R", "S0", "S1", "P")


# Lower bound ----------------------------------------------------------------
def _block(shape, mesh_shape, state) -> list[int]:
    """Rank 0's block: shard axes applied outer to inner, ceil pieces."""
    block = list(shape)
    for axis, p in enumerate(state):
        if p.startswith("S"):
            d = int(p[1])
            block[d] = -(-block[d] // mesh_shape[axis])
    return block


def _innermost(state, axis, dim) -> bool:
    return all(p != f"S{dim}" for p in state[axis + 1:])


def _moves(state, mesh_shape, shape, all_to_all: bool):
    """(next state, wire bytes) for every single-axis step from ``state``."""
    for axis, p in enumerate(state):
        n = mesh_shape[axis]
        here = math.prod(_block(shape, mesh_shape, state)) * ITEM
        for q in KINDS:
            if q == p:
                continue
            nxt = (*state[:axis], q, *state[axis + 1:])
            if q.startswith("S") and not _innermost(state, axis, int(q[1])):
                continue
            if p.startswith("S") and not _innermost(state, axis, int(p[1])):
                continue
            if p == "P":
                if q == "R":
                    cost = wire_bytes("all_reduce", here, n)
                elif q.startswith("S"):
                    cost = wire_bytes("reduce_scatter", here, n)
                else:
                    continue
            elif p == "R":
                cost = 0.0  # R->S slices, R->P keeps or zeroes
            else:  # p is a shard
                if q == "R":
                    cost = wire_bytes("all_gather", here * n, n)
                elif q.startswith("S") and all_to_all:
                    cost = wire_bytes("all_to_all", here, n)
                else:
                    continue  # S->P goes through R; S->S without all-to-all too
            yield nxt, cost


def lower_bound(src, dst, mesh_shape, shape, all_to_all: bool = True) -> float:
    """Cheapest per-axis-collective plan from ``src`` to ``dst`` (Dijkstra)."""
    best = {src: 0.0}
    heap = [(0.0, src)]
    while heap:
        cost, state = heapq.heappop(heap)
        if state == dst:
            return cost
        if cost > best.get(state, math.inf):
            continue
        for nxt, step in _moves(state, mesh_shape, shape, all_to_all):
            c = cost + step
            if c < best.get(nxt, math.inf) - 1e-9:
                best[nxt] = c
                heapq.heappush(heap, (c, nxt))
    return math.inf


# Measurement ----------------------------------------------------------------
def _placements(lib, state):
    out = []
    for p in state:
        if p == "R":
            out.append(lib.Replicate())
        elif p == "P":
            out.append(lib.Partial())
        else:
            out.append(lib.Shard(int(p[1])))
    return out


def measure(lib, mesh, src, dst, shape) -> float | str:
    """Wire bytes rank 0 moves for ``src -> dst`` (or the error's type name).

    The source is built with ``from_local`` from rank 0's block (torch refuses
    to redistribute *to* Partial, so a Partial source cannot come from a
    redistribute there).
    """
    from dtensor.spec import local_block

    mesh_shape = tuple(mesh.shape) if hasattr(mesh, "shape") else tuple(mesh.mesh.shape)
    block, _ = local_block(shape, mesh_shape, _placements(dtensor_lib(), src), (0,) * len(src))
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    try:
        x = lib.DTensor.from_local(torch.ones(block), mesh, _placements(lib, src),
                                   run_check=False, shape=torch.Size(shape), stride=stride)
        with CommBytes() as cb:
            x.redistribute(mesh, _placements(lib, dst))
    except Exception as e:
        return type(e).__name__
    return cb.wire


def dtensor_lib():
    import dtensor

    return dtensor


def predicted(src, dst, mesh_shape, shape) -> float:
    """Wire bytes our cost model predicts for the plan our planner picks."""
    from dtensor._plan_cost import plan_cost
    from dtensor.redistribute import plan

    lib = dtensor_lib()
    steps = plan(_placements(lib, src), _placements(lib, dst), mesh_shape, shape)
    return plan_cost(steps, mesh_shape, shape) * ITEM


def run(show_all: bool, markdown: bool, meshes=MESHES) -> int:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch.distributed.tensor as tdt
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import dtensor

    world = max(math.prod(m) for m in meshes)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    summary = []
    offenders = []
    errors: dict[str, int] = {}
    for mesh_shape in meshes:
        ranks = torch.arange(math.prod(mesh_shape)).reshape(mesh_shape)
        meshes = {"ours": dtensor.DeviceMesh("cpu", ranks), "torch": tdt.DeviceMesh("cpu", ranks)}
        libs = {"ours": dtensor, "torch": tdt}
        states = list(itertools.product(KINDS, repeat=len(mesh_shape)))
        for shape_name, shape in SHAPES.items():
            row = {"mesh": "x".join(map(str, mesh_shape)), "shape": shape_name,
                   "pairs": 0, "ours>torch": 0, "ours<torch": 0, "ours>bound": 0,
                   "torch>bound": 0, "ours!=pred": 0, "ours_err": 0, "torch_err": 0,
                   "ours_sum": 0.0, "torch_sum": 0.0, "bound_sum": 0.0}
            for src, dst in itertools.product(states, states):
                got = {k: measure(libs[k], meshes[k], src, dst, shape) for k in libs}
                bound = lower_bound(src, dst, mesh_shape, shape)
                bound_g = lower_bound(src, dst, mesh_shape, shape, all_to_all=False)
                row["pairs"] += 1
                o, t = got["ours"], got["torch"]
                if isinstance(o, str):
                    row["ours_err"] += 1
                    errors[f"ours {o}"] = errors.get(f"ours {o}", 0) + 1
                if isinstance(t, str):
                    row["torch_err"] += 1
                    kind = "dst P" if "P" in dst else "other"
                    errors[f"torch {t} ({kind})"] = errors.get(f"torch {t} ({kind})", 0) + 1
                flags = []
                if not isinstance(o, str):
                    if abs(o - predicted(src, dst, mesh_shape, shape)) > 1e-6:
                        row["ours!=pred"] += 1
                        flags.append("ours!=pred")
                    if o > bound_g + 1e-6:
                        row["ours>bound"] += 1
                        flags.append("ours>bound")
                if not isinstance(t, str):
                    if t > bound_g + 1e-6:
                        row["torch>bound"] += 1
                        flags.append("torch>bound")
                if not isinstance(o, str) and not isinstance(t, str):
                    row["bound_sum"] += bound_g
                    row["ours_sum"] += o
                    row["torch_sum"] += t
                    if o > t + 1e-6:
                        row["ours>torch"] += 1
                        flags.append("OURS>TORCH")
                    elif o < t - 1e-6:
                        row["ours<torch"] += 1
                        flags.append("ours<torch")
                line = (row["mesh"], shape_name, "".join(f"{p:>3}" for p in src),
                        "".join(f"{p:>3}" for p in dst), o, t, bound_g, bound, flags)
                if show_all or {"OURS>TORCH", "ours>bound", "ours!=pred"} & set(flags):
                    offenders.append(line)
            summary.append(row)
    _print(summary, offenders, markdown)
    print()
    print("errors (all meshes and shapes):", errors or "none")
    dist.destroy_process_group()
    return 0


def _fmt(x) -> str:
    return x if isinstance(x, str) else f"{x:.0f}"


def _print(summary, offenders, markdown: bool) -> None:
    cols = ["mesh", "shape", "pairs", "ours>torch", "ours<torch", "ours>bound",
            "torch>bound", "ours!=pred", "ours_err", "torch_err"]
    print("| " + " | ".join(cols) + " | wire bytes ours / torch / bound (sum over pairs both ran) |")
    print("|" + "---|" * (len(cols) + 1))
    for r in summary:
        print("| " + " | ".join(str(r[c]) for c in cols)
              + f" | {r['ours_sum']:.0f} / {r['torch_sum']:.0f} / {r['bound_sum']:.0f} |")
    print()
    if offenders:
        print("| mesh | shape | src | dst | ours | torch | bound (gloo) | bound (a2a) | flags |")
        print("|---|---|---|---|---:|---:|---:|---:|---|")
        for m, s, src, dst, o, t, bg, b, flags in offenders:
            print(f"| {m} | {s} | `{src.strip()}` | `{dst.strip()}` | {_fmt(o)} | {_fmt(t)} "
                  f"| {bg:.0f} | {b:.0f} | {' '.join(flags)} |")
    else:
        print("no pair where ours moves more than torch or than the bound")
    del markdown


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="print every pair")
    ap.add_argument("--markdown", action="store_true", help="markdown tables (default too)")
    ap.add_argument("--mesh", action="append", metavar="AxB[xC]",
                    help="only this mesh shape (repeatable); default 2x2 and 2x2x2")
    args = ap.parse_args()
    meshes = [tuple(int(k) for k in m.split("x")) for m in args.mesh] if args.mesh else MESHES
    return run(args.all, args.markdown, meshes)


if __name__ == "__main__":
    sys.exit(main())
