"""Covers: dtensor/_arith.py on Gloo worlds. DTensor operators that skip the
C round trip must give what the C path gives (spec, dtype, strides, local
values, the same call-table entries: the same overload and arguments), and
must take the C path wherever a layer between them has work: a gradient to
record, a dispatch or function mode, autocast."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommCounter
from dtensor.dispatch.cache import TABLE, forget


OPS = {
    "x + s": operator.add, "s + x": lambda x, s: operator.add(s, x),
    "x - s": operator.sub, "s - x": lambda x, s: operator.sub(s, x),
    "x * s": operator.mul, "s * x": lambda x, s: operator.mul(s, x),
    "x / s": operator.truediv, "s / x": lambda x, s: operator.truediv(s, x),
}
# The same expressions through torch.Tensor's C operators (the path the
# DTensor's own operators skip).
C_OPS = {
    "x + s": torch.Tensor.__add__, "s + x": torch.Tensor.__radd__,
    "x - s": torch.Tensor.__sub__, "s - x": torch.Tensor.__rsub__,
    "x * s": torch.Tensor.__mul__, "s * x": torch.Tensor.__rmul__,
    "x / s": torch.Tensor.__truediv__, "s / x": torch.Tensor.__rtruediv__,
}
SCALARS = [3, 2.5, True, 1 + 2j]
LAYOUTS = [[Replicate()], [Shard(0)], [Shard(1)], [Partial()]]


def _same(a: DTensor, b: DTensor, what: str) -> None:
    assert type(a) is type(b) is DTensor, what
    assert a._spec == b._spec, (what, str(a._spec), str(b._spec))
    assert a.stride() == b.stride() and a.dtype == b.dtype, what
    assert torch.equal(a.to_local(), b.to_local()), what


@pytest.mark.world_size(2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_operators_equal_the_c_path_with_the_same_calls(line_mesh, world, dtype) -> None:
    mesh = line_mesh(2)
    full = torch.arange(1, 13, dtype=dtype).reshape(4, 3)
    for placements in LAYOUTS:
        x = distribute_tensor(full, mesh, placements)
        for name, op in OPS.items():
            for s in SCALARS:
                what = f"{name} with s={s!r} on {placements} {dtype}"
                forget()
                try:
                    want = C_OPS[name](x, s)
                except Exception as e:  # the same refusal either way
                    with pytest.raises(type(e)):
                        op(x, s)
                    continue
                c_keys = set(TABLE)
                forget()
                got = op(x, s)
                assert set(TABLE) == c_keys, what  # same overloads, same argument kinds
                _same(got, want, what)
        y = distribute_tensor(full.flip(0), mesh, placements)
        for name, op in (("+", operator.add), ("-", operator.sub), ("*", operator.mul),
                         ("/", operator.truediv)):
            c = {"+": torch.Tensor.__add__, "-": torch.Tensor.__sub__,
                 "*": torch.Tensor.__mul__, "/": torch.Tensor.__truediv__}[name]
            _same(op(x, y), c(x, y), f"x {name} y on {placements}")
        _same(-x, torch.Tensor.__neg__(x), f"-x on {placements}")


@pytest.mark.world_size(2)
def test_a_partial_operand_is_reduced_once_as_on_the_c_path(line_mesh, world) -> None:
    mesh = line_mesh(2)
    p = DTensor.from_local(torch.tensor([1.0, 2.0]) * (world.rank + 1), mesh, [Partial()])
    with CommCounter() as c:
        r = 2.0 / (p + 1e-6)
    assert c.counts == {"all_reduce": 1}, c.counts
    assert r.placements == (Replicate(),)
    torch.testing.assert_close(r.to_local(), 2.0 / (torch.tensor([3.0, 6.0]) + 1e-6))


@pytest.mark.world_size(2)
def test_gradients_modes_and_autocast_take_the_c_path(line_mesh, world) -> None:
    mesh = line_mesh(2)
    x = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    w = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]).requires_grad_()
    # A gradient to record: the C path builds the graph.
    for out in (w * 2.0, 2.0 * w, x * w, w + x, 1.0 / w, -w, 1 - w):
        assert out.grad_fn is not None, out
    (w * 3.0).sum().backward()
    torch.testing.assert_close(w.grad.full_tensor(), torch.full((4, 3), 3.0))
    with torch.no_grad():
        assert (w * 2.0).grad_fn is None

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        x + 1.0, 2.0 / x, -x
    assert seen.ops == [torch.ops.aten.add.Tensor, torch.ops.aten.reciprocal.default,
                        torch.ops.aten.mul.Tensor, torch.ops.aten.neg.default], seen.ops

    class Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Calls() as calls:
        x * 2.0, x - x
    assert calls.names == ["mul", "sub"], calls.names  # the user's calls, none of ours

    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = x * 2.0  # autocast has no policy for mul: same value, via the C path
    assert r.dtype == torch.float32


@pytest.mark.world_size(2)
def test_forward_ad_levels_and_functorch_transforms_take_the_c_path(line_mesh, world, monkeypatch) -> None:
    """Tangents and transform wrappers live in the layers the operators skip:
    under a forward-AD dual level or inside a functorch transform the C path
    runs (it reaches ``DTensor.__torch_dispatch__``; the direct call does not)."""
    import torch.autograd.forward_ad as fwAD

    import dtensor.tensor

    mesh = line_mesh(2)
    x = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    entered = []
    real = dtensor.tensor._dispatch
    monkeypatch.setattr(dtensor.tensor, "_dispatch",
                        lambda f, a, k: entered.append(f) or real(f, a, k))
    x * 2.0, 1.0 - x, -x
    assert entered == [], entered  # no layer busy: the direct call
    with fwAD.dual_level():
        x * 2.0
    assert entered == [torch.ops.aten.mul.Tensor], entered
    entered.clear()

    def body(v):
        y = 3.0 * x  # an unbatched DTensor under vmap
        assert isinstance(y, DTensor)
        return v

    torch.func.vmap(body)(torch.zeros(3))
    assert entered == [torch.ops.aten.mul.Tensor], entered
