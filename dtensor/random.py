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
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from dtensor._philox import _M32, _M64, global_indices, philox4x32
from dtensor._random_blocks import (
    _threshold,
    bernoulli_block,
    dropout_mask_block,
    exponential_block,
    normal_block,
    randint_block,
    random_block,
    uniform_block,
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


class _Seeding:
    """This rank's generator state and where its seed came from.

    ``source`` says who set the seed last: ``"default"`` (nobody: the seed is
    torch's per-process default until the ranks agree on one, see
    ``dtensor._seeding``), ``"torch"`` (``torch.manual_seed`` or any reseed of
    torch's CPU generator), ``"dtensor"`` (``dtensor.manual_seed``, checked
    where it is called) or ``"state"`` (``set_rng_state``). ``epoch`` counts
    reseeds, so a mesh knows whether it has checked the current seed yet;
    ``generation`` counts non-deterministic reseeds (``torch.seed()``), so
    ranks agree on a new default seed per generation.
    """

    __slots__ = ("epoch", "generation", "source", "state", "torch_seed")

    def __init__(self) -> None:
        self.state: RNGState | None = None
        self.source = "default"
        self.torch_seed = 0  # torch.initial_seed() when the state was last set
        self.epoch = 0
        self.generation = 0

    def reset(self, seed: int, source: str) -> None:
        self.state = RNGState(seed, 0)
        self.source = source
        self.torch_seed = torch.initial_seed()
        self.epoch += 1


_seeding = _Seeding()


def _current() -> _Seeding:
    """This rank's seeding record (one per process; a simulated world with
    several ranks per process swaps this function for a per-rank lookup)."""
    return _seeding


def seeding() -> _Seeding:
    """This rank's generator state with torch's latest reseed applied.

    A reseed of torch's CPU generator that bypassed ``torch.manual_seed``
    (e.g. ``torch.default_generator.manual_seed(s)``) shows as a changed
    ``torch.initial_seed()`` and is applied here, before any draw.
    """
    g = _current()
    if g.state is None:
        g.state = RNGState(torch.initial_seed(), 0)
        g.torch_seed = torch.initial_seed()
    elif torch.initial_seed() != g.torch_seed:
        g.reset(torch.initial_seed(), "torch")
    return g


def _forget_seed() -> None:
    """Back to a process nobody has seeded: the next draw takes torch's
    default seed as it stands then (tests use it to stand for a fresh process)."""
    g = _current()
    g.state, g.source = None, "default"
    g.epoch += 1


def get_rng_state() -> RNGState:
    """Current state: ``RNGState(seed, offset)``.

    The seed is the latest of ``torch.manual_seed(s)`` and
    ``dtensor.manual_seed(s)`` (either resets the offset to 0); before any
    seeding it is torch's default seed, which ranks drawing on a mesh first
    agree on (``dtensor._seeding``).
    """
    return seeding().state


def set_rng_state(state: RNGState) -> None:
    """Replace the process-global state."""
    if not isinstance(state, RNGState):
        raise ValueError(f"set_rng_state: expected an RNGState, got {state!r}")
    g = _current()
    g.state, g.source, g.torch_seed = state, "state", torch.initial_seed()
    g.epoch += 1


def manual_seed(seed: int) -> None:
    """Set the state to ``RNGState(seed, 0)``; call it with the same seed on every rank."""
    _current().reset(int(seed), "dtensor")


def next_offset(increment: int = 1) -> int:
    """Return the current offset and advance it by ``increment``.

    Every rank must call it once for every random op (members of the op's mesh
    or not), so offsets stay in lockstep.
    """
    if increment < 0:
        raise ValueError(f"next_offset: expected increment >= 0, got {increment}")
    g = seeding()
    st = g.state
    g.state = RNGState(st.seed, st.offset + increment)
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
    g = seeding()
    saved = (g.state, g.source, g.torch_seed)
    try:
        yield saved[0]
    finally:
        g = _current()
        g.state, g.source = saved[0], saved[1]
        # torch's generator was not forked here: whatever reseeded it inside
        # the block is not undone, so it must not look like a new reseed.
        g.torch_seed = torch.initial_seed()
        g.epoch += 1


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
    nothing in eval, for ``p`` of 0 or 1, or for empty tensors). Inside the
    forward of a ``dtensor.fsdp`` root module, ``x`` is this rank's rows of the
    batch and gets those rows of the whole batch's mask.
    """
    _threshold(float(p), "dropout")
    if not training or p == 0.0:
        return x
    if any(getattr(m, "draws_batch_rows", False)
           for m in torch.overrides._get_current_function_mode_stack()):
        # Inside an FSDP forward x is this rank's rows of the batch; the mode
        # (dtensor.fsdp.rng) draws them as rows of the whole batch's mask.
        return torch.nn.functional.dropout(x, p, training)
    if x.numel() == 0:
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
