"""Covers: dtensor/fsdp/ (fully_shard, FSDPModule, MixedPrecisionPolicy): FSDP on
2 and 4 ranks (uneven and empty shards) and HSDP on 2x2 train an MLP like one
device with AdamW (foreach and fused) and clip_grad_norm_; one all-gather per
group before forward (and before backward when resharded), one reduce-scatter
per group after backward; reduce_dtype, gradient sync off, unshard/reshard,
state_dict; bad input raises FSDPError on every rank."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dtensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor
from dtensor.debug import CommCounter
from dtensor.fsdp import (
    CPUOffloadPolicy,
    FSDPError,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)

WORLDS = pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.world_size(n), id=f"w{n}") for n in (2, 4)]
)


class MLP(nn.Module):
    # 7 and 3 rows: uneven shards on 2 and 4 ranks, an empty one on 4.
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)
        self.c = nn.Linear(3, 4, bias=False)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _pair(mesh, **kw):
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref)
    for m in (model.a, model.b):
        fully_shard(m, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return ref, model


def _dp(mesh) -> tuple[int, int]:
    """(data-parallel rank, size): over every axis of the mesh."""
    return mesh.get_rank() if mesh.ndim == 1 else mesh.get_coordinate()[0] * mesh.shape[1] \
        + mesh.get_coordinate()[1], mesh.size()


def _train(ref, model, mesh, steps, make_opt, clip=None, opts=None):
    rank, size = _dp(mesh)
    opt, ropt = opts or (make_opt(model.parameters()), make_opt(ref.parameters()))
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 5, generator=g)
        loss = model(x.chunk(size)[rank]).pow(2).mean()
        loss.backward()
        want = ref(x).pow(2).mean()
        want.backward()
        if clip is not None:
            total = nn.utils.clip_grad_norm_(model.parameters(), clip)
            torch.testing.assert_close(total.full_tensor(), nn.utils.clip_grad_norm_(
                ref.parameters(), clip), rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name, step=step: f"{name} {step}: {m}")
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


ADAMW = {
    "foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
}


@WORLDS
@pytest.mark.parametrize("kind", ["foreach", "fused"])
def test_fsdp_trains_like_single_device(world, n, kind) -> None:
    mesh = DeviceMesh("cpu", list(range(n)))
    ref, model = _pair(mesh)
    assert isinstance(model, FSDPModule) and isinstance(model.a, FSDPModule)
    assert model.a.weight.placements == (Shard(0),)
    assert model.a.weight.to_local().shape[0] == len(torch.arange(7).chunk(n)[world.rank]) \
        if world.rank < len(torch.arange(7).chunk(n)) else 0
    _train(ref, model, mesh, 3, ADAMW[kind], clip=0.05)


@pytest.mark.world_size(4)
def test_hsdp_on_a_2d_mesh_trains_like_single_device(world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("replicate", "shard"))
    ref, model = _pair(mesh)
    assert model.a.weight.placements == (Replicate(), Shard(0))
    with CommCounter() as c:
        model(torch.randn(2, 5)).sum().backward()
    # Per group: reduce-scatter over the shard axis, then all-reduce over replicas.
    assert (c["reduce_scatter"], c["all_reduce"]) == (3, 3)
    model.zero_grad()
    _train(ref, model, mesh, 3, ADAMW["foreach"], clip=0.05)


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("reshard", "gathers"), [(True, 3 + 2), (False, 3)])
def test_one_all_gather_and_one_reduce_scatter_per_group(world, reshard, gathers) -> None:
    """Three groups (a, b, the root's c): one all-gather each before forward;
    resharded groups (not the root) are gathered again before backward."""
    mesh = DeviceMesh("cpu", [0, 1])
    _, model = _pair(mesh, reshard_after_forward=reshard)
    with CommCounter() as c:
        model(torch.randn(4, 5)).sum().backward()
    assert dict(c.counts) == {"all_gather": gathers, "reduce_scatter": 3}
    with CommCounter() as c, torch.no_grad():
        model(torch.randn(4, 5))
    assert dict(c.counts) == {"all_gather": 3}  # no backward: every group resharded after


@pytest.mark.world_size(2)
def test_reduce_dtype_is_the_wire_dtype(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    sizes = {}
    for dtype in (None, torch.float64):
        _, model = _pair(mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=dtype))
        with CommCounter() as c:
            model(torch.randn(4, 5)).sum().backward()
        sizes[dtype] = c.bytes["reduce_scatter"]
        assert model.a.weight.grad.dtype == torch.float32
    assert sizes[torch.float64] == 2 * sizes[None]


@pytest.mark.world_size(2)
def test_param_dtype_computes_in_it_and_casts_outputs(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref)
    for m in (model.a, model.b):
        fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float64))
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.float64, output_dtype=torch.float32))
    ref64 = copy.deepcopy(ref).double()
    x = torch.randn(4, 5)
    out = model(x.chunk(2)[world.rank])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref64(x.double()).float().chunk(2)[world.rank])
    out.pow(2).sum().backward()
    ref64(x.double()).float().pow(2).sum().div(2).backward()
    for p, q in zip(model.parameters(), ref64.parameters(), strict=True):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.float())


@pytest.mark.world_size(2)
def test_gradient_sync_off_accumulates_and_the_next_sync_reduces_the_sum(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    ref, model = _pair(mesh)
    xs = [torch.randn(4, 5) for _ in range(2)]
    model.set_requires_gradient_sync(False)
    with CommCounter() as c:
        model(xs[0].chunk(2)[world.rank]).sum().backward()
    assert c["reduce_scatter"] == 0 and model.a.weight.grad is None
    model.set_requires_gradient_sync(True)
    model(xs[1].chunk(2)[world.rank]).sum().backward()
    for x in xs:
        ref(x).sum().div(2).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad)


@pytest.mark.world_size(2)
def test_unshard_reshard_and_state_dict(world) -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    ref, model = _pair(mesh)
    model.a.unshard()
    assert type(model.a.weight) is torch.Tensor
    torch.testing.assert_close(model.a.weight, ref.a.weight.detach())
    model.a.reshard()
    assert isinstance(model.a.weight, DTensor)
    sd = model.state_dict()
    assert set(sd) == set(ref.state_dict()) and all(isinstance(v, DTensor) for v in sd.values())
    other = _pair(mesh)[1]
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other.load_state_dict(sd)
    x = torch.randn(2, 5)
    torch.testing.assert_close(other(x), ref(x))


# Bad input: the same FSDPError on every rank, before any collective ----------------
@pytest.mark.world_size(2)
def test_a_module_sharded_twice_or_on_another_mesh_is_refused(world) -> None:
    mesh, other = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [1, 0])
    model = MLP()
    fully_shard(model.a, mesh=mesh)
    with pytest.raises(FSDPError, match=r"already sharded on .* once per module"):
        fully_shard(model.a, mesh=other)
    with pytest.raises(FSDPError, match=r"submodule .*Linear is sharded on .* same mesh"):
        fully_shard(model, mesh=other)
    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), other, [Replicate()]))
    with pytest.raises(FSDPError, match=r"already a DTensor on .* not the other axis"):
        fully_shard(lin, mesh=mesh)


@pytest.mark.world_size(4)
def test_a_mesh_without_a_data_parallel_axis_is_refused(world) -> None:
    from dtensor.parallel import ColwiseParallel, parallelize_module

    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    model = parallelize_module(nn.Sequential(nn.Linear(4, 4)), mesh["tp"], {"0": ColwiseParallel()})
    with pytest.raises(FSDPError, match=r"no data-parallel axis .* mesh=mesh\['dp'\]"):
        fully_shard(model, mesh=mesh["tp"])
    with pytest.raises(FSDPError, match="no data-parallel axis"):
        fully_shard(model, mesh=mesh)


@pytest.mark.world_size(2)
def test_mixed_meshes_step_per_mesh_and_their_joint_norm_is_refused(world) -> None:
    """One optimizer over two meshes steps each parameter on its own mesh;
    the total norm of both cannot be formed (MeshError on every rank)."""
    from dtensor.errors import MeshError

    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    fully_shard(a, mesh=DeviceMesh("cpu", [0, 1]))
    fully_shard(b, mesh=DeviceMesh("cpu", [1, 0]))
    torch.manual_seed(0)
    ref = [copy.deepcopy(m) for m in (a, b)]
    (a(torch.ones(1, 4)).sum() + b(torch.ones(1, 4)).sum()).backward()
    with pytest.raises(MeshError, match=r"different meshes.*redistribute"):
        nn.utils.clip_grad_norm_([*a.parameters(), *b.parameters()], 1.0)
    for m in ref:
        m(torch.ones(1, 4)).sum().backward()
        torch.optim.AdamW(m.parameters(), lr=0.1, foreach=True).step()
    torch.optim.AdamW([*a.parameters(), *b.parameters()], lr=0.1, foreach=True).step()
    for m, r in zip((a, b), ref, strict=True):
        for p, q in zip(m.parameters(), r.parameters(), strict=True):
            torch.testing.assert_close(p.detach().full_tensor(), q.detach().full_tensor())


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("option", "value"), [
    ("offload_policy", CPUOffloadPolicy()),
    ("shard_placement_fn", lambda p: Shard(1)),
    ("ignored_params", {1}),
    ("reshard_after_forward", 3),
])
def test_unsupported_options_name_themselves(world, option, value) -> None:
    with pytest.raises(FSDPError, match=option):
        fully_shard(MLP(), mesh=DeviceMesh("cpu", [0, 1]), **{option: value})

