"""Covers: the ``prod`` rule of dtensor/rules/reduction.py on Gloo worlds: a
product over a sharded dim is ``Partial(product)`` of the local products, so
the op sends nothing and the result's first use sends one all-reduce of the
output (one element for a whole-tensor prod) where the replicate fallback
gathered the input (docs/fallback_bytes.md: 300 B vs PyTorch's 4 B). Values
equal single device for float32 (tolerance) and int64/bool/int32 (exact),
over all dims and one, keepdim, uneven and empty shards, a ``dtype=``
argument, a 2-D mesh, Partial(sum) inputs (reduced first) and
Partial(product) inputs (kept when the dtype stays; reduced first when prod
widens it). Complex products keep the fallback (Partial(product) refuses
complex values)."""

from __future__ import annotations

import pytest
import torch

from dtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommCounter

WORLDS = pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.world_size(n), id=f"w{n}") for n in (2, 4)]
)
PRODUCT = Partial("product")


def _values(shape, dtype, seed: int = 0) -> torch.Tensor:
    """Values whose products neither overflow nor vanish; ints without zeros
    (a zero would hide a wrong product), bools mostly true."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (1 + 0.2 * torch.randn(shape, generator=g)).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.9
    choices = torch.tensor([-2, -1, 1, 2, 3])
    return choices[torch.randint(0, 5, shape, generator=g)].to(dtype)


def _check(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (where, got, want)
    exact = not want.dtype.is_floating_point
    tol = {"atol": 0, "rtol": 0} if exact else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{where}: {m}")


def _calls():
    """(name, fn, reduced dims or None for all, keepdim)."""
    return [
        ("prod()", lambda t: t.prod(), None, False),
        ("prod(0)", lambda t: t.prod(0), 0, False),
        ("prod(1, keepdim)", lambda t: t.prod(1, keepdim=True), 1, True),
        ("prod(-1)", lambda t: t.prod(-1), 1, False),
    ]


@WORLDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("shape", [(8, 4), (5, 3), (1, 3), (0, 3)],
                         ids=["even", "uneven", "empty-shards", "empty"])
def test_prod_of_shards_equals_single_device_and_never_gathers(line_mesh, world, n, dtype, shape) -> None:
    x = _values(shape, dtype)
    mesh = line_mesh(n)
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        d = distribute_tensor(x, mesh, placements)
        for name, fn, dim, keepdim in _calls():
            where = f"{name} of {dtype} {shape} on {placements}"
            want = fn(x)
            with CommCounter() as c:
                got = fn(d)
            assert c.counts == {}, (where, c.counts)  # the op itself is local
            p = placements[0]
            if isinstance(p, Shard) and (dim is None or dim == p.dim):
                assert got.placements == (PRODUCT,), (where, got.placements)
                with CommCounter() as c:
                    full = got.full_tensor()
                # the output's elements, once, on the wire (an empty output: nothing)
                nbytes = want.numel() * want.element_size()
                assert c.bytes == ({"all_reduce": nbytes} if nbytes else {}), (where, c.bytes)
            else:
                kept = p if not isinstance(p, Shard) or keepdim else Shard(p.dim - (dim < p.dim))
                assert got.placements == (kept,), (where, got.placements)
                full = got.full_tensor()
            _check(full, want, where)


@WORLDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool], ids=str)
def test_whole_tensor_prod_sends_one_element(line_mesh, world, n, dtype) -> None:
    """The audit's case: what the fallback all-gathered is one all-reduce of
    one element (4 B float32; int64 and bool products are int64: 8 B)."""
    x = _values((5, 4, 3), dtype, seed=1)
    for d in range(3):
        dx = distribute_tensor(x, line_mesh(n), [Shard(d)])
        with CommCounter() as c:
            got = dx.prod().full_tensor()
        want = x.prod()
        assert c.bytes == {"all_reduce": want.element_size()}, (dtype, d, c.bytes)
        _check(got, want, f"prod() of {dtype} S({d})")


@WORLDS
def test_prod_dtype_argument_and_promotion(line_mesh, world, n) -> None:
    mesh = line_mesh(n)
    cases = [
        (torch.float32, torch.float64),
        (torch.int64, torch.float32),
        (torch.int32, None),  # int32 products are int64
        (torch.int32, torch.int32),
        (torch.bool, torch.float32),
        (torch.uint8, None),
        (torch.float32, torch.bfloat16),
    ]
    for src, dtype in cases:
        x = _values((7, 3), src, seed=2)
        dx = distribute_tensor(x, mesh, [Shard(0)])
        kw = {} if dtype is None else {"dtype": dtype}
        for name, fn in (("prod", lambda t: t.prod(**kw)),
                         ("prod(0)", lambda t: t.prod(0, **kw))):
            where = f"{name} of {src} dtype={dtype}"
            want = fn(x)
            with CommCounter() as c:
                got = fn(dx)
                full = got.full_tensor()
            assert got.placements == (PRODUCT,), where
            assert c.bytes == {"all_reduce": want.numel() * want.element_size()}, (where, c.bytes)
            if want.dtype == torch.bfloat16:  # rounding of the pieces' products
                assert full.dtype == want.dtype
                torch.testing.assert_close(full.float(), want.float(), atol=0.02, rtol=0.02)
            else:
                _check(full, want, where)


@WORLDS
def test_complex_prod_keeps_the_fallback(line_mesh, world, n) -> None:
    """Partial(product) cannot multiply complex pieces: the dim is gathered
    and the value is still the single-device product."""
    mesh = line_mesh(n)
    g = torch.Generator().manual_seed(3)
    z = torch.complex(1 + 0.1 * torch.randn(6, 2, generator=g), 0.1 * torch.randn(6, 2, generator=g))
    dz = distribute_tensor(z, mesh, [Shard(0)])
    for fn in (lambda t: t.prod(), lambda t: t.prod(0)):
        got = fn(dz)
        assert got.placements == (Replicate(),)
        torch.testing.assert_close(got.full_tensor(), fn(z))
    x = _values((6, 2), torch.float32, seed=3)
    got = distribute_tensor(x, mesh, [Shard(0)]).prod(dtype=torch.complex64)
    assert got.placements == (Replicate(),)
    torch.testing.assert_close(got.full_tensor(), x.prod(dtype=torch.complex64))


@pytest.mark.world_size(4)
def test_prod_on_a_2d_mesh(line_mesh, world) -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    for dtype in (torch.float32, torch.int64):
        x = _values((5, 3), dtype, seed=4)
        d = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
        with CommCounter() as c:
            got = d.prod()
        assert c.counts == {} and got.placements == (PRODUCT, PRODUCT)
        with CommCounter() as c:
            full = got.full_tensor()
        # both mesh axes reduce in one all-reduce of one element
        assert c.bytes == {"all_reduce": x.element_size()}, (dtype, c.bytes)
        _check(full, x.prod(), f"prod() of {dtype} (S(0), S(1))")
        got = d.prod(0)  # dim 1 keeps its shard, now dim 0 of the result
        assert got.placements == (PRODUCT, Shard(0))
        _check(got.full_tensor(), x.prod(0), f"prod(0) of {dtype} (S(0), S(1))")
        got = distribute_tensor(x, mesh, [Shard(0), Replicate()]).prod(1, keepdim=True)
        assert got.placements == (Shard(0), Replicate())
        _check(got.full_tensor(), x.prod(1, keepdim=True), f"prod(1) of {dtype} (S(0), R)")
        # a partial sum is reduced first; the shard on the other axis stays a piece
        part = distribute_tensor(x, mesh, [Partial(), Shard(0)])
        got = part.prod()
        assert got.placements == (Replicate(), PRODUCT)
        _check(got.full_tensor(), x.prod(), f"prod() of {dtype} (P(sum), S(0))")


@WORLDS
def test_prod_of_partial_values(line_mesh, world, n) -> None:
    mesh = line_mesh(n)
    x = _values((6, 3), torch.float32, seed=5)
    # a product of partial sums is not the product: reduce first
    for dim in (None, 0, 1):
        fn = (lambda t: t.prod()) if dim is None else (lambda t, dim=dim: t.prod(dim))
        got = fn(distribute_tensor(x, mesh, [Partial()]))
        assert got.placements == (Replicate(),), dim
        _check(got.full_tensor(), fn(x), f"prod({dim}) of P(sum)")
    # product pieces stay pieces (the product of products is the product)
    for dtype in (torch.float32, torch.int64):
        y = _values((6, 3), dtype, seed=6)
        dy = distribute_tensor(y, mesh, [PRODUCT])
        with CommCounter() as c:
            got = dy.prod(1)
        assert c.counts == {} and got.placements == (PRODUCT,), dtype
        _check(got.full_tensor(), y.prod(1), f"prod(1) of {dtype} P(product)")
    # int32 pieces whose product wraps in int32: prod's int64 must see the
    # wrapped value, so the pieces are multiplied (in int32) first
    a = torch.tensor([65537, 1], dtype=torch.int32)  # 65537**2 = 2**32 + 2**17 + 1
    piece = a if world.rank < 2 else torch.ones(2, dtype=torch.int32)
    dp = DTensor.from_local(piece, mesh, [PRODUCT])
    whole = a * a
    assert whole.tolist() == [(1 << 17) + 1, 1]  # wrapped
    got = dp.prod()
    assert got.dtype == torch.int64
    _check(got.full_tensor(), whole.prod(), "prod() of int32 P(product) that wraps")
