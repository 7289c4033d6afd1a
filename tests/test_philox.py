"""Covers: dtensor/_philox.py and the counter mapping of dtensor/random.py
(pure; no process group): Random123's known answers for philox4x32-10, the
batched and wide-counter forms, and the documented mapping from a global
element index to its stream words, up to indices near 2**40; draws under
FakeTensorMode next to eager draws in one thread."""

from __future__ import annotations

import math

import pytest
import torch

import dtensor._philox as P
import dtensor.random as R

M32 = 0xFFFFFFFF


KATS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("ctr", "key", "expected"), KATS)
def test_philox_known_answers(ctr: tuple, key: tuple, expected: tuple) -> None:
    c = torch.tensor(ctr, dtype=torch.int64)
    assert tuple(R.philox4x32(c, key).tolist()) == expected
    assert tuple(R.philox4x32(c, torch.tensor(key)).tolist()) == expected
    assert c.tolist() == list(ctr)  # input untouched


def test_philox_batched_and_broadcast_key() -> None:
    ctrs = torch.tensor([k[0] for k in KATS], dtype=torch.int64)
    keys = torch.tensor([k[1] for k in KATS], dtype=torch.int64)
    assert R.philox4x32(ctrs, keys).tolist() == [list(k[2]) for k in KATS]
    both = R.philox4x32(ctrs[:1].expand(3, 4), torch.tensor([0, 0]))
    assert both.tolist() == [list(KATS[0][2])] * 3


def test_fast_philox_matches_reference_for_wide_counters() -> None:
    g = torch.tensor([0, 1, 5, 2**32 - 1, 2**32, 2**40 + 7, 2**62 + 3])
    seed, offset = 0x0123456789ABCDEF, 0xFEDCBA9876543210
    ctr = torch.stack(
        [g & M32, g >> 32, torch.full_like(g, offset & M32), torch.full_like(g, offset >> 32)], -1
    )
    expected = R.philox4x32(ctr, (seed & M32, seed >> 32))
    assert torch.equal(P._philox_groups(g.clone(), None, offset, seed), expected)
    small = g[:4]
    assert torch.equal(P._philox_groups(small.clone(), 0, offset, seed), expected[:4])


def test_documented_counter_mapping() -> None:
    """Element i of a float32 uniform op is word i of the (seed, offset) stream."""
    seed, offset, shape = 2**40 + 17, 3 * 2**32 + 5, (3, 7)
    n = math.prod(shape)
    i = torch.arange(n)
    ctr = torch.stack(
        [(i >> 2) & M32, i >> 34, torch.full_like(i, offset & M32), torch.full_like(i, offset >> 32)],
        -1,
    )
    words = R.philox4x32(ctr, (seed & M32, seed >> 32)).gather(1, (i & 3)[:, None])[:, 0]
    expected = ((words >> 8).double() * 2.0**-24).float().reshape(shape)
    got = R.uniform_block(seed, offset, shape, (0, 0), shape, dtype=torch.float32)
    assert torch.equal(got, expected)


def _reference_words(seed: int, offset: int, idx: torch.Tensor, w: int) -> torch.Tensor:
    """Words ``[..., w]`` of elements ``idx`` straight from the documented mapping."""
    k = idx.unsqueeze(-1) * w + torch.arange(w)  # stream word numbers
    g = k >> 2
    ctr = torch.stack(
        [g & M32, g >> 32, torch.full_like(g, offset & M32), torch.full_like(g, offset >> 32)], -1
    )
    out = R.philox4x32(ctr, (seed & M32, seed >> 32))  # [..., w, 4]
    return out.gather(-1, (k & 3).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize(
    ("lo", "ls"),
    [((2**20 - 3, 2**20 - 5), (3, 5)), ((7, 0), (2, 2**20)), ((2**19, 11), (1, 9))],
)
def test_blocks_of_a_huge_global_tensor_follow_the_mapping(lo: tuple, ls: tuple) -> None:
    """Global indices near 2**40: the counter's high word is used (not allocated)."""
    gs, seed, offset = (2**20, 2**20), 99, 2**63 + 1
    idx = R.global_indices(gs, lo, ls)
    if idx.numel() > 4096:  # check a few thousand elements only
        idx, sl = idx[:, :2048], (slice(None), slice(0, 2048))
    else:
        sl = (slice(None), slice(None))
    f32 = ((_reference_words(seed, offset, idx, 1)[..., 0] >> 8).double() * 2.0**-24).float()
    assert torch.equal(R.uniform_block(seed, offset, gs, lo, ls)[sl], f32)
    w2 = _reference_words(seed, offset, idx, 2)
    f64 = ((w2[..., 0] << 21) | (w2[..., 1] >> 11)).double() * 2.0**-53
    assert torch.equal(R.uniform_block(seed, offset, gs, lo, ls, dtype=torch.float64)[sl], f64)


def test_global_indices() -> None:
    assert R.global_indices((3, 4), (1, 2), (2, 2)).tolist() == [[6, 7], [10, 11]]
    assert R.global_indices((), (), ()).tolist() == 0
    assert R.global_indices((3, 0), (1, 0), (2, 0)).shape == (2, 0)
    with pytest.raises(ValueError, match="dim 1"):
        R.global_indices((3, 4), (0, 3), (1, 2))


@pytest.mark.parametrize("low", [-(2**63), -3, -1])
def test_int64_spans_above_2_63_use_all_64_bits(low: int) -> None:
    """``random_(from)`` on int64 with ``from < 0`` spans more than 2**63 values:
    element i is ``low + (u % span)`` with ``u = w0 << 32 | w1`` (64 bits)."""
    high, seed, offset = 2**63, 5, 11
    span = high - low
    gs = (3, 50)
    got = R.randint_block(seed, offset, gs, (0, 0), gs, low=low, high=high)
    words = _reference_words(seed, offset, torch.arange(150), 2).tolist()
    expected = [low + ((w0 << 32 | w1) % span) for w0, w1 in words]
    assert got.flatten().tolist() == expected
    part = R.randint_block(seed, offset, gs, (1, 7), (2, 30), low=low, high=high)
    assert torch.equal(part, got[1:, 7:37])
    with pytest.raises(ValueError, match=r"2\*\*64"):
        R.randint_block(seed, offset, gs, (0, 0), gs, low=-(2**63) - 1, high=high)


@pytest.mark.parametrize("eager_first", [True, False])
def test_draws_under_fake_tensors_leave_eager_draws_alone(eager_first: bool) -> None:
    # export, torch.compile's tracing and memory estimators draw under
    # FakeTensorMode in the same thread as eager draws
    from torch._subclasses import FakeTensorMode

    x = torch.randn(64, 64)

    def eager() -> torch.Tensor:
        R.manual_seed(3)
        return R.dropout(x, 0.3)

    first = eager() if eager_first else None
    with FakeTensorMode() as mode:
        for _ in range(2):
            got = R.dropout(mode.from_tensor(x), 0.3)
            assert got.shape == x.shape and type(got).__name__ == "FakeTensor"
    again = eager()
    assert type(again) is torch.Tensor
    if first is not None:
        assert torch.equal(first, again)
    assert 0.5 < (again == 0).float().mean().item() / 0.3 < 1.5
