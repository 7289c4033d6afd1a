"""Covers: dtensor/module.py (distribute_module) on a 2-rank Gloo world:
replication of what the partition function leaves, input/output hooks of 3
and (deprecated) 2 arguments, meta-device modules, and bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtensor import (
    DTensor,
    MeshError,
    Replicate,
    Shard,
    ShardingError,
    distribute_module,
    distribute_tensor,
)
from dtensor.parallel import PlanError


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        return self.lin(x) * self.scale


@pytest.mark.world_size(2)
def test_default_replicates_everything_from_the_first_rank(line_mesh, world) -> None:
    m = WithBuffer()
    with torch.no_grad():
        m.lin.weight.fill_(float(world.rank + 1))
    distribute_module(m, line_mesh(2))
    for name, t in [*m.named_parameters(), *m.named_buffers()]:
        assert isinstance(t, DTensor) and t.placements == (Replicate(),), name
    assert isinstance(m.lin.weight, nn.Parameter)
    assert torch.all(m.lin.weight.to_local() == 1.0)  # rank 0's values everywhere
    assert not m.frozen.requires_grad and m.lin.weight.requires_grad


@pytest.mark.world_size(2)
def test_partition_fn_input_fn_output_fn(line_mesh, world) -> None:
    mesh = line_mesh(2)
    seen = []

    def partition(name, mod, mesh):
        seen.append(name)
        if isinstance(mod, nn.Linear):
            mod.weight = nn.Parameter(distribute_tensor(mod.weight.detach(), mesh, [Shard(0)]))

    def input_fn(mod, inputs, mesh):
        return (DTensor.from_local(inputs[0], mesh, [Replicate()]),)

    def output_fn(mod, out, mesh):
        return out.full_tensor()

    torch.manual_seed(0)
    ref = WithBuffer()
    m = WithBuffer()
    m.load_state_dict(ref.state_dict())
    distribute_module(m, mesh, partition, input_fn, output_fn)
    assert seen == ["", "lin"]
    assert m.lin.weight.placements == (Shard(0),) and m.lin.bias.placements == (Replicate(),)
    x = torch.randn(2, 4)
    out = m(x)
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, ref(x))


@pytest.mark.world_size(2)
def test_two_argument_hooks_are_deprecated_but_work(line_mesh, world) -> None:
    mesh = line_mesh(2)
    with pytest.warns(FutureWarning, match="deprecated"):
        m = distribute_module(
            nn.Linear(2, 2), mesh,
            input_fn=lambda inputs, mesh: (DTensor.from_local(inputs[0], mesh, [Replicate()]),),
            output_fn=lambda out, mesh: out.to_local(),
        )
    out = m(torch.ones(1, 2))
    assert not isinstance(out, DTensor) and out.shape == (1, 2)


@pytest.mark.world_size(2)
def test_bad_input(line_mesh, world) -> None:
    mesh = line_mesh(2)
    with pytest.raises(PlanError, match="must take 3 arguments") as e:
        distribute_module(nn.Linear(2, 2), mesh, input_fn=lambda a, b, c, d: a)
    assert isinstance(e.value, ValueError)
    with pytest.raises(PlanError, match="output_fn must take 3 arguments"):
        distribute_module(nn.Linear(2, 2), mesh, output_fn=lambda a: a)
    m = distribute_module(nn.Linear(2, 2), mesh)
    with pytest.raises(ShardingError, match="already applied") as e:
        distribute_module(m, mesh)
    assert isinstance(e.value, RuntimeError)
    with pytest.raises(MeshError, match="no device_mesh"):
        distribute_module(nn.Linear(2, 2))
    with mesh:  # the current mesh is the default
        assert distribute_module(nn.Linear(2, 2)).weight.device_mesh == mesh


@pytest.mark.world_size(2)
def test_meta_module_is_laid_out_without_communication(line_mesh, world) -> None:
    from dtensor.debug import CommCounter

    mesh = line_mesh(2)
    with torch.device("meta"):
        m = nn.Linear(4, 6)

    with CommCounter() as c:
        distribute_module(m, mesh)
    assert c.total == 0
    assert m.weight.is_meta and m.weight.placements == (Replicate(),)
    m.to_empty(device="cpu")
    assert m.weight.to_local().shape == (6, 4) and not m.bias.is_meta


@pytest.mark.world_size(2)
def test_distribute_tensor_of_a_meta_tensor_is_a_meta_dtensor(line_mesh, world) -> None:
    from dtensor.debug import CommCounter

    t = torch.empty(5, 4, device="meta", requires_grad=True)
    with CommCounter() as c:
        x = distribute_tensor(t, line_mesh(2), [Shard(0)])
    assert c.total == 0
    assert isinstance(x, DTensor) and x.is_meta and x.shape == (5, 4)
    assert x.to_local().is_meta and x.to_local().shape == ((3, 4) if world.rank == 0 else (2, 4))
    assert x.requires_grad and x.is_leaf


@pytest.mark.world_size(2)
def test_meta_init_through_a_partition_fn_then_to_empty_and_init(
    line_mesh, world
) -> None:
    def shard_rows(name, mod, mesh):
        if isinstance(mod, nn.Linear):
            mod.weight = nn.Parameter(distribute_tensor(mod.weight, mesh, [Shard(0)]))

    with torch.device("meta"):
        m = nn.Linear(4, 6)
    distribute_module(m, line_mesh(2), shard_rows)
    assert m.weight.is_meta and m.weight.placements == (Shard(0),)
    m.to_empty(device="cpu")
    with torch.no_grad():
        m.weight.copy_(distribute_tensor(torch.arange(24.0).reshape(6, 4), line_mesh(2), [Shard(0)]))
        nn.init.ones_(m.bias)
    ref = nn.Linear(4, 6)
    with torch.no_grad():
        ref.weight.copy_(torch.arange(24.0).reshape(6, 4))
        ref.bias.fill_(1.0)
    x = torch.arange(8.0).reshape(2, 4)
    out = m(distribute_tensor(x, line_mesh(2), [Replicate()]))
    assert torch.allclose(out.full_tensor(), ref(x))


class _Hooks:
    def three(self, mod, io, mesh):
        return io

    def two(self, io, mesh):
        return io

    def defaulted(self, mod, io, mesh=None):
        return io

    def star(self, *args):
        return args


def _free(a, b, *, c):
    return a


def test_hook_argument_counts_match_inspect_for_methods_and_functions() -> None:
    """distribute_module reads a hook's argument count from its code (the
    parallel styles pass bound methods); every shape of callable counts as
    inspect.signature counts it."""
    import functools
    import inspect

    from dtensor.module import _arg_count

    h = _Hooks()
    for fn in (h.three, h.two, h.defaulted, h.star, _free, lambda m, i, d: i,
               lambda i, d: i, functools.partial(_free, 1), _Hooks.three, print):
        try:
            want = len(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            want = 3
        assert _arg_count(fn) == want, fn
