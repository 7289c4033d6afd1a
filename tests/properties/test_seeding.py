"""Covers: dtensor/_seeding.py and dtensor/random.py's seeding, through DTensors.

Properties on generated meshes (sub-meshes with outsiders included) and
replicated placements, as users seed:

- nobody seeds (each process holds its own default torch seed): replicated
  random tensors and dropout masks of replicated inputs agree on every rank
  and equal the single-device stream of the seed the ranks agreed on;
- ``torch.manual_seed(s)`` reseeds DTensor random ops: the same seed twice
  gives the same values, equal to the single-device result after
  ``torch.manual_seed(s)``;
- ranks of a mesh given different ``torch.manual_seed`` values are told so
  on every member at the next draw on that mesh; outsiders neither raise nor
  communicate.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from dtensor.testing import assert_local_is_empty, mesh_layouts, sub_meshes

pytestmark = pytest.mark.dist_timeout(180)

SHAPES = st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple)


def _ours(impl, per_process_seeds: bool = False):
    if impl.name != "dtensor":
        pytest.skip(f"{impl.name}: these properties state dtensor's seeding contract")
    import dtensor
    from dtensor._rank_state import is_sim_rank

    if per_process_seeds and is_sim_rank():
        pytest.skip("a simulated world's ranks share one process, hence torch's one "
                    "default generator: per-rank torch seeds cannot be set up there")
    return dtensor


def _input(dtensor, mesh, x):
    from dtensor import Replicate

    return dtensor.distribute_tensor(x, mesh, [Replicate()] * mesh.ndim)


def _draw(dtensor, kind, mesh, shape, d=None):
    from dtensor import Replicate

    pls = [Replicate()] * mesh.ndim
    if kind == "rand":
        return dtensor.rand(*shape, device_mesh=mesh, placements=pls)
    if kind == "uniform_":
        return dtensor.zeros(*shape, device_mesh=mesh, placements=pls).uniform_(-1, 2)
    if kind == "dropout":
        return F.dropout(d, p=0.5, training=True)
    return torch.nn.Dropout(0.3)(d)


def _reference(kind, shape, x, state):
    from dtensor import random as rng

    rng.set_rng_state(state)
    if kind == "rand":
        return rng.rand(*shape)
    if kind == "uniform_":
        return rng.uniform_(torch.zeros(shape), -1, 2)
    return rng.dropout(x, p=0.5 if kind == "dropout" else 0.3)


def _world_values(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _layouts(world_size: int):
    """Whole-world meshes and sub-meshes with outsiders."""
    return st.one_of(mesh_layouts(world_size=world_size), sub_meshes(world_size=world_size))


KINDS = st.sampled_from(["rand", "uniform_", "dropout", "module_dropout"])


@given(data=st.data())
def test_unseeded_replicas_agree(n_ranks, world, impl, data):
    dtensor = _ours(impl, per_process_seeds=True)
    from dtensor import random as rng

    layout = data.draw(_layouts(world.size))
    kind, shape = data.draw(KINDS), data.draw(SHAPES)
    x = torch.arange(1.0, 1.0 + torch.Size(shape).numel()).reshape(shape)
    mesh = impl.mesh(layout)
    # A fresh process: torch's default seed differs per rank and nothing seeded us.
    torch.default_generator.manual_seed(1_000_003 * (world.rank + 1) + data.draw(
        st.integers(0, 2**20)))
    rng._forget_seed()
    out = _draw(dtensor, kind, mesh, shape, _input(dtensor, mesh, x))
    state = rng.get_rng_state()
    agreed = torch.tensor([state.seed & 0xFFFFFFFF, state.seed >> 32, state.offset])
    seeds = _world_values(agreed)
    # (An empty dropout draws nothing, so nothing needed agreeing yet.)
    assert any(s[2] == 0 for s in seeds) or all(torch.equal(s, seeds[0]) for s in seeds), (
        f"ranks did not agree on a seed with nobody seeding: {[s.tolist() for s in seeds]}")
    if layout.coordinate_of(world.rank) is None:
        assert_local_is_empty(out.to_local(), out.dtype, f" {layout}")
        return
    before = rng.RNGState(state.seed, state.offset - 1)
    expected = _reference(kind, shape, x, before)
    rng.set_rng_state(state)
    assert torch.equal(out.to_local(), expected), (
        f"{kind} on {layout}: rank {world.rank}'s replica is not the agreed stream")


@given(data=st.data())
def test_torch_manual_seed_reseeds(n_ranks, world, impl, data):
    dtensor = _ours(impl)
    from dtensor import random as rng

    layout = data.draw(_layouts(world.size))
    kind, shape = data.draw(KINDS), data.draw(SHAPES)
    seed = data.draw(st.integers(0, 2**63))
    x = torch.linspace(-2, 3, torch.Size(shape).numel()).reshape(shape)
    mesh = impl.mesh(layout)
    d = _input(dtensor, mesh, x)
    torch.manual_seed(seed)
    first = _draw(dtensor, kind, mesh, shape, d)
    _draw(dtensor, "rand", mesh, (3,))  # the stream moves on...
    torch.manual_seed(seed)  # ...and torch's reseed brings it back
    again = _draw(dtensor, kind, mesh, shape, d)
    torch.manual_seed(seed)
    expected = _reference(kind, shape, x, rng.get_rng_state())
    if layout.coordinate_of(world.rank) is None:
        return
    assert torch.equal(first.to_local(), again.to_local()), (
        f"{kind}: torch.manual_seed({seed}) twice gave different values on {layout}")
    assert torch.equal(first.to_local(), expected), (
        f"{kind}: not the single-device values after torch.manual_seed({seed})")


@given(data=st.data())
def test_per_rank_seeds_are_reported_on_every_member(n_ranks, world, impl, data):
    dtensor = _ours(impl, per_process_seeds=True)
    from dtensor import _seeding
    from dtensor.debug import CommCounter

    layout = data.draw(_layouts(world.size).filter(lambda m: len(m.ranks) > 1))
    # (Dropout of an empty tensor draws nothing, so it has nothing to check.)
    kind, shape = data.draw(KINDS), data.draw(SHAPES.filter(lambda s: 0 not in s))
    base = data.draw(st.integers(0, 2**32))
    mesh = impl.mesh(layout)
    d = _input(dtensor, mesh, torch.ones(shape))
    inside = layout.coordinate_of(world.rank) is not None
    torch.manual_seed(base + world.rank)  # the common bug: a seed per rank
    try:
        with CommCounter() as comm:
            if inside:
                with pytest.raises(_seeding.SeedMismatchError, match="different random states"):
                    _draw(dtensor, kind, mesh, shape, d)
            else:
                _draw(dtensor, kind, mesh, shape, d)
        assert comm.total == 0, f"seed checks issued collectives: {comm.counts}"
    finally:
        torch.manual_seed(base)
