"""Planted bugs of ``tools/mutants.py``: collectives, layout conventions,
aliasing after mutation, caches, gradient layouts and ``run_check``. Each
function monkeypatches one bug into this process's runtime."""

from __future__ import annotations


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
