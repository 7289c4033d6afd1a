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
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from dtensor._philox import (
    _M32,
    _M64,
    _check_block,
    _generate,
    global_indices,
    philox4x32,
)

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

_MANTISSA = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def _float_info(dtype: torch.dtype, op: str) -> tuple[torch.dtype, int]:
    """(compute dtype, words per value) for a floating output dtype."""
    if dtype not in _MANTISSA:
        raise ValueError(f"{op}: expected a floating dtype in {list(_MANTISSA)}, got {dtype}")
    return (torch.float64, 2) if dtype == torch.float64 else (torch.float32, 1)


def _top_bits(words: Tensor, bits: int) -> Tensor:
    """The top ``bits`` bits of each row of ``words`` (``[..., 1]``: ``bits <= 32``;
    ``[..., 2]``: word 0 then word 1) as int64. Overwrites ``words``."""
    hi = words[..., 0]
    if bits <= 32:
        return hi.bitwise_right_shift_(32 - bits)
    lo = words[..., 1].bitwise_right_shift_(64 - bits)
    return hi.bitwise_left_shift_(bits - 32).bitwise_or_(lo)


def _work(out: Tensor, cdt: torch.dtype) -> Tensor:
    """Where values computed in ``cdt`` go: ``out`` itself, or a temporary that
    the caller copies (one rounding) into ``out``."""
    return out if out.dtype == cdt else torch.empty(out.shape, dtype=cdt, device=out.device)


def _finish(out: Tensor, values: Tensor) -> None:
    if values is not out:
        out.copy_(values)


def _unit(dst: Tensor, words: Tensor, bits: int) -> Tensor:
    """``dst`` (floating, ``bits`` <= its mantissa) := uniform on ``[0, 1)`` from the
    top ``bits`` bits of one word (``bits <= 32``) or two words; exact.
    Overwrites ``words``."""
    return dst.copy_(_top_bits(words, bits)).mul_(2.0**-bits)


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
    _float_info(dtype, "uniform_block")
    if not (low <= high and math.isfinite(high - low)):
        raise ValueError(
            f"uniform_block: expected finite low <= high, got low={low}, high={high}"
        )
    cdt, w = _float_info(dtype, "uniform_block")
    bits, plain = _MANTISSA[dtype], (low, high) == (0.0, 1.0)
    below = None  # the largest dtype value < high, when rounding can reach high
    if not plain and high > low:
        hi = float(torch.tensor(high, dtype=dtype))  # high rounded to dtype
        below = hi if hi < high else _next_below(hi, dtype)

    def convert(words: Tensor, _: slice, out: Tensor) -> None:
        if plain:  # k * 2**-bits is exact in dtype: no float32 detour
            _unit(out, words, bits)
            return
        _finish(out, _unit(_work(out, cdt), words, bits).mul_(high - low).add_(low))
        if below is not None:
            out.clamp_(max=below)

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

    def convert(words: Tensor, _: slice, out: Tensor) -> None:
        b = 52 if w == 2 else 23
        k = _top_bits(words, b).mul_(2).add_(1 - (1 << b))
        t = _work(out, cdt).copy_(k).mul_(2.0**-b)  # odd / 2**b, exact
        z = t.erfinv_().mul_(scale)
        _finish(out, z if mean == 0.0 else z.add_(mean))

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

    def convert(words: Tensor, _: slice, out: Tensor) -> None:
        u = _unit(_work(out, cdt), words, bits)
        _finish(out, u.neg_().log1p_().mul_(-1.0 / lambd))

    return _generate(seed, offset, gs, lo, ls, w, convert, dtype, device)


def _below(words: Tensor, span: int) -> Tensor:
    """Integers in ``[0, span)`` from ``[..., 1]`` words (``span <= 2**16``:
    multiply-shift) or ``[..., 2]`` words (63 bits modulo ``span``; all 64 bits
    modulo ``span`` for ``span > 2**63``, as wrapped int64). Overwrites ``words``."""
    if words.shape[-1] == 1:
        return words[..., 0].mul_(span).bitwise_right_shift_(32)
    if span <= 1 << 63:
        v = _top_bits(words, 63)  # non-negative
        return v if span == 1 << 63 else v.remainder_(span)
    v = _top_bits(words, 64)  # u - 2**64 where u >= 2**63
    if span == 1 << 64:
        return v
    # u < 2 * span, so u % span is u, or u - span when u >= span (both u and
    # span above 2**63: compare the wrapped values).
    wrapped = span - (1 << 64)
    return torch.where((v < 0) & (v >= wrapped), v - wrapped, v)


def _int_words(span: int) -> int:
    if not 1 <= span <= 1 << 64:
        raise ValueError(f"randint_block: expected 1 <= high - low <= 2**64, got {span}")
    return 1 if span <= 1 << 16 else 2


def randint_block(
    seed: int, offset: int, global_shape: Sequence[int], local_offset: Sequence[int],
    local_shape: Sequence[int], *, low: int = 0, high: int, dtype: torch.dtype = torch.int64,
    device: torch.device | str | None = None,
) -> Tensor:
    """Integers on ``[low, high)``: 1 word and ``(w * span) >> 32`` when
    ``span = high - low <= 2**16`` (bias < 2**-16), else 2 words, 63 bits
    ``% span`` (bias < span / 2**63; 64 bits when ``span > 2**63``, for int64
    ranges such as ``random_(from)`` with a negative ``from``)."""
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

    def convert(words: Tensor, _: slice, out: Tensor) -> None:
        out.copy_(_below(words, span).add_(low))

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

    def convert(words: Tensor, _: slice, out: Tensor) -> None:
        out.copy_(_below(words, span))

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

        def convert(words: Tensor, sl: slice, out: Tensor) -> None:
            u = words[:, 0].to(torch.float64).mul_(2.0**-32)
            out.copy_(u < pf[sl].to(torch.float64))
    else:
        t = _threshold(float(p), "bernoulli_block")

        def convert(words: Tensor, _: slice, out: Tensor) -> None:
            out.copy_(words[:, 0] < t)

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

    def convert(words: Tensor, _: slice, out: Tensor) -> None:
        torch.lt(words[:, 0], t, out=out)

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
