"""Sharding-invariant counter-based random numbers (Philox4x32-10).

Every random value is a pure function of ``(seed, offset, global element index)``:

* the **key** is the 64-bit seed split into two 32-bit words
  ``(seed & 0xffffffff, seed >> 32)`` (the seed is taken modulo ``2**64``);
* an op reads a **word stream**: word ``k`` of the stream for counter base
  ``offset`` is word ``k % 4`` of ``philox4x32_10(counter, key)`` with
  ``counter = (g & 0xffffffff, g >> 32, offset & 0xffffffff, offset >> 32)``
  and ``g = k // 4``;
* an op that consumes ``w`` 32-bit words per element (``w`` depends only on the
  op and the dtype: 1, 2 or 4) gives element ``i`` (row-major linear index in
  the *global* shape) the words ``w*i .. w*i + w - 1`` of that stream.

So any rectangular block of the global tensor can be generated on its own and
the blocks of any partition stitch to the single-device result bit for bit.
Each op advances the offset by exactly 1 (the global index lives in the
counter, so one offset step is a fresh stream of ``2**66`` words).

Pure block functions (``*_block``) take the state explicitly; the stateful
front end (``manual_seed``, ``next_offset``, ``rand``, ``dropout``, ...) keeps a
process-global ``RNGState`` that every rank must advance identically.

Example:
    >>> x = uniform_block(0, 0, (4, 6), (0, 0), (4, 6), dtype=torch.float32)
    >>> top = uniform_block(0, 0, (4, 6), (0, 0), (2, 6), dtype=torch.float32)
    >>> torch.equal(x[:2], top)
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

__all__ = [
    "RNGState",
    "bernoulli",
    "bernoulli_block",
    "dropout",
    "dropout_mask_block",
    "exponential_",
    "exponential_block",
    "fork_rng",
    "get_rng_state",
    "global_indices",
    "manual_seed",
    "next_offset",
    "normal_",
    "normal_block",
    "philox4x32",
    "rand",
    "randint",
    "randint_block",
    "randn",
    "random_",
    "random_block",
    "seed_fingerprint",
    "set_rng_state",
    "uniform_",
    "uniform_block",
]

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers (Random123)
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
PHILOX_ROUNDS = 10
_CHUNK = 1 << 17  # counters per pass: bounds temporaries; fewer passes = less dispatch

Word = int | Tensor

# ---------------------------------------------------------------------------
# Philox4x32-10 on int64 tensors holding 32-bit words
# ---------------------------------------------------------------------------
# NOTE: int64 products of two 32-bit words wrap modulo 2**64 in torch, which keeps
# all 64 bits of the unsigned product; ">> 32" is arithmetic, so the high word is
# masked after it has been xor-ed (masking once is enough: & distributes over ^).
# Words called "b" below may carry garbage above bit 31 (they are raw products);
# words called "a" (multiplicands) are always masked.


def _mix(p: Word, b: Word, k: Word, scratch: Tensor | None) -> Word:
    """``(hi32(p) ^ b ^ k) & M32``; may overwrite ``b`` (never ``p``)."""
    if isinstance(p, int):
        if isinstance(b, int):
            return ((p >> 32) ^ b ^ k) & _M32
        b ^= ((p >> 32) ^ k) & _M32 if isinstance(k, int) else (k ^ (p >> 32))
        return b.bitwise_and_(_M32)
    if isinstance(b, int):
        t = p >> 32
        t ^= (b ^ k) & _M32 if isinstance(k, int) else (k ^ (b & _M32))
        return t.bitwise_and_(_M32)
    if scratch is not None and scratch.shape == p.shape:
        torch.bitwise_right_shift(p, 32, out=scratch)
        b ^= scratch
    else:
        b ^= p >> 32
    b ^= k
    return b.bitwise_and_(_M32)


def _mul(a: Word, m: int) -> Word:
    return a * m if isinstance(a, int) else a.mul_(m)


def _philox_owned(
    a0: Word, b1: Word, a2: Word, b3: Word, k0: Word, k1: Word, scratch: Tensor | None
) -> tuple[Word, Word, Word, Word]:
    """Philox4x32-10 rounds. Tensor arguments are owned and overwritten."""
    for r in range(PHILOX_ROUNDS):
        if r:
            k0 = (k0 + PHILOX_W0) & _M32
            k1 = (k1 + PHILOX_W1) & _M32
        p0 = _mul(a0, PHILOX_M0)
        p1 = _mul(a2, PHILOX_M1)
        a0, a2 = _mix(p1, b1, k0, scratch), _mix(p0, b3, k1, scratch)
        b1, b3 = p1, p0
    return a0, b1 & _M32, a2, b3 & _M32


def philox4x32(counter: Tensor, key: Tensor | tuple[int, int]) -> Tensor:
    """Philox4x32-10 of ``counter`` (``[..., 4]``) under ``key`` (``[..., 2]``).

    Words are 32-bit unsigned values stored in int64 tensors (word 0 first, as in
    Random123's ``ctr.v[0]``). Inputs broadcast; the inputs are not modified.

    Example:
        >>> philox4x32(torch.zeros(4, dtype=torch.int64), (0, 0)).tolist()[0]
        1713891541
    """
    if counter.shape[-1:] != (4,):
        raise ValueError(f"philox4x32: expected counter of shape [..., 4], got {tuple(counter.shape)}")
    counter = counter.to(torch.int64) & _M32
    if isinstance(key, Tensor):
        if key.shape[-1:] != (2,):
            raise ValueError(f"philox4x32: expected key of shape [..., 2], got {tuple(key.shape)}")
        key = key.to(device=counter.device, dtype=torch.int64) & _M32
        shape = torch.broadcast_shapes(counter.shape[:-1], key.shape[:-1])
        k0, k1 = (key[..., j].expand(shape).clone() for j in range(2))
    else:
        shape = counter.shape[:-1]
        k0, k1 = int(key[0]) & _M32, int(key[1]) & _M32
    c = [counter[..., j].expand(shape).clone() for j in range(4)]
    words = _philox_owned(c[0], c[1], c[2], c[3], k0, k1, None)
    return torch.stack(torch.broadcast_tensors(*words), dim=-1)


def _philox_groups(g: Tensor, g_hi: int | None, offset: int, seed: int) -> Tensor:
    """Words ``[n, 4]`` for counters ``(g_lo, g_hi, offset_lo, offset_hi)``.

    ``g`` (int64, 1-d) is consumed. ``g_hi`` is the known high word of every
    ``g`` or None when it varies.
    """
    n = g.numel()
    out = torch.empty((n, 4), dtype=torch.int64, device=g.device)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    c2, c3 = offset & _M32, (offset >> 32) & _M32
    scratch = torch.empty(min(n, _CHUNK), dtype=torch.int64, device=g.device)
    for start in range(0, n, _CHUNK):
        sl = slice(start, min(n, start + _CHUNK))
        gc = g[sl]
        hi: Word = g_hi if g_hi is not None else gc >> 32
        words = _philox_owned(
            gc.bitwise_and_(_M32), hi, c2, c3, k0, k1, scratch[: gc.numel()]
        )
        for j, w in enumerate(words):
            out[sl, j] = w
    return out


# ---------------------------------------------------------------------------
# Blocks of the global tensor
# ---------------------------------------------------------------------------


def _check_block(
    global_shape: Sequence[int], local_offset: Sequence[int], local_shape: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    gs, lo, ls = (tuple(int(x) for x in s) for s in (global_shape, local_offset, local_shape))
    if not len(gs) == len(lo) == len(ls):
        raise ValueError(
            f"random block: expected global_shape, local_offset and local_shape of equal "
            f"length, got {gs}, {lo}, {ls}"
        )
    for d, (g, o, n) in enumerate(zip(gs, lo, ls, strict=True)):
        if g < 0 or n < 0 or o < 0 or o + n > g:
            raise ValueError(
                f"random block: dim {d}: expected 0 <= offset and offset + length <= "
                f"{g}, got offset {o}, length {n} (global_shape {gs})"
            )
    return gs, lo, ls


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return strides[::-1]


def global_indices(
    global_shape: Sequence[int],
    local_offset: Sequence[int],
    local_shape: Sequence[int],
    device: torch.device | str | None = None,
) -> Tensor:
    """Row-major linear indices (int64, shape ``local_shape``) of a block.

    Example:
        >>> global_indices((3, 4), (1, 2), (2, 2)).tolist()
        [[6, 7], [10, 11]]
    """
    gs, lo, ls = _check_block(global_shape, local_offset, local_shape)
    idx = torch.zeros((), dtype=torch.int64, device=device)
    for o, n, st in zip(lo, ls, _strides(gs), strict=True):
        ar = torch.arange(o, o + n, dtype=torch.int64, device=device)
        idx = idx.unsqueeze(-1) + ar * st  # [..., n]
    return idx


def _stream_words(seed: int, offset: int, first: int, count: int, device) -> Tensor:
    """Words ``first .. first + count - 1`` of the (seed, offset) stream, 1-d int64."""
    g0, g1 = first >> 2, (first + count - 1) >> 2
    g = torch.arange(g0, g1 + 1, dtype=torch.int64, device=device)
    g_hi = g0 >> 32 if g0 >> 32 == g1 >> 32 else None
    words = _philox_groups(g, g_hi, offset, seed).view(-1)
    return words[first & 3 : (first & 3) + count]


Convert = Callable[[Tensor, slice], Tensor]


def _generate(
    seed: int, offset: int, gs: tuple[int, ...], lo: tuple[int, ...], ls: tuple[int, ...],
    w: int, convert: Convert, dtype: torch.dtype, device: torch.device | str | None,
) -> Tensor:
    """Values of a block: ``convert(words[m, w], flat_slice) -> values[m]`` is
    applied to the stream words of consecutive elements (row-major in the block),
    at most ~``4 * _CHUNK`` words at a time, and written into the result."""
    seed, offset = int(seed) & _M64, int(offset) & _M64
    n = math.prod(ls)
    if n == 0:
        return torch.empty(ls, dtype=dtype, device=device)
    # The block is R runs of L consecutive global indices: dims after j are full.
    j = max(len(gs) - 1, 0)
    while j > 0 and ls[j] == gs[j]:
        j -= 1
    run = math.prod(ls[j:])
    head = ls[:j] + (1,) * (len(gs) - j)
    nw = run * w  # words per run
    if n == run or nw > 4 * _CHUNK:  # one run or long runs: chunk each run
        if n == run:
            first = [sum(o * st for o, st in zip(lo, _strides(gs), strict=True))]
        else:  # runs of > 4 * _CHUNK words, so few of them: a host copy is cheap
            first = global_indices(gs, lo, head, device).reshape(-1).tolist()
        step = 4 * _CHUNK // w
        if n <= step:  # a single pass: no copy into `out`
            words = _stream_words(seed, offset, w * first[0], w * n, device)
            return convert(words.view(-1, w), slice(0, n)).to(dtype).reshape(ls)
        out = torch.empty(n, dtype=dtype, device=device)
        for r, s in enumerate(first):
            for e0 in range(0, run, step):
                e1 = min(run, e0 + step)
                words = _stream_words(seed, offset, w * (s + e0), w * (e1 - e0), device)
                sl = slice(r * run + e0, r * run + e1)
                out[sl] = convert(words.view(-1, w), sl)
        return out.view(ls)
    # short runs: a batch of runs per pass, each run reading ceil((3 + nw) / 4) groups
    ngroups = (nw + 3 + 3) // 4
    batch = max(1, _CHUNK // ngroups)
    g_hi = 0 if (w * math.prod(gs)) >> 2 <= _M32 else None
    arange_g = torch.arange(ngroups, dtype=torch.int64, device=device)
    arange_w = torch.arange(nw, dtype=torch.int64, device=device)
    starts = global_indices(gs, lo, head, device).reshape(-1)  # [R] first element
    out = torch.empty(n, dtype=dtype, device=device)
    for r0 in range(0, starts.numel(), batch):
        first = starts[r0 : r0 + batch] * w  # [B] first word of each run
        groups = ((first >> 2).unsqueeze(-1) + arange_g).view(-1)  # [B * G]
        words = _philox_groups(groups, g_hi, offset, seed).view(first.numel(), 4 * ngroups)
        pick = (first & 3).unsqueeze(-1) + arange_w  # [B, nw]
        words = torch.gather(words, 1, pick)
        sl = slice(r0 * run, r0 * run + words.numel() // w)
        out[sl] = convert(words.view(-1, w), sl)
    return out.view(ls)


_MANTISSA = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def _float_info(dtype: torch.dtype, op: str) -> tuple[torch.dtype, int]:
    """(compute dtype, words per value) for a floating output dtype."""
    if dtype not in _MANTISSA:
        raise ValueError(f"{op}: expected a floating dtype in {list(_MANTISSA)}, got {dtype}")
    return (torch.float64, 2) if dtype == torch.float64 else (torch.float32, 1)


def _unit(words: Tensor, bits: int, *, open_low: bool = False) -> Tensor:
    """Uniform on ``[0, 1)`` (``(0, 1]`` with ``open_low``) from the top ``bits``
    bits of one word (``bits <= 24``, float32) or two words (53 bits, float64)."""
    if bits == 53:
        v = (words[..., 0] << 21) | (words[..., 1] >> 11)  # 53 bits
        dt = torch.float64
    else:
        v = words[..., 0] >> (32 - bits)
        dt = torch.float32
    if open_low:
        v += 1
    return v.to(dt).mul_(2.0**-bits)


def _next_below(value: float, dtype: torch.dtype) -> float:
    """Largest ``dtype`` value strictly below ``value`` (a ``dtype`` value)."""
    x = torch.tensor([value], dtype=dtype)
    ity = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    bits = int(x.view(ity).item())
    if value > 0:
        bits -= 1
    elif value == 0:
        return -float(torch.tensor([1], dtype=ity).view(dtype).item())
    else:
        bits += 1
    return float(torch.tensor([bits], dtype=ity).view(dtype).item())


def uniform_block(
    seed: int, offset: int, global_shape: Sequence[int], local_offset: Sequence[int],
    local_shape: Sequence[int], *, dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None, low: float = 0.0, high: float = 1.0,
) -> Tensor:
    """Uniform values on ``[low, high)`` for a block of the global tensor.

    ``u`` takes the top 24 (float32), 11 (float16) or 8 (bfloat16) bits of one word,
    or 53 bits of two words (float64); ``low + u * (high - low)`` is computed in
    float32 (float64) and cast; a value rounded up to ``high`` becomes the largest
    ``dtype`` value below ``high``.

    Example:
        >>> uniform_block(0, 0, (8,), (2,), (3,)).shape
        torch.Size([3])
    """
    gs, lo, ls = _check_block(global_shape, local_offset, local_shape)
    _, w = _float_info(dtype, "uniform_block")
    if not (low <= high and math.isfinite(high - low)):
        raise ValueError(
            f"uniform_block: expected finite low <= high, got low={low}, high={high}"
        )
    bits, plain = _MANTISSA[dtype], (low, high) == (0.0, 1.0)
    below = None  # the largest dtype value < high, when rounding can reach high
    if not plain and high > low:
        hi = float(torch.tensor(high, dtype=dtype))  # high rounded to dtype
        below = hi if hi < high else _next_below(hi, dtype)

    def convert(words: Tensor, _: slice) -> Tensor:
        u = _unit(words, bits)
        if plain:
            return u
        u = u.mul_(high - low).add_(low).to(dtype)
        return u if below is None else u.clamp_(max=below)

    return _generate(seed, offset, gs, lo, ls, w, convert, dtype, device)


def normal_block(
    seed: int, offset: int, global_shape: Sequence[int], local_offset: Sequence[int],
    local_shape: Sequence[int], *, dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None, mean: float = 0.0, std: float = 1.0,
) -> Tensor:
    """Normal values by inversion: ``mean + std * sqrt(2) * erfinv(t)``.

    ``t = (2k + 1) / 2**b - 1`` is exact and symmetric in ``(-1, 1)``: ``k`` is the
    top 23 bits of the element's one word (float32 arithmetic, also for the half
    types, then cast; ``|z| <= 5.3``) or the top 52 of its two words (float64).
    """
    gs, lo, ls = _check_block(global_shape, local_offset, local_shape)
    cdt, w = _float_info(dtype, "normal_block")
    if not std >= 0.0:
        raise ValueError(f"normal_block: expected std >= 0, got {std}")
    scale = math.sqrt(2.0) * std

    def convert(words: Tensor, _: slice) -> Tensor:
        if w == 2:
            k, b = (words[:, 0] << 20) | (words[:, 1] >> 12), 52  # 52 bits
        else:
            k, b = words[:, 0] >> 9, 23  # 23 bits
        t = k.mul_(2).add_(1 - (1 << b)).to(cdt).mul_(2.0**-b)  # odd / 2**b, exact
        z = t.erfinv_().mul_(scale)
        return (z if mean == 0.0 else z.add_(mean)).to(dtype)

    return _generate(seed, offset, gs, lo, ls, w, convert, dtype, device)


def exponential_block(
    seed: int, offset: int, global_shape: Sequence[int], local_offset: Sequence[int],
    local_shape: Sequence[int], *, dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None, lambd: float = 1.0,
) -> Tensor:
    """Exponential values ``-log1p(-u) / lambd`` (``u`` as in float32/float64
    ``uniform_block``; always finite, 0 with probability ``2**-24``/``2**-53``)."""
    gs, lo, ls = _check_block(global_shape, local_offset, local_shape)
    cdt, w = _float_info(dtype, "exponential_block")
    if not lambd > 0:
        raise ValueError(f"exponential_block: expected lambd > 0, got {lambd}")
    bits = 53 if cdt == torch.float64 else 24

    def convert(words: Tensor, _: slice) -> Tensor:
        return _unit(words, bits).neg_().log1p_().mul_(-1.0 / lambd).to(dtype)

    return _generate(seed, offset, gs, lo, ls, w, convert, dtype, device)


def _below(words: Tensor, span: int) -> Tensor:
    """Integers in ``[0, span)`` from ``[..., 1]`` words (``span <= 2**16``:
    multiply-shift) or ``[..., 2]`` words (63 bits modulo ``span``)."""
    if words.shape[-1] == 1:
        return (words[..., 0] * span) >> 32
    v = (words[..., 0] << 31) | (words[..., 1] >> 1)  # 63 bits, non-negative
    return v if span == 1 << 63 else v.remainder_(span)


def _int_words(span: int) -> int:
    if not 1 <= span <= 1 << 63:
        raise ValueError(f"randint_block: expected 1 <= high - low <= 2**63, got {span}")
    return 1 if span <= 1 << 16 else 2


def randint_block(
    seed: int, offset: int, global_shape: Sequence[int], local_offset: Sequence[int],
    local_shape: Sequence[int], *, low: int = 0, high: int, dtype: torch.dtype = torch.int64,
    device: torch.device | str | None = None,
) -> Tensor:
    """Integers on ``[low, high)``: 1 word and ``(w * span) >> 32`` when
    ``span = high - low <= 2**16`` (bias < 2**-16), else 2 words, 63 bits
    ``% span`` (bias < span / 2**63)."""
    gs, lo, ls = _check_block(global_shape, local_offset, local_shape)
    low, span = int(low), int(high) - int(low)
    w = _int_words(span)
    if dtype != torch.bool and not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        if low < info.min or low + span - 1 > info.max:
            raise ValueError(
                f"randint_block: expected [low, high) inside {dtype}'s range "
                f"[{info.min}, {info.max}], got low={low}, high={high}"
            )

    def convert(words: Tensor, _: slice) -> Tensor:
        return _below(words, span).add_(low).to(dtype)

    return _generate(seed, offset, gs, lo, ls, w, convert, dtype, device)


def _random_span(dtype: torch.dtype) -> int:
    if dtype in _MANTISSA:
        return (1 << _MANTISSA[dtype]) + 1
    if dtype == torch.bool:
        return 2
    if dtype.is_complex or dtype.is_floating_point:
        raise ValueError(f"random_block: unsupported dtype {dtype}")
    return int(torch.iinfo(dtype).max) + 1


def random_block(
    seed: int, offset: int, global_shape: Sequence[int], local_offset: Sequence[int],
    local_shape: Sequence[int], *, dtype: torch.dtype = torch.int64,
    device: torch.device | str | None = None,
) -> Tensor:
    """Like ``Tensor.random_()``: integers in ``[0, 2**mantissa]`` (inclusive) for
    floats (2**24 for float32, 2**53 float64, 2**11 float16, 2**8 bfloat16) and in
    ``[0, iinfo(dtype).max]`` for integer dtypes (``{False, True}`` for bool).
    Uses ``randint_block``'s word mapping with ``span`` = number of values."""
    gs, lo, ls = _check_block(global_shape, local_offset, local_shape)
    span = _random_span(dtype)

    def convert(words: Tensor, _: slice) -> Tensor:
        return _below(words, span).to(dtype)

    return _generate(seed, offset, gs, lo, ls, _int_words(span), convert, dtype, device)


def _threshold(p: float, op: str) -> int:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{op}: expected 0 <= p <= 1, got {p}")
    return math.ceil(p * 2.0**32)  # word < t  <=>  word * 2**-32 < p


def bernoulli_block(
    seed: int, offset: int, global_shape: Sequence[int], local_offset: Sequence[int],
    local_shape: Sequence[int], *, p: float | Tensor = 0.5, dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """1 where ``word * 2**-32 < p`` (one word per element), else 0.

    ``p`` is a float or this block's probabilities (shape ``local_shape``);
    ``dtype`` defaults to ``p.dtype`` for a tensor ``p``, else float32.
    """
    gs, lo, ls = _check_block(global_shape, local_offset, local_shape)
    if isinstance(p, Tensor):
        if tuple(p.shape) != ls:
            raise ValueError(
                f"bernoulli_block: expected p of shape local_shape {ls}, got {tuple(p.shape)}"
            )
        device = p.device if device is None else device
        dtype = p.dtype if dtype is None else dtype
        pf = p.reshape(-1)

        def convert(words: Tensor, sl: slice) -> Tensor:
            return words[:, 0].to(torch.float64).mul_(2.0**-32) < pf[sl].to(torch.float64)
    else:
        t = _threshold(float(p), "bernoulli_block")

        def convert(words: Tensor, _: slice) -> Tensor:
            return words[:, 0] < t

    out_dtype = torch.float32 if dtype is None else dtype
    return _generate(seed, offset, gs, lo, ls, 1, convert, out_dtype, device)


def dropout_mask_block(
    seed: int, offset: int, global_shape: Sequence[int], local_offset: Sequence[int],
    local_shape: Sequence[int], *, p: float, device: torch.device | str | None = None,
) -> Tensor:
    """Keep mask (bool): True where ``word * 2**-32 < 1 - p``, i.e. exactly
    ``bernoulli_block(p=1 - p) == 1`` (ATen's dropout draws ``bernoulli(1 - p)``)."""
    gs, lo, ls = _check_block(global_shape, local_offset, local_shape)
    _threshold(float(p), "dropout_mask_block")
    t = _threshold(1.0 - float(p), "dropout_mask_block")

    def convert(words: Tensor, _: slice) -> Tensor:
        return words[:, 0] < t

    return _generate(seed, offset, gs, lo, ls, 1, convert, torch.bool, device)


# ---------------------------------------------------------------------------
# Process-global state and single-device reference front end
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class RNGState:
    """Counter-based generator state: ``seed`` (mod 2**64) and next ``offset``."""

    seed: int
    offset: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "seed", int(self.seed) & _M64)
        object.__setattr__(self, "offset", int(self.offset) & _M64)


_state: RNGState | None = None  # None: lazily seeded from torch.initial_seed()


def get_rng_state() -> RNGState:
    """Current state. Until ``manual_seed`` is called it is
    ``RNGState(torch.initial_seed(), 0)``, fixed at first use."""
    global _state
    if _state is None:
        _state = RNGState(torch.initial_seed(), 0)
    return _state


def set_rng_state(state: RNGState) -> None:
    """Replace the process-global state."""
    global _state
    if not isinstance(state, RNGState):
        raise ValueError(f"set_rng_state: expected an RNGState, got {state!r}")
    _state = state


def manual_seed(seed: int) -> None:
    """Set the state to ``RNGState(seed, 0)``; call it with the same seed on every rank."""
    set_rng_state(RNGState(int(seed), 0))


def next_offset(increment: int = 1) -> int:
    """Return the current offset and advance it by ``increment``.

    Every rank must call it once for every random op (members of the op's mesh
    or not), so offsets stay in lockstep.
    """
    if increment < 0:
        raise ValueError(f"next_offset: expected increment >= 0, got {increment}")
    st = get_rng_state()
    set_rng_state(RNGState(st.seed, st.offset + increment))
    return st.offset


@contextlib.contextmanager
def fork_rng() -> Iterator[RNGState]:
    """Run a block and restore the state on exit (exception or not).

    Example:
        >>> with fork_rng():
        ...     a = rand(3)
        >>> torch.equal(a, rand(3))
        True
    """
    saved = get_rng_state()
    try:
        yield saved
    finally:
        set_rng_state(saved)


def seed_fingerprint(device: torch.device | str | None = None) -> Tensor:
    """int64 ``[seed_lo, seed_hi, offset_lo, offset_hi]``: all-gather and compare
    to check that every rank has the same state."""
    st = get_rng_state()
    vals = [st.seed & _M32, st.seed >> 32, st.offset & _M32, st.offset >> 32]
    return torch.tensor(vals, dtype=torch.int64, device=device)


def _shape(size: tuple) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    return tuple(int(s) for s in size)


def _full(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    return shape, (0,) * len(shape), shape


def rand(*size: int, dtype: torch.dtype | None = None, device=None) -> Tensor:
    """Single-device reference of ``torch.rand`` from the global state."""
    st, off = get_rng_state(), next_offset()
    return uniform_block(
        st.seed, off, *_full(_shape(size)), dtype=dtype or torch.get_default_dtype(), device=device
    )


def randn(*size: int, dtype: torch.dtype | None = None, device=None) -> Tensor:
    """Single-device reference of ``torch.randn`` from the global state."""
    st, off = get_rng_state(), next_offset()
    return normal_block(
        st.seed, off, *_full(_shape(size)), dtype=dtype or torch.get_default_dtype(), device=device
    )


def randint(
    low: int, high: int, size: Sequence[int], *, dtype: torch.dtype = torch.int64, device=None
) -> Tensor:
    """Single-device reference of ``torch.randint(low, high, size)``."""
    st, off = get_rng_state(), next_offset()
    return randint_block(
        st.seed, off, *_full(_shape((size,))), low=low, high=high, dtype=dtype, device=device
    )


def bernoulli(p: Tensor) -> Tensor:
    """Single-device reference of ``torch.bernoulli(p)``."""
    st, off = get_rng_state(), next_offset()
    return bernoulli_block(st.seed, off, *_full(tuple(p.shape)), p=p)


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """Single-device reference of ``F.dropout``: kept values scaled by ``1/(1-p)``.

    Same arithmetic as ATen's CPU dropout (``noise = bernoulli(1 - p) / (1 - p)``,
    ``x * noise``), which is what ``F.dropout`` on a DTensor decomposes into, so
    the two agree bit for bit. Consumes an offset only when it draws (like torch:
    nothing in eval, for ``p`` of 0 or 1, or for empty tensors).
    """
    _threshold(float(p), "dropout")
    if not training or p == 0.0 or x.numel() == 0:
        return x
    if p == 1.0:
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    st, off = get_rng_state(), next_offset()
    keep = 1.0 - p
    noise = bernoulli_block(
        st.seed, off, *_full(tuple(x.shape)), p=keep, dtype=x.dtype, device=x.device
    )
    return x * noise.div_(keep)


def uniform_(t: Tensor, a: float = 0.0, b: float = 1.0) -> Tensor:
    """In-place ``Tensor.uniform_(a, b)`` from the global state."""
    st, off = get_rng_state(), next_offset()
    v = uniform_block(st.seed, off, *_full(tuple(t.shape)), dtype=t.dtype, device=t.device, low=a, high=b)
    return t.copy_(v)


def normal_(t: Tensor, mean: float = 0.0, std: float = 1.0) -> Tensor:
    """In-place ``Tensor.normal_(mean, std)`` from the global state."""
    st, off = get_rng_state(), next_offset()
    v = normal_block(st.seed, off, *_full(tuple(t.shape)), dtype=t.dtype, device=t.device, mean=mean, std=std)
    return t.copy_(v)


def exponential_(t: Tensor, lambd: float = 1.0) -> Tensor:
    """In-place ``Tensor.exponential_(lambd)`` from the global state."""
    st, off = get_rng_state(), next_offset()
    v = exponential_block(st.seed, off, *_full(tuple(t.shape)), dtype=t.dtype, device=t.device, lambd=lambd)
    return t.copy_(v)


def random_(t: Tensor) -> Tensor:
    """In-place ``Tensor.random_()`` (no bounds) from the global state."""
    st, off = get_rng_state(), next_offset()
    return t.copy_(random_block(st.seed, off, *_full(tuple(t.shape)), dtype=t.dtype, device=t.device))
