"""Planted bugs of ``tools/mutants.py``: random-op blocks of each shape
class, and one per input kind of the op surface the properties draw. Each
function monkeypatches one bug into this process's runtime."""

from __future__ import annotations


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
