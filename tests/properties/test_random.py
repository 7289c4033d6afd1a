"""Covers: dtensor/dispatch/random_ops.py and dtensor/random.py through DTensors.

Properties, on generated meshes (1-D to 3-D, sub-meshes) and placements
(uneven and empty shards, partial inputs), for every random op in ``OPS``:

- the full tensor equals the single-device result under the same seed, bit for
  bit (dtensor: the plain-tensor functions of ``dtensor.random``; torch:
  ``torch.manual_seed`` then the plain torch op), and every rank — members and
  outsiders — leaves the generator where the single-device run leaves it;
- every shape class of a rank's block (empty, one full row, a contiguous
  run of an uneven dim, strided) holds its piece of the stream;
- replicas hold identical locals, and different shards are not copies;
- consecutive ops on different meshes follow the single-device sequence;
- ranks outside a sub-mesh issue no collectives, hold empty locals and stay in
  step, so a later op on the whole world still matches;
- in-place ops on ``Partial`` inputs store what docs/random.md says.

With ``--dtensor-impl=torch`` the same properties run on
``torch.distributed.tensor``; on CPU they are expected to fail (see
/work/shared/FACTS.md), and the property summary reports it.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from _random_cases import (Case, as_ours, assert_same_bits, bits_of, check_outputs,
                           draw_case, gather_outputs, generator_state, op_kwargs, reference,
                           run_case, seed_generator, world_blocks)
from _random_ops import FACTORY, INPLACE, OPS, ops_for, random_span
from dtensor.testing import (
    assert_local_is_empty,
    mesh_layouts,
    placements,
    sub_meshes,
    tensor_shapes,
)
from dtensor.testing.blocks import BLOCK_CLASSES, mid_row_runs, sharded_blocks

pytestmark = pytest.mark.dist_timeout(180)


# Properties -----------------------------------------------------------------------
@pytest.mark.parametrize("op_name", [op.name for op in OPS])
@given(data=st.data())
def test_random_ops_equal_the_single_device_stream(n_ranks, world, impl, op_name, data):
    """full_tensor() of every random op is the single-device result, bit for
    bit, and every rank advances the generator as the single-device run does."""
    if op_name not in ops_for(impl):
        pytest.skip(f"{impl.name} has no {op_name} for DTensors")
    if impl.name == "torch" and op_name == "native_dropout":
        pytest.skip("torch: one rank aborts (SIGABRT in full_tensor of native_dropout's "
                    "output, 2 ranks, CPU) while the other has moved on, which ends the "
                    "whole torch run; skipped so the other properties still report")
    case = draw_case(data, impl, world.size, ops=[op_name])
    mesh = impl.mesh(case.layout)
    seed_generator(impl, case.seed)
    gathered = gather_outputs(run_case(case, impl, mesh), world)
    after = generator_state(impl)
    seed_generator(impl, case.seed)
    expected = reference(case, impl)
    assert after == generator_state(impl), (
        f"rank {world.rank}: {case.op.name} left the generator at {after}, the "
        f"single-device run at {generator_state(impl)}")
    check_outputs(gathered, expected, case, case.layout)


@pytest.mark.parametrize("kind", BLOCK_CLASSES)
@given(data=st.data())
def test_random_blocks_of_every_shape_class(n_ranks, world, impl, kind, data):
    """Layouts where some rank's block is empty, one full row, one contiguous
    run (leading size-1 dims, or rows of an uneven dim) or strided: every op
    gives each rank its piece of the single-device stream (per-rank oracle
    and full tensor, bit for bit)."""
    block = data.draw(sharded_blocks(world_size=world.size, kind=kind,
                                     allow_sub_meshes=impl.sub_meshes), label="block")
    case = draw_case(data, impl, world.size, layout=block.layout, shape=block.shape,
                      ps=block.placements)
    for c in sorted(block.classes()):
        event(f"a {c} block")
    mesh = impl.mesh(case.layout)
    seed_generator(impl, case.seed)
    gathered = gather_outputs(run_case(case, impl, mesh), world)
    seed_generator(impl, case.seed)
    expected = reference(case, impl)
    check_outputs(gathered, expected, case, case.layout)


@given(data=st.data())
def test_random_runs_that_start_mid_row(n_ranks, world, impl, data):
    """Blocks that are one contiguous run of the global tensor starting
    mid-row, offset in two sharded dims where the mesh allows (one row per
    piece, uneven columns, size-1 dims around them): every op gives each rank
    its piece of the single-device stream."""
    block = data.draw(mid_row_runs(world_size=world.size,
                                   allow_sub_meshes=impl.sub_meshes), label="block")
    case = draw_case(data, impl, world.size, layout=block.layout, shape=block.shape,
                      ps=block.placements)
    mesh = impl.mesh(case.layout)
    seed_generator(impl, case.seed)
    gathered = gather_outputs(run_case(case, impl, mesh), world)
    seed_generator(impl, case.seed)
    expected = reference(case, impl)
    check_outputs(gathered, expected, case, case.layout)


@given(data=st.data())
def test_replicas_agree_and_shards_differ(n_ranks, world, impl, data):
    """Ranks holding the same block hold the same bits; two different blocks of
    the same shape are not copies (checked when a collision has a chance
    below 2**-64). The local blocks are exchanged over the test's group."""
    import torch.distributed as dist

    shape = data.draw(tensor_shapes(min_dims=1, max_side=12), label="shape")
    case = draw_case(data, impl, world.size, shape=shape, allow_partial=False)
    mesh = impl.mesh(case.layout)
    seed_generator(impl, case.seed)
    out = run_case(case, impl, mesh)[0]
    # Every rank's block in the output's layout (dropout may pick another
    # one), None outside; then every rank's local bits, padded with zeros to
    # the widest block, in one all_gather of int64.
    ps = as_ours(out.placements)
    blocks = world_blocks(case.shape, case.layout, ps, world.size)
    width = max(1, *(math.prod(b[0]) for b in blocks if b is not None))
    mine = bits_of(out.to_local().detach()).flatten().to(torch.int64)
    sent = torch.zeros(width, dtype=torch.int64)
    sent[: min(width, mine.numel())] = mine[:width]
    recv = torch.empty(world.size * width, dtype=torch.int64)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(recv, sent, group=world.group)  # torch 2.13's name for all_gather_into_tensor
    recv = recv.view(world.size, width)
    assert mine.numel() == (0 if blocks[world.rank] is None
                            else math.prod(blocks[world.rank][0])), (
        f"rank {world.rank} holds {mine.numel()} elements, its block is "
        f"{blocks[world.rank]}")
    _assert_replicas_agree_and_shards_differ(case, ps, blocks, recv)


def _assert_replicas_agree_and_shards_differ(case, ps, blocks, recv) -> None:
    """Each rank holds its block's first holder's bits, and blocks of one
    shape that differ hold different bits (checked when a collision has a
    chance below 2**-64). Rows of ``recv`` are the ranks' bits, zero-padded:
    two blocks of one shape pad alike, so whole rows compare. Whole-table ops,
    not a loop over ranks: each rank runs this (n ops per rank is quadratic
    in a simulated world)."""
    bits = case.op.bits(case.dtype, case.kw)
    holder: dict = {}
    members, first_of, firsts = [], [], {}
    for r, blk in enumerate(blocks):
        if blk is None:
            continue
        s = holder.setdefault(blk, r)
        members.append(r)
        first_of.append(s)
        if s == r and math.prod(blk[0]) * bits >= 64:
            firsts.setdefault(blk[0], []).append(r)
    rows = torch.tensor(members)
    same = (recv[rows] == recv[torch.tensor(first_of)]).all(1)
    if not bool(same.all()):
        i = int((~same).nonzero()[0])
        raise AssertionError(
            f"{_where(case, ps)}: ranks {first_of[i]} and {members[i]} hold block "
            f"{blocks[members[i]]} (shape, offset) with different bits")
    for ranks in firsts.values():
        if len(ranks) < 2:
            continue
        table = recv[torch.tensor(ranks)]
        if torch.unique(table, dim=0).shape[0] == len(ranks):
            continue
        seen: dict = {}
        for r, row in zip(ranks, table, strict=True):
            s = seen.setdefault(row.numpy().tobytes(), r)
            assert s == r, (
                f"{_where(case, ps)}: ranks {s} and {r} hold different blocks {blocks[s]} "
                f"and {blocks[r]} (shape, offset) with the same values: shards are copies "
                "of each other")


def _where(case, ps) -> str:
    return (f"{case.op.name}{case.kw or ''} {case.dtype} {list(case.shape)} on "
            f"{[str(p) for p in ps]} of {case.layout}")


@given(data=st.data())
def test_consecutive_ops_follow_the_single_device_sequence(n_ranks, world, impl, data):
    """Two or three random ops in a row (each on its own mesh and layout) give
    what the same ops give one after the other on one device."""
    steps = [draw_case(data, impl, world.size) for _ in range(data.draw(
        st.integers(2, 3), label="steps"))]
    seed = steps[0].seed
    seed_generator(impl, seed)
    outs = [run_case(case, impl, impl.mesh(case.layout)) for case in steps]
    gathered = [gather_outputs(out, world) for out in outs]
    seed_generator(impl, seed)
    expected = [reference(case, impl) for case in steps]
    for i, (case, got, ref) in enumerate(zip(steps, gathered, expected, strict=True)):
        check_outputs(got, ref, case._replace(op=case.op._replace(
            name=f"step {i}: {case.op.name}")), case.layout)


def _need_sub_meshes(impl):
    if not impl.sub_meshes:
        pytest.skip(f"{impl.name}: DeviceMesh construction is collective over the whole "
                    "world, so meshes that leave ranks out cannot be built by members only")


@given(data=st.data())
def test_outsiders_advance_the_generator_without_collectives(n_ranks, world, impl, data):
    """On a sub-mesh, ranks outside hold empty locals, issue no collectives and
    advance the generator like the members, so a following op on the whole
    world matches the single-device sequence. Ops with a single, non-partial
    input (or none) communicate on no rank at all."""
    _need_sub_meshes(impl)
    layout = data.draw(sub_meshes(world_size=world.size), label="layout")
    first = draw_case(data, impl, world.size, layout=layout)
    then = draw_case(data, impl, world.size, layout=data.draw(
        mesh_layouts(world_size=world.size), label="then layout"))
    mesh = impl.mesh(layout)
    seed_generator(impl, first.seed)
    if first.op.kind == FACTORY:
        with impl.comm_counter() as comm:
            outs = run_case(first, impl, mesh)
    else:
        x = impl.from_blocks(first.base, mesh, first.ps)
        kw = op_kwargs(first, impl, mesh)
        with impl.comm_counter() as comm:
            outs = first.op.run(x, kw)
        outs = outs if isinstance(outs, tuple) else (outs,)
    gathered_first = gather_outputs(outs, world)
    gathered_then = gather_outputs(run_case(then, impl, impl.mesh(then.layout)), world)
    seed_generator(impl, first.seed)
    expected_first = reference(first, impl)
    expected_then = reference(then, impl)
    if layout.coordinate_of(world.rank) is None:
        assert comm.total == 0, (
            f"rank {world.rank} is outside {layout} but {first.op.name} issued "
            f"{comm.total} collectives: {getattr(comm, 'counts', '')}")
    elif not any(p.is_partial() for p in first.ps) and "p_ps" not in first.kw:
        assert comm.total == 0, (
            f"{first.op.name} on {[str(p) for p in first.ps]} issued {comm.total} "
            f"collectives on rank {world.rank}: {getattr(comm, 'counts', '')}")
    check_outputs(gathered_first, expected_first, first, layout)
    check_outputs(gathered_then, expected_then, then, then.layout)


def _int_range(case: Case) -> tuple[int, int]:
    """[low, high) of an in-place integer draw (floats: unused)."""
    kw, name = case.kw, case.op.name
    if name == "random_(to)":
        return 0, kw["to"]
    if name == "random_(from, to)":
        return kw["from"], kw["to"] if kw["to"] is not None else random_span(case.dtype)
    if name == "random_":
        return 0, random_span(case.dtype)
    return 0, 2


@given(data=st.data())
def test_inplace_ops_on_partial_inputs(n_ranks, world, impl, data):
    """docs/random.md: an in-place random op keeps a Partial input partial and
    stores the draw on coordinate 0 of every Partial(sum) axis (zeros on the
    others), and everywhere for Partial(avg/max/min). The value is then the
    draw, exactly, except that Partial(avg) over an axis whose size is not a
    power of two is the mean of n copies: within one rounding. Integers whose
    n copies would overflow the dtype are refused on every rank."""
    from dtensor.spec import local_block

    if impl.name != "dtensor":
        pytest.skip("the Partial semantics of in-place random ops are dtensor's")
    layout = data.draw(mesh_layouts(world_size=world.size, allow_sub_meshes=True),
                       label="layout")
    ops = [op.name for op in OPS if op.kind == INPLACE]
    case = draw_case(data, impl, world.size, layout=layout, ops=ops)
    ps = data.draw(placements(mesh_ndim=layout.ndim, tensor_ndim=len(case.shape),
                              reduce_ops=("sum", "avg", "max", "min")), label="placements")
    case = case._replace(ps=tuple(ps))
    mesh = impl.mesh(layout)
    seed_generator(impl, case.seed)
    x = impl.from_blocks(case.base, mesh, case.ps)
    n_avg = math.prod(layout.shape[a] for a, p in enumerate(case.ps) if p.is_partial("avg"))
    low, high = _int_range(case)
    if n_avg > 1 and not case.dtype.is_floating_point and case.dtype != torch.bool and (
            low * n_avg < torch.iinfo(case.dtype).min
            or (high - 1) * n_avg > torch.iinfo(case.dtype).max):
        # The sum of n copies would overflow: refused, identically everywhere.
        from dtensor import ShardingError

        with pytest.raises(ShardingError, match="overflows"):
            case.op.run(x, op_kwargs(case, impl, mesh))
        assert generator_state(impl).offset == 0
        return
    y = case.op.run(x, op_kwargs(case, impl, mesh))
    piece = y.to_local().clone()
    coord = layout.coordinate_of(world.rank)
    full = y.full_tensor() if coord is not None else None
    seed_generator(impl, case.seed)
    (expected,) = reference(case, impl)
    where = f"{case.op.name} on {[str(p) for p in case.ps]} of {layout}"
    assert y is x and tuple(y.placements) == case.ps, where
    if coord is None:
        assert_local_is_empty(piece, y.dtype, f" {layout}")
        return
    shape, start = local_block(case.shape, layout.shape, case.ps, coord)
    block = expected[tuple(slice(o, o + n) for o, n in zip(start, shape, strict=True))]
    zero = any(p.is_partial("sum") and coord[a] != 0 for a, p in enumerate(case.ps))
    assert_same_bits(piece, torch.zeros_like(block) if zero else block,
                      f"{where}: local piece at {coord}")
    avg = [layout.shape[a] for a, p in enumerate(case.ps) if p.is_partial("avg")]
    if all(n & (n - 1) == 0 for n in avg):  # sizes are powers of two: exact
        assert_same_bits(full, expected, f"{where}: full_tensor()")
    elif case.dtype.is_floating_point:  # the mean of n copies: one rounding
        torch.testing.assert_close(full, expected, msg=f"{where}: full_tensor()")
