"""Covers: torch.optim and torch.nn.utils on DTensor parameters (with
dtensor/parallel/ and dtensor/module.py): SGD, Adam, AdamW with foreach and
without (fused=False), clip_grad_norm_, zero_grad, gradient accumulation, and
meta-device init followed by to_empty + reset_parameters; all against the
single-device run."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import dtensor
from dtensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor
from dtensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

WORLDS = pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.world_size(n), id=f"w{n}") for n in (2, 4)]
)
TOL = {"atol": 1e-5, "rtol": 1e-5}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.down = nn.Linear(8, 6)

    def forward(self, x):
        return self.down(torch.relu(self.norm(self.up(x))))


# Batch-sharded norm between a column- and a row-parallel linear: every kind of
# layout (S(0), S(1), R) among the parameters and their gradients.
PLAN = {"up": ColwiseParallel(output_layouts=Shard(0), use_local_output=False),
        "norm": SequenceParallel(sequence_dim=0),
        "down": RowwiseParallel(input_layouts=Shard(0))}


def _pair(n: int):
    torch.manual_seed(0)
    ref = Net()
    with torch.no_grad():
        for p in ref.norm.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return ref, parallelize_module(copy.deepcopy(ref), DeviceMesh("cpu", list(range(n))), PLAN)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss(model, x):
    return model(x).pow(2).mean()


def _check_params(model, ref, tol=TOL) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert isinstance(p, DTensor), name
        torch.testing.assert_close(_full(p.detach()), q.detach(), **tol,
                                   msg=lambda m, name=name: f"{name}: {m}")


OPTIMIZERS = {
    "sgd": lambda ps, fe: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=fe),
    "adam": lambda ps, fe: torch.optim.Adam(ps, lr=0.05, foreach=fe, fused=False),
    "adamw": lambda ps, fe: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, foreach=fe,
                                              fused=False),
    "adamw_amsgrad": lambda ps, fe: torch.optim.AdamW(ps, lr=0.05, amsgrad=True, foreach=fe),
}


@WORLDS
@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "loop"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizers_step_like_single_device(world, n, name, foreach) -> None:
    ref, model = _pair(n)
    opt_ref = OPTIMIZERS[name](ref.parameters(), foreach)
    opt = OPTIMIZERS[name](model.parameters(), foreach)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 6, generator=g)
        for m, o in ((ref, opt_ref), (model, opt)):
            _loss(m, x).backward()
            o.step()
            o.zero_grad()
    _check_params(model, ref, {"atol": 2e-5, "rtol": 1e-4})
    state = opt.state[model.up.weight]
    assert isinstance(state["exp_avg" if "adam" in name else "momentum_buffer"], DTensor)
    assert model.up.weight.placements == (Shard(0),)  # layouts survive the steps


@WORLDS
@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "loop"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_total_norm_equals_single_device(world, n, foreach, norm_type) -> None:
    ref, model = _pair(n)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    _loss(ref, x).backward()
    _loss(model, x).backward()
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())
    want = nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type=norm_type, foreach=foreach)
    got = nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type=norm_type, foreach=foreach)
    assert want > 0.01  # the clip changes the gradients
    torch.testing.assert_close(_full(got), want, **TOL)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(_full(p.grad), q.grad, **TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.world_size(2)
def test_zero_grad_and_gradient_accumulation(world) -> None:
    ref, model = _pair(2)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 6, generator=g) for _ in range(3)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for m in (model, ref):
        for x in xs:  # three micro-batches, one step
            (_loss(m, x) / len(xs)).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(_full(p.grad), q.grad, **TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    opt.step()
    opt_ref.step()
    _check_params(model, ref)
    opt.zero_grad(set_to_none=False)
    for p in model.parameters():
        assert isinstance(p.grad, DTensor) and not torch.any(_full(p.grad))
    assert model.up.weight.grad.placements == (Shard(0),)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@WORLDS
@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_meta_init_to_empty_reset_parameters(world, n, style) -> None:
    mesh = DeviceMesh("cpu", list(range(n)))
    with torch.device("meta"):
        lin = nn.Linear(8, 8)
    parallelize_module(lin, mesh, ColwiseParallel() if style == "colwise" else RowwiseParallel())
    assert lin.weight.is_meta and isinstance(lin.weight, DTensor)
    lin.to_empty(device="cpu")
    assert not lin.weight.is_meta and lin.weight.to_local().device.type == "cpu"
    dtensor.random.manual_seed(5)
    lin.reset_parameters()  # kaiming_uniform_ / uniform_ on DTensors: dtensor's generator
    bound = 1 / math.sqrt(8)
    dtensor.random.manual_seed(5)
    want_w = dtensor.random.uniform_(torch.empty(8, 8), -bound, bound)
    want_b = dtensor.random.uniform_(torch.empty(8), -bound, bound)
    assert torch.equal(lin.weight.full_tensor(), want_w)  # bit for bit, any layout
    assert torch.equal(lin.bias.full_tensor(), want_b)
    x = torch.randn(3, 8)
    dx = distribute_tensor(x, mesh, [Replicate()]).to_local()
    if style == "rowwise":
        dx = dx.chunk(n, dim=-1)[world.rank]
    out = lin(dx)
    full = out if style == "rowwise" else DTensor.from_local(out, mesh, [Shard(1)]).full_tensor()
    torch.testing.assert_close(full, torch.nn.functional.linear(x, want_w, want_b), **TOL)


@WORLDS
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_default_flags_one_scalar_all_reduce(world, n, norm_type) -> None:
    """foreach=None (the default) takes the foreach path for DTensors: the
    S(0)/S(1) gradients' norms stay norm pieces until the total is used, so
    the clip sends one all-reduce of one scalar, nothing is gathered, and the
    gradients equal single-device clipping."""
    from dtensor.debug import CommCounter

    ref, model = _pair(n)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    _loss(ref, x).backward()
    _loss(model, x).backward()
    placements = {p.grad.placements for p in model.parameters()}
    assert {(Shard(0),), (Shard(1),), (Replicate(),)} <= placements  # mixed
    want = nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type=norm_type)
    with CommCounter() as c:
        got = nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type=norm_type)
    assert c.counts == {"all_reduce": 1} and c.bytes == {"all_reduce": 4}, (c.counts, c.bytes)
    torch.testing.assert_close(_full(got), want, **TOL)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert p.grad.placements == p.placements, name
        torch.testing.assert_close(_full(p.grad), q.grad, **TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    with CommCounter() as c:
        nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        total = nn.utils.get_total_norm([p.grad for p in model.parameters()])
    nn.utils.clip_grad_value_(ref.parameters(), 1e-3)
    assert c.total == 0, c.counts  # the total stays norm pieces until read
    with CommCounter() as c:
        got_total = total.full_tensor()
    assert c.counts == {"all_reduce": 1} and c.bytes == {"all_reduce": 4}, (c.counts, c.bytes)
    torch.testing.assert_close(
        got_total, nn.utils.get_total_norm([p.grad for p in ref.parameters()]), **TOL)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(_full(p.grad), q.grad, **TOL)


DEFAULTS = {
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "sgd", "_multi_tensor_sgd"),
    "adam": (lambda ps: torch.optim.Adam(ps, lr=0.05), "adam", "_multi_tensor_adam"),
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=0.05), "adam", "_multi_tensor_adam"),
}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("name", list(DEFAULTS))
def test_default_flag_optimizers_take_the_foreach_path(world, name, monkeypatch) -> None:
    """Default flags (foreach=None) on DTensor parameters: each step runs the
    foreach implementation (one dispatch per op for the whole list, not one
    per parameter; dtensor/_optim.py), equal to single device, with no
    communication, and the user's flag reads None again after the step. A
    group holding a plain tensor keeps torch's per-parameter loop."""
    import importlib

    from dtensor.debug import CommCounter

    make, module, multi = DEFAULTS[name]
    mod = importlib.import_module(f"torch.optim.{module}")
    calls = []
    real = getattr(mod, multi)
    monkeypatch.setattr(mod, multi, lambda *a, **k: calls.append(1) or real(*a, **k))
    ref, model = _pair(2)
    opt_ref, opt = make(ref.parameters()), make(model.parameters())
    g = torch.Generator().manual_seed(6)
    for step in range(3):
        x = torch.randn(4, 6, generator=g)
        _loss(ref, x).backward()
        opt_ref.step()  # plain CPU tensors: torch's loop (no foreach call)
        opt_ref.zero_grad()
        _loss(model, x).backward()
        with CommCounter() as c:
            opt.step()
        opt.zero_grad()
        assert c.total == 0, c.counts
        assert len(calls) == step + 1
        assert opt.param_groups[0]["foreach"] is None
    _check_params(model, ref, {"atol": 2e-5, "rtol": 1e-4})
    mixed = make([*model.parameters(), nn.Parameter(torch.ones(3))])
    _loss(model, torch.randn(4, 6, generator=g)).backward()
    mixed.param_groups[0]["params"][-1].grad = torch.ones(3)
    mixed.step()
    assert len(calls) == 3


@pytest.mark.world_size(2)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_foreach_optimizer_step_never_communicates(world, name) -> None:
    from dtensor.debug import CommCounter

    _, model = _pair(2)
    opt = OPTIMIZERS[name](model.parameters(), True)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(4))
    for _ in range(2):
        _loss(model, x).backward()
        with CommCounter() as c:
            opt.step()
        opt.zero_grad()
        assert c.total == 0, c.counts


FUSED = {
    "sgd": lambda ps, fused: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=fused),
    "adam": lambda ps, fused: torch.optim.Adam(ps, lr=0.05, fused=fused),
    "adamw": lambda ps, fused: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, fused=fused),
    "adamw_amsgrad": lambda ps, fused: torch.optim.AdamW(ps, lr=0.05, amsgrad=True, fused=fused),
}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("name", list(FUSED))
def test_fused_optimizers_on_cpu_equal_unfused_without_communicating(world, name) -> None:
    from dtensor.debug import CommCounter

    ref, model = _pair(2)
    opt_ref = FUSED[name](ref.parameters(), False)
    opt = FUSED[name](model.parameters(), True)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(4, 6, generator=g)
        _loss(ref, x).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        _loss(model, x).backward()
        with CommCounter() as c:
            opt.step()
        opt.zero_grad()
        assert c.total == 0, c.counts
    _check_params(model, ref, {"atol": 2e-5, "rtol": 1e-4})
    assert model.up.weight.placements == (Shard(0),)
