"""Deliberately broken runtimes: README's main job must catch each one.

``apply(name)`` monkeypatches one bug into the runtime of this process; the
property suite's conftest (``tests/properties/conftest.py``) calls it on every rank when
``DTENSOR_MUTANT=name`` is set (never otherwise). Run as a script, it runs
README's main job (``torchrun --nproc_per_node=4 -m pytest tests/properties
--hypothesis-profile=ci``) once unmutated and once per mutant (stopping at the
first failure), counts a mutant caught when a test that passes unmutated
fails, prints its minimal example and ``Replay:`` line, and ends with
"N/M planted bugs caught by the main job":

    python tools/mutants.py --lock /tmp/dtensor-suite.lock   # every mutant
    python tools/mutants.py --quick detach_returns_self       # its own file only

Mutants (docs/properties.md has the oracle that catches each):
    gather_drops_last_uneven_shard  uneven all-gather loses the last shard
    partial_to_replicate_skips_reduce  P -> R forgets the all-reduce
    random_same_offset_on_every_shard  every shard draws the numbers of the
        first block (the same random offset on every shard)
    outsider_joins_collective  a rank outside the mesh issues a collective
        when redistributing (a one-rank group here, so it is counted, not hung)
    nonlinear_op_keeps_partial  a sharding rule keeps ``abs`` of a Partial
        input partial (abs is not linear)
    max_pieces_added_elementwise  ``add``/``sub`` of two operands placed
        alike as ``Partial(max)`` (or ``min``) keep them partial (right only
        when one rank holds both extremes)
    bucketize_blocks_take_the_max  ``bucketize``/``searchsorted`` against
        boundaries cut along their sorted dim claim the blocks' counts as
        ``Partial(max)`` (they add up: ``Partial(sum)``)
    gather_zeroes_tail_of_dim2_on_4  gathering tensor dim 2 of length 5 over a
        mesh axis of 4 zeroes the last entry (rare: the ``ci`` profile misses
        it; ``python -m launch fuzz`` finds it, see docs/fuzzing.md)
    coordinate_wraps_past_127  a mesh coordinate kept in a signed byte (only a
        mesh axis of >= 129 ranks shows it: DTENSOR_WORLD_SIZES=256 --dist-sim)
    shard_range_balanced  shards split 2,1,1,1 (array_split), not torch.chunk's
        2,2,1,0; self-consistent, so every full value survives
    submesh_ignores_name_order  ``mesh["tp", "dp"]`` names its axes as asked
        but keeps the parent's rank grid
    get_local_rank_assumes_consecutive_ranks  ``get_local_rank`` computed
        from the rank as if the mesh held consecutive ranks
    detach_returns_self  ``detach()`` of a tensor without grad is the tensor
        itself, so an in-place view on one reshapes the other
    inplace_view_returns_new_tensor  ``t_()`` and friends return a reshaped
        tensor and leave ``self`` as it was
    fast_key_drops_value_kwargs  the fast-path cache keys ``keepdim=``,
        ``dtype=``, ``memory_format=`` by type alone
    propagation_cache_ignores_placements  the propagation cache keys a spec
        by mesh and metadata, not placements
    redistribute_grad_left_in_output_layout  the gradient through
        ``redistribute`` keeps the output's layout (values still right)
    to_local_ignores_grad_placements  ``to_local(grad_placements=...)`` is
        ignored
    run_check_trusts_each_rank  ``from_local(run_check=True)`` checks nothing
    random_run_start_ignores_inner_offsets  a block that is one contiguous
        run starts its stream at the offset of dim 0 alone
    random_strided_runs_start_at_column_zero  every run of a strided block
        starts at column 0 of the run dim
    random_empty_block_comes_back_flat  an empty block is returned as shape (0,)

One per input kind of the recently added code (the property that catches it):
    random_mid_row_run_drops_row_offset  a block that is one run starting
        mid-row keeps only its column offset
        (test_random.py::test_random_runs_that_start_mid_row)
    norm_order_zero_share_powered  order-0 norm pieces (counts) are raised to
        the 0th power when reduced
        (test_norms.py::test_vector_norm_of_every_order_matches_single_device)
    foreach_add_keeps_partial  ``_foreach_add_`` of a scalar keeps Partial(sum)
        members partial (test_foreach.py::test_every_foreach_case_on_every_partial_kind)
    run_check_broadcasts_first_replicate_axis_only  ``run_check`` makes
        replicas agree on the first Replicate axis only
        (test_run_check.py: accepts every layout, replicas agree on every axis)
    mixed_partials_reduce_in_any_order  every pair of reduce ops "commutes"
        (test_redistribute.py: mixed partial pieces reduce in axis order)
    plain_operand_key_drops_dtype  the call key holds a plain operand's shape,
        not its dtype (test_caches.py: plain operands of another dtype)
    permute_maps_shards_forward  permute moves shard dim d to dims[d], right
        for self-inverse permutations only (test_permute.py)
    mesh_boolean_reduces_first_axis_only  ``equal`` and friends agree over
        mesh axis 0 only (test_mesh_booleans.py::
        test_mesh_wide_booleans_see_a_block_on_a_later_axis_differ)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _gather_drops_last_uneven_shard() -> None:
    import torch

    from dtensor import _comm, redistribute
    from dtensor.spec import shard_range

    def _gather(local, step, global_shape, mesh_shape, coord, group):
        dim = step.src.dim
        n = mesh_shape[step.axis]
        _, length = redistribute._outer_range(step, global_shape, mesh_shape, coord, dim)
        piece = -(-length // n)
        if dim == 0 and piece * n == length:
            return _comm.all_gather_cat(local, group)
        lengths = [shard_range(length, n, i)[1] for i in range(n)]
        if local.shape[dim] != piece:
            pad = list(local.shape)
            pad[dim] = piece - local.shape[dim]
            local = torch.cat([local, local.new_zeros(pad)], dim=dim)
        pieces = _comm.all_gather(local, group)
        pieces = [p.narrow(dim, 0, k) for p, k in zip(pieces, lengths, strict=True)]
        if lengths[-1] != piece:  # BUG: the last, shorter shard is dropped
            pieces = pieces[:-1]
        return torch.cat(pieces, dim=dim)

    redistribute._gather = _gather


def _partial_to_replicate_skips_reduce() -> None:
    from dtensor import redistribute, tensor

    original = redistribute.execute

    def execute(local, steps, global_shape, mesh):
        # BUG: Partial -> Replicate steps are dropped (no all-reduce).
        return original(local, [s for s in steps if s.kind != "reduce"], global_shape, mesh)

    redistribute.execute = execute
    tensor.execute = execute


def _random_same_offset_on_every_shard() -> None:
    from dtensor import _random_blocks as rng

    original = rng._generate

    def _generate(seed, offset, gs, lo, ls, *args, **kwargs):
        # BUG: every block starts at global index 0.
        return original(seed, offset, gs, (0,) * len(lo), ls, *args, **kwargs)

    rng._generate = _generate


def _outsider_joins_collective() -> None:
    import torch

    from dtensor import _comm, redistribute, tensor
    from dtensor.dispatch import execute, random_ops

    original = redistribute.redistribute_local

    def redistribute_local(local, src, dst):
        if src.mesh.get_coordinate() is None and src.placements != dst.placements:
            # BUG: the outsider takes part in a collective.
            _comm.all_reduce(torch.zeros(1), "sum", _comm.group_for((_comm.get_rank(),)))
        return original(local, src, dst)

    for module in (redistribute, tensor, execute, random_ops):
        module.redistribute_local = redistribute_local


def _nonlinear_op_keeps_partial() -> None:
    import torch

    from dtensor.sharding import Sharding, register_rule

    @register_rule(torch.ops.aten.abs.default)
    def abs_rule(call):
        # BUG: abs is not linear, yet the rule keeps Partial inputs partial.
        (spec,) = call.specs
        return Sharding(inputs=(None,), outputs=(spec.placements,))


def _max_pieces_added_elementwise() -> None:
    import torch

    from dtensor.placement import Partial
    from dtensor.rules import rule_for
    from dtensor.sharding import Sharding, register_rule

    extremes = (Partial("max"), Partial("min"))
    for op in (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor):
        builtin = rule_for(op)

        def rule(call, builtin=builtin):
            specs = call.specs
            if (len(specs) == 2 and all(s is not None for s in specs)
                    and specs[0].placements == specs[1].placements
                    and all(p in extremes for p in specs[0].placements)):
                # BUG: max(a) + max(b) is max(a + b) only where one rank
                # holds both extremes
                return Sharding(inputs=(None, None), outputs=(specs[0].placements,))
            return builtin(call)

        register_rule(op)(rule)


def _bucketize_blocks_take_the_max() -> None:
    import dataclasses

    import torch

    from dtensor.placement import Partial
    from dtensor.rules import rule_for
    from dtensor.sharding import register_rule

    aten = torch.ops.aten
    for op in (aten.bucketize.Tensor, aten.bucketize.Scalar, aten.searchsorted.Tensor,
               aten.searchsorted.Scalar):
        builtin = rule_for(op)

        def rule(call, builtin=builtin):
            got = builtin(call)
            if got is None or not got.outputs:
                return got
            # BUG: each block counts its own boundaries below a value; the
            # counts add up, their max is not the whole row's count
            outs = tuple(tuple(Partial("max") if p == Partial("sum") else p for p in ps)
                         for ps in got.outputs)
            return dataclasses.replace(got, outputs=outs)

        register_rule(op)(rule)


def _gather_zeroes_tail_of_dim2_on_4() -> None:
    from dtensor import redistribute

    original = redistribute._gather

    def _gather(local, step, global_shape, mesh_shape, coord, group, *rest):
        out = original(local, step, global_shape, mesh_shape, coord, group, *rest)
        dim = step.src.dim
        if dim == 2 and mesh_shape[step.axis] == 4 and out.shape[dim] == 5:
            out = out.clone()
            out.narrow(dim, 4, 1).zero_()  # BUG: the tail of the last shard is lost
        return out

    redistribute._gather = _gather


# -- layout conventions (caught by the per-rank oracle) -------------------------
def _shard_range_balanced() -> None:
    from dtensor import redistribute, spec

    def shard_range(size, num_pieces, index):
        # BUG: balanced pieces (numpy.array_split's 2,1,1,1) instead of
        # torch.chunk's (2,2,1,0); self-consistent, so full values survive.
        base, extra = divmod(size, num_pieces)
        return index * base + min(index, extra), base + (index < extra)

    spec.shard_range = shard_range
    redistribute.shard_range = shard_range


def _submesh_ignores_name_order() -> None:
    from dtensor.mesh import DeviceMesh

    original = DeviceMesh.__getitem__

    def __getitem__(self, names):
        names = (names,) if isinstance(names, str) else tuple(names)
        axes = [self._axis(n) for n in names]
        sub = original(self, tuple(self.mesh_dim_names[a] for a in sorted(axes)))
        if axes == sorted(axes):
            return sub
        # BUG: the names follow the order asked, the rank grid keeps the parent's.
        return DeviceMesh(self.device_type, sub.mesh, mesh_dim_names=names)

    DeviceMesh.__getitem__ = __getitem__


def _get_local_rank_assumes_consecutive_ranks() -> None:
    import math

    from dtensor.mesh import DeviceMesh

    original = DeviceMesh.get_local_rank

    def get_local_rank(self, mesh_dim=None):
        original(self, mesh_dim)  # same errors
        axis = self._axis(0 if mesh_dim is None else mesh_dim)
        # BUG: arithmetic from the rank, as if the mesh held ranks[0], ranks[0]+1, ...
        stride = math.prod(self.shape[axis + 1:])
        return (self.get_rank() - self.ranks[0]) // stride % self.shape[axis]

    DeviceMesh.get_local_rank = get_local_rank


# -- aliasing after mutation --------------------------------------------------------
def _detach_returns_self() -> None:
    from dtensor.tensor import DTensor

    original = DTensor.detach

    def detach(self):
        # BUG: "nothing to detach" fast path: the alias is the tensor itself,
        # so an in-place view on one reshapes the other.
        return self if not self.requires_grad else original(self)

    DTensor.detach = detach


def _inplace_view_returns_new_tensor() -> None:
    from dtensor.dispatch import general

    if hasattr(general, "_INPLACE_VIEWS"):  # dispatch before its cache module
        def _inplace_view(func, args, kwargs):
            out, _ = general.general(general._INPLACE_VIEWS[func], args, kwargs)
            return out  # BUG: self keeps its old shape, spec and block
    else:
        def _inplace_view(info, args, kwargs, key):
            # BUG: self keeps its old shape, spec and block
            return general.general(info.twin, args, kwargs, None)

    general._inplace_view = _inplace_view


# -- caches ---------------------------------------------------------------------------
def _fast_key_drops_value_kwargs() -> None:
    import torch

    from dtensor.dispatch import fast

    value_types = (bool, torch.dtype, torch.memory_format)
    if hasattr(fast, "_key_of"):
        original_of = fast._key_of

        def _key_of(v, t):
            if t in value_types:
                return t  # BUG: keyed by type alone, like float scalars
            return original_of(v, t)

        fast._key_of = _key_of
        return
    original = fast._key_value  # dispatch before its cache module

    def _key_value(key, v, t):
        if t in value_types:
            key.append(t)  # BUG: keyed by type alone, like float scalars
            return True
        return original(key, v, t)

    fast._key_value = _key_value


def _propagation_cache_ignores_placements() -> None:
    from dtensor.spec import DTensorSpec

    try:
        from dtensor.dispatch import cache, fast, general
    except ImportError:  # dispatch before its cache module
        from dtensor.dispatch import propagate

        original = propagate._cache_sig

        def _cache_sig(x):
            if type(x) is DTensorSpec:
                return (x.mesh, x.tensor_meta)  # BUG: placements left out of the key
            return original(x)

        propagate._cache_sig = _cache_sig
        return

    def coarse(key):  # BUG: placements left out of the call key
        return tuple((k.mesh, k.tensor_meta) if type(k) is DTensorSpec else k for k in key)

    class Table(dict):
        def get(self, key, default=None):
            return super().get(coarse(key), default)

        def __setitem__(self, key, value):
            super().__setitem__(coarse(key), value)

    fast.TABLE = general.TABLE = cache.TABLE = Table()


# -- gradient layouts and run_check ----------------------------------------------------
def _redistribute_grad_left_in_output_layout() -> None:
    from dtensor import tensor

    def backward(ctx, grad):
        return grad, None  # BUG: the gradient stays in the output's layout

    tensor._Redistribute.backward = staticmethod(backward)


def _to_local_ignores_grad_placements() -> None:
    from dtensor.tensor import DTensor

    original = DTensor.to_local

    def to_local(self, *, grad_placements=None):
        return original(self)  # BUG: grad_placements dropped

    DTensor.to_local = to_local


def _run_check_trusts_each_rank() -> None:
    from dtensor import _local_check

    def run_check(local, mesh, placements, shape, stride, norm):
        return local, shape  # BUG: no agreement; each rank infers its own shape

    _local_check.run_check = run_check


# -- random-op blocks of each shape class --------------------------------------------
def _one_run(gs, ls) -> tuple[int, bool]:
    """(the block's run dim, whether the block is one contiguous run)."""
    j = max(len(gs) - 1, 0)
    while j > 0 and ls[j] == gs[j]:
        j -= 1
    return j, all(n == 1 for n in ls[:j])


def _random_block_mutant(change=None, *, flat_empty: bool = False) -> None:
    from dtensor import _random_blocks as rng

    original = rng._generate

    def _generate(seed, offset, gs, lo, ls, *args, **kwargs):
        if change is not None:
            lo = change(tuple(gs), tuple(lo), tuple(ls))
        out = original(seed, offset, gs, lo, ls, *args, **kwargs)
        if flat_empty and out.numel() == 0 and tuple(ls) != tuple(gs):
            return out.reshape(0)  # BUG: an empty shard comes back flat
        return out

    rng._generate = _generate


def _inner_offsets_dropped(gs, lo, ls):
    _, run = _one_run(gs, ls)
    if run and len(lo) > 1 and min(ls, default=1) > 0:
        return (lo[0],) + (0,) * (len(lo) - 1)  # BUG: a run's start ignores inner dims
    return lo


def _runs_from_column_zero(gs, lo, ls):
    j, run = _one_run(gs, ls)
    if not run and min(ls, default=1) > 0:
        return (*lo[:j], 0, *lo[j + 1:])  # BUG: every run starts at column 0
    return lo


def _coordinate_wraps_past_127() -> None:
    # A layout bug that needs >= 129 ranks on one mesh axis: real worlds here
    # and the 16/64-rank simulated runs never see it; the 256-rank run does.
    from dtensor import mesh

    original = mesh.unravel

    def unravel(flat, shape):
        # BUG: a coordinate kept in a signed byte: index 128 comes back as -128
        return tuple((c + 128) % 256 - 128 for c in original(flat, shape))

    mesh.unravel = unravel


def _gather_zeroes_eighth_piece_on_wide_axis() -> None:
    # A layout bug that needs >= 8 ranks on one mesh axis, so real
    # 4-rank worlds never see it; simulated 16- and 64-rank worlds catch it.
    from dtensor import redistribute
    from dtensor.spec import shard_range

    original = redistribute._gather

    def _gather(local, step, global_shape, mesh_shape, coord, group, *rest):
        out = original(local, step, global_shape, mesh_shape, coord, group, *rest)
        n, dim = mesh_shape[step.axis], step.src.dim
        size = out.shape[dim]
        if n >= 8 and size % n:
            start, length = shard_range(size, n, 7)
            if length:
                out = out.clone()
                out.narrow(dim, start, length).zero_()  # BUG: the 8th piece is lost
        return out

    redistribute._gather = _gather


# -- the op surface of recently added code (one per input kind the properties draw) ----
def _mid_row_offset_dropped(gs, lo, ls):
    _, run = _one_run(gs, ls)
    nonzero = [d for d, o in enumerate(lo) if o]
    if run and len(nonzero) >= 2 and min(ls, default=1) > 0:
        # BUG: a run that starts mid-row keeps only its column offset
        return tuple(o if d == nonzero[-1] else 0 for d, o in enumerate(lo))
    return lo


def _norm_order_zero_share_powered() -> None:
    from dtensor import _norm_wire

    original = _norm_wire.to_wire

    def to_wire(pieces, p):
        if p == 0.0:  # BUG: a count raised to the 0th power, like any p-norm piece
            return pieces.pow(p), "sum"
        return original(pieces, p)

    _norm_wire.to_wire = to_wire


def _foreach_add_keeps_partial() -> None:
    from dtensor.rules import foreach

    # BUG: adding a scalar treated as linear, so Partial(sum) members stay partial
    foreach._SCALING_PACKETS = foreach._SCALING_PACKETS | {"_foreach_add_", "_foreach_add"}


def _run_check_broadcasts_first_replicate_axis_only() -> None:
    from dtensor import _comm, _local_check
    from dtensor.placement import Replicate

    def _replicas_from_first(local, mesh, placements):
        for axis, p in enumerate(placements):
            group = mesh.axis_group(axis)
            if isinstance(p, Replicate) and group is not None:
                # BUG: later Replicate axes keep each rank's own values
                return _comm.broadcast(local.detach().contiguous(), 0, group)
        return local

    _local_check._replicas_from_first = _replicas_from_first


def _mixed_partials_reduce_in_any_order() -> None:
    from dtensor import redistribute

    # BUG: every pair of reduce ops "commutes", so a higher Partial(max) axis is
    # reduced while a lower Partial(sum) axis stays partial
    redistribute.commute = lambda a, b: True


def _plain_operand_key_drops_dtype() -> None:
    import torch

    from dtensor.dispatch import fast
    from dtensor.dispatch.cache import PLAIN

    original = fast._key_of

    def _key_of(v, t):
        key = original(v, t)
        if t is torch.Tensor and isinstance(key, tuple) and key and key[0] is PLAIN:
            return (PLAIN, key[1], key[3])  # BUG: a plain operand keyed without its dtype
        return key

    fast._key_of = _key_of


def _permute_maps_shards_forward() -> None:
    import torch

    from dtensor import rules
    from dtensor.rules import view
    from dtensor.sharding import Sharding

    def permute_rule(call):
        (spec,) = call.specs
        dims = [view.norm_dim(d, spec.ndim) for d in view.bind(call)["dims"]]
        # BUG: shard dim d goes to dims[d], right only for self-inverse permutations
        want, out = view._map_dims(spec, lambda d: dims[d])
        return Sharding((want,), (out,))

    rules.RULES[torch.ops.aten.permute.default] = permute_rule


def _mesh_boolean_reduces_first_axis_only() -> None:
    import torch

    from dtensor import _comm
    from dtensor.dispatch import execute
    from dtensor.mesh import device_of

    def _reduce_scalar(out, how, mesh):
        if how != "all":
            return out
        flag = torch.tensor([0 if bool(out) else 1], dtype=torch.int64)
        group = mesh.axis_group(0)  # BUG: the other mesh axes never hear of it
        if group is not None:
            flag = _comm.all_reduce(flag.to(device_of(mesh)), "max", group).cpu()
        return not bool(flag.item())

    execute._reduce_scalar = _reduce_scalar


MUTANTS = {
    "coordinate_wraps_past_127": (_coordinate_wraps_past_127,
                                  "tests/properties/test_redistribute.py"),
    "gather_zeroes_eighth_piece_on_wide_axis": (_gather_zeroes_eighth_piece_on_wide_axis,
                                                "tests/properties/test_redistribute.py"),
    "gather_drops_last_uneven_shard": (_gather_drops_last_uneven_shard,
                                       "tests/properties/test_redistribute.py"),
    "partial_to_replicate_skips_reduce": (_partial_to_replicate_skips_reduce,
                                          "tests/properties/test_redistribute.py"),
    "random_same_offset_on_every_shard": (_random_same_offset_on_every_shard,
                                          "tests/properties/test_random.py"),
    "outsider_joins_collective": (_outsider_joins_collective,
                                  "tests/properties/test_outsiders.py"),
    "nonlinear_op_keeps_partial": (_nonlinear_op_keeps_partial,
                                   "tests/properties/test_ops.py"),
    "max_pieces_added_elementwise": (_max_pieces_added_elementwise,
                                     "tests/properties/test_ops.py"),
    "bucketize_blocks_take_the_max": (_bucketize_blocks_take_the_max,
                                      "tests/properties/test_sorted_boundaries.py"),
    "gather_zeroes_tail_of_dim2_on_4": (_gather_zeroes_tail_of_dim2_on_4,
                                        "tests/properties/test_redistribute.py"),
    # bugs that leave full values intact or hide from generic draws
    "shard_range_balanced": (_shard_range_balanced, "tests/properties/test_redistribute.py"),
    "submesh_ignores_name_order": (_submesh_ignores_name_order,
                                   "tests/properties/test_layouts.py"),
    "get_local_rank_assumes_consecutive_ranks": (_get_local_rank_assumes_consecutive_ranks,
                                                 "tests/properties/test_outsiders.py"),
    "detach_returns_self": (_detach_returns_self, "tests/properties/test_aliasing.py"),
    "inplace_view_returns_new_tensor": (_inplace_view_returns_new_tensor,
                                        "tests/properties/test_aliasing.py"),
    "fast_key_drops_value_kwargs": (_fast_key_drops_value_kwargs,
                                    "tests/properties/test_caches.py"),
    "propagation_cache_ignores_placements": (_propagation_cache_ignores_placements,
                                             "tests/properties/test_caches.py"),
    "redistribute_grad_left_in_output_layout": (_redistribute_grad_left_in_output_layout,
                                                "tests/properties/test_grad_layouts.py"),
    "to_local_ignores_grad_placements": (_to_local_ignores_grad_placements,
                                         "tests/properties/test_grad_layouts.py"),
    "run_check_trusts_each_rank": (_run_check_trusts_each_rank,
                                   "tests/properties/test_run_check.py"),
    "random_run_start_ignores_inner_offsets": (
        lambda: _random_block_mutant(_inner_offsets_dropped), "tests/properties/test_random.py"),
    "random_strided_runs_start_at_column_zero": (
        lambda: _random_block_mutant(_runs_from_column_zero), "tests/properties/test_random.py"),
    "random_empty_block_comes_back_flat": (
        lambda: _random_block_mutant(flat_empty=True), "tests/properties/test_random.py"),
    # one per input kind; the property that catches each in the table
    # of docs/properties.md
    "random_mid_row_run_drops_row_offset": (
        lambda: _random_block_mutant(_mid_row_offset_dropped),
        "tests/properties/test_random.py"),
    "norm_order_zero_share_powered": (_norm_order_zero_share_powered,
                                      "tests/properties/test_norms.py"),
    "foreach_add_keeps_partial": (_foreach_add_keeps_partial,
                                  "tests/properties/test_foreach.py"),
    "run_check_broadcasts_first_replicate_axis_only": (
        _run_check_broadcasts_first_replicate_axis_only, "tests/properties/test_run_check.py"),
    "mixed_partials_reduce_in_any_order": (_mixed_partials_reduce_in_any_order,
                                           "tests/properties/test_redistribute.py"),
    "plain_operand_key_drops_dtype": (_plain_operand_key_drops_dtype,
                                      "tests/properties/test_caches.py"),
    "permute_maps_shards_forward": (_permute_maps_shards_forward,
                                    "tests/properties/test_permute.py"),
    "mesh_boolean_reduces_first_axis_only": (_mesh_boolean_reduces_first_axis_only,
                                             "tests/properties/test_mesh_booleans.py"),
}


# Planted for fuzzing sessions (docs/fuzzing.md): the ci profile misses them
# by design, so the default run (every mutant) leaves them out.
FUZZ_ONLY = {"gather_zeroes_tail_of_dim2_on_4"}
# Needs >= 8 ranks on one axis: caught by simulated worlds only (
# DTENSOR_WORLD_SIZES=16 pytest --dist-sim), so the 4-rank default run skips it.
FUZZ_ONLY |= {"gather_zeroes_eighth_piece_on_wide_axis"}
# Needs >= 129 ranks on one axis: DTENSOR_WORLD_SIZES=256 pytest --dist-sim only.
FUZZ_ONLY |= {"coordinate_wraps_past_127"}


def apply(name: str) -> None:
    """Monkeypatch mutant ``name`` into this process's runtime."""
    if name not in MUTANTS:
        raise SystemExit(f"DTENSOR_MUTANT={name!r}: unknown mutant; one of {sorted(MUTANTS)}")
    MUTANTS[name][0]()


#: README's main job: the property suite on a 4-rank world, ``ci`` profile.
MAIN_JOB = ("tests/properties", 4, "ci")


#: ``--lock PATH``: each pytest run waits for ``flock PATH`` (a shared machine).
LOCK: list[str] = []
#: ``--log-dir DIR``: each mutant's whole output goes to ``DIR/<name>.log``.
LOG_DIR: list[str] = []


def _pytest(target: str, nproc: int, profile: str, mutant: str | None,
            first_failure: bool = False) -> tuple[set, float, str]:
    """(failed test ids, pytest's seconds, output) of the suite at ``target``."""
    cmd = [*LOCK, "torchrun", f"--nproc_per_node={nproc}", "-m", "pytest", "-p",
           "launch.hypo.profiles", target, "-q", "-rf", "-p", "no:cacheprovider",
           f"--hypothesis-profile={profile}", *(["-x"] if first_failure else [])]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DTENSOR_MUTANT", None)
    if mutant:
        env["DTENSOR_MUTANT"] = mutant
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    took = re.findall(r"(?:passed|failed|error|errors)[^\n]* in ([\d.]+)s", out)
    # pytest's own time: the wall time would include waiting for the lock
    seconds = float(took[-1]) if took else time.monotonic() - t0
    failed = set(re.findall(r"^FAILED (\S+)", out, re.M))
    return failed, seconds, out


def run(name: str, nproc: int, target: str | None, profile: str,
        baseline: dict[str, set] | None) -> tuple[bool, float, str]:
    """Run ``target`` with mutant ``name``: caught when a test that passes on
    the unmutated runtime (``baseline``, filled on demand; None: every test
    passes unmutated) fails. The mutated run stops at its first failure."""
    target = target or MUTANTS[name][1]
    if baseline is None:
        baseline = {target: set()}
    elif target not in baseline:
        baseline[target], took, out = _pytest(target, nproc, profile, None)
        summary = [x for x in out.splitlines() if re.search(r"\d+ (passed|failed)", x)]
        print(f"== unmutated {target}: {summary[-1].strip() if summary else '?'} "
              f"({took:.1f}s); failing there: {sorted(baseline[target])}", flush=True)
    failed, dt, out = _pytest(target, nproc, profile, name, first_failure=True)
    if LOG_DIR:
        Path(LOG_DIR[0], f"{name}.log").write_text(out)
    new = sorted(failed - baseline[target])
    replay = (f"DTENSOR_MUTANT={name} torchrun --nproc_per_node={nproc} -m pytest "
              f"-p launch.hypo.profiles '{{test}}' --hypothesis-profile={profile}")
    return bool(new), dt, _excerpt(out, new, replay)


def _excerpt(out: str, new: list[str], replay: str = "") -> str:
    """The first new failure's minimal example, first error line and replay command.

    Three shapes of failure: a ``RankFailure`` (ranks disagree: the lockstep
    plugin prints the example and a ``Replay:`` line), a failure alike on every
    rank (Hypothesis's own "Failing test case" with its ``Draw`` lines), and a
    hang the test service's watchdog ends (no example: it cannot shrink).
    ``replay`` is the command printed when the output has no ``Replay:`` line.
    """
    lines = out.splitlines()
    keep: list[str] = [f"newly failing: {new}"]
    for i, line in enumerate(lines):
        if "RankFailure: example failed" in line and any(
                n.split("::")[-1] in "\n".join(lines[i:i + 300]) for n in new):
            keep.append(line.split("RankFailure: ", 1)[1].strip())
            errs = [x[1:].strip()[:400] for x in lines[i + 1:i + 200]
                    if re.match(r"E\s+(\w*(Error|Exception)|Failed):", x)]
            # Ranks may fail differently (one names the bug, the others may
            # only report that a peer failed): up to two distinct messages.
            keep += list(dict.fromkeys(errs))[:2]
            rep = [x for x in lines[i + 1:i + 300] if "Replay:" in x]
            keep += [r[1:].strip() for r in rep[:1]]
            break
    else:
        for i, line in enumerate(lines):
            if "Failing test case:" in line:
                errs = [x for x in lines[max(0, i - 5):i + 1]
                        if re.match(r"E\s+(\w*(Error|Exception)|Failed):", x)]
                draws = []
                for x in lines[i + 1:i + 80]:
                    if re.match(r"E\s+Draw \d+", x):
                        draws.append(x[1:].strip()[:300])
                    elif draws:
                        break
                keep += draws + [e[1:].strip()[:400] for e in errs[:1]]
                break
        for i, line in enumerate(lines):
            if line.startswith("launch: timed out"):
                keep.append(line.strip())
                keep += [x.strip() for x in lines[i + 1:i + 6]
                         if x.startswith("stuck ranks") or re.match(r"\s+rank \d+: ", x)]
                break
    if replay and new and not any(k.startswith("Replay:") for k in keep):
        keep.append(f"Replay: {replay.format(test=new[0])}")
    summary = [x for x in lines if re.search(r"\d+ (passed|failed)", x)]
    return "\n".join(keep + summary[-1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help=f"mutants (default: all): {sorted(MUTANTS)}")
    ap.add_argument("--quick", action="store_true",
                    help="run each mutant's own property file, not the whole main job")
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: 4, as README)")
    ap.add_argument("--target", default=None, help="pytest target (default: the main job)")
    ap.add_argument("--profile", default="ci")
    ap.add_argument("--lock", default=None, help="flock this file around each pytest run")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the unmutated run (when it is known to pass)")
    ap.add_argument("--log-dir", default=None, help="keep each mutant's output here")
    args = ap.parse_args()
    if args.lock:
        LOCK[:] = ["flock", args.lock]
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        LOG_DIR[:] = [args.log_dir]
    names = args.names or [n for n in MUTANTS if n not in FUZZ_ONLY]
    main_target, main_nproc, main_profile = MAIN_JOB
    nproc = args.nproc or main_nproc
    target = args.target or (None if args.quick else main_target)
    is_main = (target == main_target and nproc == main_nproc
               and args.profile == main_profile)
    missed: list[str] = []
    baseline: dict[str, set] | None = None if args.no_baseline else {}
    for name in names:
        caught, dt, excerpt = run(name, nproc, target, args.profile, baseline)
        print(f"== {name}: {'CAUGHT' if caught else 'NOT CAUGHT'} ({dt:.1f}s)", flush=True)
        print("   " + excerpt.replace("\n", "\n   "), flush=True)
        if not caught:
            missed.append(name)
    where = "the main job" if is_main else (
        f"{target or 'their own property files'} ({nproc} ranks, {args.profile})")
    skipped = f"; fuzz-only, not run: {sorted(FUZZ_ONLY)}" if not args.names else ""
    print(f"{len(names) - len(missed)}/{len(names)} planted bugs caught by {where}"
          + (f"; missed: {missed}" if missed else "") + skipped)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
