"""Philox4x32-10 on torch integer tensors, and blocks of a counter-based stream.

The pure core of ``dtensor.random`` (which re-exports ``philox4x32`` and
``global_indices``): the Philox bijection, the word stream of a ``(seed,
offset)`` pair, and ``_generate``, which turns the words of a rectangular block
of a global tensor into values. Nothing here keeps state but the scratch
buffers eager draws reuse per thread.

Word ``k`` of the stream for ``(seed, offset)`` is word ``k % 4`` of
``philox4x32_10((g & M32, g >> 32, offset & M32, offset >> 32), (seed & M32,
seed >> 32))`` with ``g = k // 4``. An op using ``w`` words per element gives
the element at global row-major index ``i`` the words ``w*i .. w*i + w - 1``.

Example:
    >>> philox4x32(torch.zeros(4, dtype=torch.int64), (0, 0)).tolist()[0]
    1713891541
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["global_indices", "philox4x32"]

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


def _mix(p: Word, b: Word, k: Word, scratch: Tensor | None, dst: Tensor | None = None) -> Word:
    """``(hi32(p) ^ b ^ k) & M32``; may overwrite ``b`` (never ``p``).

    A tensor result lives in ``b`` when ``b`` is a tensor, else in ``dst``
    when given (a free buffer of ``p``'s shape), else in a new tensor.
    """
    if isinstance(p, int):
        if isinstance(b, int):
            return ((p >> 32) ^ b ^ k) & _M32
        b ^= ((p >> 32) ^ k) & _M32 if isinstance(k, int) else (k ^ (p >> 32))
        return b.bitwise_and_(_M32)
    if isinstance(b, int):
        t = p >> 32 if dst is None else torch.bitwise_right_shift(p, 32, out=dst)
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


class _Stream:
    """Words of the ``(seed, offset)`` stream, computed in buffers reused
    across passes (fresh multi-megabyte temporaries per pass cost page faults
    that rivalled the arithmetic).

    ``groups(...)`` returns a view of an internal buffer, valid until the next
    call; the caller may overwrite it.
    """

    def __init__(self, seed: int, offset: int, max_groups: int, device,
                 like: Tensor | None = None) -> None:
        self.k0, self.k1 = seed & _M32, (seed >> 32) & _M32
        self.c2, self.c3 = offset & _M32, (offset >> 32) & _M32
        self.lanes, self.scratch, self.words = _workspace(max(1, max_groups), device, like)

    def groups(self, g: Tensor | int, count: int, g_hi: int | None) -> Tensor:
        """Words ``[count, 4]`` of groups ``g`` (int64 tensor) or ``g .. g + count - 1``.

        ``g_hi`` is the known high word of every group number, or None.
        """
        lanes, scratch = self.lanes[:, :count], self.scratch[:count]
        rows = list(lanes.unbind(0))
        if isinstance(g, int):
            torch.arange(g, g + count, dtype=torch.int64, out=rows[0])
        else:
            rows[0].copy_(g)
        c1: Word = g_hi
        if g_hi is None:
            c1 = torch.bitwise_right_shift(rows[0], 32, out=rows[1])
        rows[0].bitwise_and_(_M32)
        # Words (a0, b1, a2, b3); a tensor word lives in rows[at[j]].
        w: list[Word] = [rows[0], c1, self.c2, self.c3]
        at = [0, 1, 2, 3]
        k0, k1 = self.k0, self.k1
        for r in range(PHILOX_ROUNDS):
            if r:
                k0 = (k0 + PHILOX_W0) & _M32
                k1 = (k1 + PHILOX_W1) & _M32
            p0, p1 = _mul(w[0], PHILOX_M0), _mul(w[2], PHILOX_M1)  # in rows at[0], at[2]
            n0 = _mix(p1, w[1], k0, scratch, rows[at[1]])  # lands in rows[at[1]]
            n2 = _mix(p0, w[3], k1, scratch, rows[at[3]])  # lands in rows[at[3]]
            w, at = [n0, p1, n2, p0], [at[1], at[2], at[3], at[0]]
        out = self.words[:count]
        for j, v in enumerate(w):
            if isinstance(v, int):
                out[:, j].fill_(v & _M32)
            elif j % 2:  # raw products: keep the low word
                torch.bitwise_and(v, _M32, out=out[:, j])
            else:
                out[:, j].copy_(v)
        return out


_local = threading.local()


def _workspace(n: int, device, like: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Buffers (lanes ``[4, n]``, scratch ``[n]``, words ``[n, 4]``), int64.

    Up to ``_CHUNK`` groups they are kept per thread and device and reused by
    the next call (``9 * 8 * _CHUNK`` bytes): re-faulting fresh pages on every
    call cost as much as the arithmetic. Only plain eager calls share them
    (``_eager``): ``like`` is a tensor the words will be mixed with.
    """
    dev = torch.device("cpu" if device is None else device)
    cap = _CHUNK + 1  # a pass of 4 * _CHUNK words may straddle _CHUNK + 1 groups
    if n > cap or not _eager(like):
        return _alloc(n, dev)
    cache = _local.__dict__.setdefault("buffers", {})
    bufs = cache.get(dev)
    if bufs is None or bufs[1].numel() < n:
        bufs = cache[dev] = _alloc(max(n, cap), dev)
    return bufs


def _eager(like: Tensor | None) -> bool:
    """Whether this draw runs on real tensors outside any tracing.

    Under a dispatch mode (FakeTensorMode, functionalization: export,
    torch.compile's tracing, memory estimators) a buffer made here is not a
    real tensor, and a kept real buffer cannot take a traced value: either
    way a shared buffer would break this draw or a later eager one.
    """
    if like is not None and type(like) is not Tensor:
        return False
    return not torch._C._len_torch_dispatch_stack() and not torch.compiler.is_compiling()


def _alloc(n: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    i64 = torch.int64
    return (torch.empty((4, n), dtype=i64, device=device),  # one row per word
            torch.empty(n, dtype=i64, device=device),
            torch.empty((n, 4), dtype=i64, device=device))  # interleaved


def _philox_groups(g: Tensor, g_hi: int | None, offset: int, seed: int) -> Tensor:
    """Words ``[n, 4]`` (a new tensor) for counters ``(g_lo, g_hi, offset_lo, offset_hi)``.

    ``g`` (int64, 1-d) is not modified. ``g_hi`` is the known high word of
    every ``g`` or None when it varies.
    """
    n = g.numel()
    out = torch.empty((n, 4), dtype=torch.int64, device=g.device)
    stream = _Stream(seed, offset, min(n, _CHUNK), g.device, g)
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        out[start:stop] = stream.groups(g[start:stop], stop - start, g_hi)
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


def _stream_words(stream: _Stream, first: int, count: int) -> Tensor:
    """Words ``first .. first + count - 1`` of ``stream`` (1-d view of its buffer)."""
    g0, g1 = first >> 2, (first + count - 1) >> 2
    g_hi = g0 >> 32 if g0 >> 32 == g1 >> 32 else None
    words = stream.groups(g0, g1 - g0 + 1, g_hi).view(-1)
    return words[first & 3 : (first & 3) + count]


#: ``convert(words[m, w], flat_slice, out[m])`` writes the values of ``m``
#: consecutive elements into ``out`` (1-d, the block's dtype); it may overwrite
#: ``words`` (a view of a reused workspace: never return or keep it).
Convert = Callable[[Tensor, slice, Tensor], None]


def _generate(
    seed: int, offset: int, gs: tuple[int, ...], lo: tuple[int, ...], ls: tuple[int, ...],
    w: int, convert: Convert, dtype: torch.dtype, device: torch.device | str | None,
) -> Tensor:
    """Values of a block: ``convert(words[m, w], flat_slice, out[m])`` turns the
    stream words of consecutive elements (row-major in the block), at most
    ~``4 * _CHUNK`` words at a time, into values written straight into the result."""
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
        stream = _Stream(seed, offset, (min(run, step) * w + 3) // 4 + 1, device)
        out = torch.empty(n, dtype=dtype, device=device)
        for r, s in enumerate(first):
            for e0 in range(0, run, step):
                e1 = min(run, e0 + step)
                words = _stream_words(stream, w * (s + e0), w * (e1 - e0))
                sl = slice(r * run + e0, r * run + e1)
                convert(words.view(-1, w), sl, out[sl])
        return out.view(ls)
    # short runs: a batch of runs per pass, each run reading ceil((3 + nw) / 4) groups
    ngroups = (nw + 3 + 3) // 4
    batch = max(1, _CHUNK // ngroups)
    g_hi = 0 if (w * math.prod(gs)) >> 2 <= _M32 else None
    arange_g = torch.arange(ngroups, dtype=torch.int64, device=device)
    arange_w = torch.arange(nw, dtype=torch.int64, device=device)
    starts = global_indices(gs, lo, head, device).reshape(-1)  # [R] first element
    stream = _Stream(seed, offset, min(batch, starts.numel()) * ngroups, device)
    out = torch.empty(n, dtype=dtype, device=device)
    for r0 in range(0, starts.numel(), batch):
        first = starts[r0 : r0 + batch] * w  # [B] first word of each run
        groups = ((first >> 2).unsqueeze(-1) + arange_g).view(-1)  # [B * G]
        words = stream.groups(groups, groups.numel(), g_hi).view(first.numel(), 4 * ngroups)
        pick = (first & 3).unsqueeze(-1) + arange_w  # [B, nw]
        words = torch.gather(words, 1, pick)
        sl = slice(r0 * run, r0 * run + words.numel() // w)
        convert(words.view(-1, w), sl, out[sl])
    return out.view(ls)
