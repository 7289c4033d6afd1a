"""Random block functions: this rank's block of a draw, as a pure function of
``(seed, offset, global shape, block offset, block shape)``.

The stream layout (Philox4x32-10 words per global element index) is
described in ``dtensor.random``, which re-exports these functions beside the
process-global state and single-device front end that call them.

Example:
    >>> x = uniform_block(0, 0, (4, 6), (0, 0), (4, 6), dtype=torch.float32)
    >>> torch.equal(x[:2], uniform_block(0, 0, (4, 6), (0, 0), (2, 6), dtype=torch.float32))
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from dtensor._philox import _check_block, _generate

__all__ = [
    "bernoulli_block",
    "dropout_mask_block",
    "exponential_block",
    "normal_block",
    "randint_block",
    "random_block",
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
