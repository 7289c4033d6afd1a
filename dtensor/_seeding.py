"""Seeding as users do it: ranks agree on a seed, ``torch.manual_seed`` reseeds.

Two guarantees, neither paid for on the random-op path once settled:

* **Nobody seeds → replicas agree.** torch's default seed differs in every
  process. The first draw of a world takes its seed from the world's c10d
  store by "first writer wins" (``compare_set``): every rank offers its own
  default seed and all get the first one written. A store operation is not a
  collective: ranks outside the op's mesh never have to take part, nothing
  waits, and it happens once per world (and again after ``torch.seed()``).
* **torch reseeds us.** ``torch.manual_seed`` (and ``torch.random.manual_seed``,
  ``torch.seed``, ``torch.get_rng_state``/``set_rng_state``, hence
  ``torch.random.fork_rng``) are wrapped once at import so they reseed, or
  save and restore, our generator with torch's CPU generator. A reseed that
  bypasses them (``torch.default_generator.manual_seed``) is seen as a
  changed ``torch.initial_seed()`` at the next draw.

After a reseed through torch, the first draw on a mesh compares the members'
``(seed, offset)`` through the store (each member publishes, then reads the
others'; again no collective) and raises on every member if they differ:
per-rank ``torch.manual_seed(rank)`` is a common bug that would otherwise draw
disagreeing "replicas". ``dtensor.manual_seed`` is checked where it is called.

The store operations live here, not in ``dtensor._comm``: they are not
collectives (only the ranks that ask take part, and nobody else waits).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _comm, _rank_state
from . import random as rng
from .errors import ShardingError

__all__ = ["SeedMismatchError", "exchange_among", "install_torch_hooks", "take"]

# How long the first draw after a reseed waits for the other members' seeds.
_CHECK_TIMEOUT_S = float(os.environ.get("DTENSOR_SEED_CHECK_TIMEOUT", "120"))


class SeedMismatchError(ShardingError, ValueError):
    """Ranks that draw together were seeded differently."""


class _WorldRecord:
    """Per world (default group): agreed default seeds and meshes checked."""

    __slots__ = ("checked", "checks", "defaults")

    def __init__(self) -> None:
        self.defaults: dict[int, int] = {}  # generation -> agreed default seed
        self.checked: dict[object, int] = {}  # mesh -> epoch last checked
        self.checks: dict[tuple, int] = {}  # (mesh ranks) or (topic, *ranks) -> calls so far


# id(default group) -> (default group, record); holding the group keeps its
# id from being reused by a later world.
_worlds: dict[int, tuple[object, _WorldRecord]] = {}


_c10d_world = dist.distributed_c10d._world


def _world() -> _WorldRecord | None:
    pg = _c10d_world.default_pg if dist.is_available() else None
    if pg is None:
        return None
    entry = _worlds.get(id(pg))
    if entry is None or entry[0] is not pg:
        entry = _worlds[id(pg)] = (pg, _WorldRecord())
    return entry[1]


def take(mesh=None, what: str = "random op") -> tuple[int, int]:
    """``(seed, offset)`` for one random op on ``mesh``; advances the offset.

    Every rank calls it once per random op, members of ``mesh`` or not.
    Before returning, the seed is made to agree: a default seed is replaced by
    the world's agreed one; after a torch reseed, members of ``mesh`` compare
    theirs once (``SeedMismatchError`` on every member if they differ).
    """
    g = rng.seeding()
    source = g.source
    if source == "default" or source == "torch":
        w = _world()
        if w is not None:
            if source == "default":
                _agree_default(g, w)
            elif mesh is not None and w.checked.get(mesh) != g.epoch:
                _check(g, w, mesh, what)
    st = g.state
    g.state = rng.RNGState(st.seed, st.offset + 1)  # next_offset(), inlined
    return st.seed, st.offset


def _agree_default(g, w: _WorldRecord) -> None:
    seed = w.defaults.get(g.generation)
    if seed is None:
        got = _store_first(f"dtensor/rng/default/{g.generation}", str(g.state.seed))
        seed = w.defaults[g.generation] = int(got)
    if seed != g.state.seed:
        g.state = rng.RNGState(seed, g.state.offset)


def _check(g, w: _WorldRecord, mesh, what: str) -> None:
    if mesh.get_coordinate() is None:
        return  # outsiders draw nothing, so there is nothing to disagree on
    ranks = mesh.ranks
    n = w.checks.get(ranks, 0)
    w.checks[ranks] = n + 1
    key = f"dtensor/rng/check/{','.join(map(str, ranks))}/{n}"
    mine = f"{g.state.seed}:{g.state.offset}"
    try:
        got = _store_exchange(key, mine, ranks, _CHECK_TIMEOUT_S)
    except TimeoutError as e:
        raise SeedMismatchError(
            f"{what} on {mesh!r}: this rank was reseeded through torch "
            f"(torch.manual_seed) and waited {_CHECK_TIMEOUT_S:.0f} s for the other "
            f"ranks of the mesh to draw after their reseed ({e}); seed every rank "
            "of the mesh alike before drawing on it"
        ) from None
    if len(set(got)) > 1:
        seeds = ", ".join(f"rank {r}: seed {v.replace(':', ' offset ')}" for r, v in zip(ranks, got, strict=True))
        raise SeedMismatchError(
            f"{what} on {mesh!r}: its ranks hold different random states after "
            f"torch.manual_seed ({seeds}); replicas would disagree. Seed every "
            "rank with the same value (torch.manual_seed(s) on all ranks), or "
            "call dtensor.manual_seed(s) after per-rank seeding to give DTensor "
            "random ops one stream"
        )
    w.checked[mesh] = g.epoch


# Store exchanges (no collective: only the ranks that ask take part) --------
def _store_first(key: str, value: str) -> str:
    """The value of ``key`` in the world's store: ``value`` if this rank is the
    first to get there, else what the first one wrote. Never waits."""
    store = dist.distributed_c10d._get_default_store()
    try:
        return store.compare_set(key, "", value).decode()
    except RuntimeError:
        if _store_works(store):
            raise
        return value


def _store_exchange(key: str, value: str, ranks: Sequence[int], timeout_s: float) -> list[str]:
    """Publish ``value`` under ``key`` for this rank and read the values of
    ``ranks`` (in that order), waiting at most ``timeout_s`` for them.

    Raises ``TimeoutError`` naming the ranks that never published.
    """
    store = dist.distributed_c10d._get_default_store()
    if not _store_works(store):
        return [value] * len(ranks)
    store.set(f"{key}/{_comm.get_rank()}", value)
    keys = [f"{key}/{r}" for r in ranks]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as e:  # c10d raises DistStoreError (a RuntimeError) on timeout
        missing = [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]
        raise TimeoutError(f"ranks {missing} did not publish {key!r}") from e
    return [store.get(k).decode() for k in keys]


_store_ok: dict[int, tuple[object, bool]] = {}


def _store_works(store) -> bool:
    """Whether ``store`` implements set/get (the fake process group's store,
    one process standing for every rank, implements neither: there is nobody
    to agree with)."""
    entry = _store_ok.get(id(store))
    if entry is None or entry[0] is not store:
        try:
            store.set("dtensor/probe", "1")
            ok = True
        except RuntimeError:
            ok = False
        entry = _store_ok[id(store)] = (store, ok)
    return entry[1]


def exchange_among(mesh, topic: str, value: str, timeout_s: float = _CHECK_TIMEOUT_S):
    """Each member of ``mesh`` publishes ``value`` and gets every member's, in
    mesh order, through the store (no collective); ``None`` where there is
    nothing to exchange (no world, a one-rank mesh, a rank outside it).

    Members must call it together, once per ``topic`` and mesh each time
    (calls are numbered per world, topic and mesh ranks). Raises
    ``TimeoutError`` naming the members that never published.
    """
    w = _world()
    if w is None or mesh.get_coordinate() is None or len(mesh.ranks) == 1:
        return None
    ranks = mesh.ranks
    n = w.checks.get((topic, *ranks), 0)
    w.checks[(topic, *ranks)] = n + 1
    key = f"dtensor/{topic}/{','.join(map(str, ranks))}/{n}"
    return _store_exchange(key, value, ranks, timeout_s)


# torch's seeding functions -------------------------------------------------
# id(state tensor returned by torch.get_rng_state) -> (weak ref, our state,
# source). Keyed by id: tensors compare elementwise, so they cannot be keys.
_saved: dict[int, tuple[weakref.ref, rng.RNGState, str]] = {}


def _remember(t) -> None:
    if len(_saved) >= 64:
        for k in [k for k, v in _saved.items() if v[0]() is None]:
            del _saved[k]
    g = rng.seeding()
    _saved[id(t)] = (weakref.ref(t), g.state, g.source)


def _restore(t) -> None:
    entry = _saved.get(id(t))
    if entry is None or entry[0]() is not t:
        return  # a state saved elsewhere (e.g. loaded from a file): ours stays
    g = rng._current()
    g.state, g.source = entry[1], entry[2]
    g.torch_seed = torch.initial_seed()
    g.epoch += 1


def _after_manual_seed() -> None:
    _rank_state.auto_enter()
    rng._current().reset(torch.initial_seed(), "torch")


def _after_seed() -> None:
    _rank_state.auto_enter()
    g = rng._current()
    g.reset(torch.initial_seed(), "default")
    g.generation += 1


# NOTE: our bookkeeping may itself reach torch's seeding functions (PyTorch's
# LocalTensorMode wraps them and reads the generator's state): a hook that
# re-enters on its own thread only calls through, never recurses.
_in_hook = threading.local()


def _wrap(fn, after=None, kind: str = ""):
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        if getattr(_in_hook, "on", False):
            return out
        _in_hook.on = True
        try:
            if kind == "get":
                _remember(out)
            elif kind == "set":
                _restore(args[0] if args else kwargs.get("new_state"))
            else:
                after()
        finally:
            _in_hook.on = False
        return out

    wrapper.__wrapped__ = fn
    wrapper.__name__, wrapper.__qualname__ = fn.__name__, fn.__qualname__
    wrapper.__doc__ = fn.__doc__
    wrapper._dtensor_hook = True
    return wrapper


def install_torch_hooks() -> None:
    """Wrap torch's seeding functions so they drive our generator too (idempotent).

    ``torch.manual_seed(s)`` → our state ``(s, 0)``; ``torch.seed()`` → a new
    default seed, agreed again; ``torch.get_rng_state()`` remembers our state
    beside the tensor it returns and ``torch.set_rng_state`` of that tensor
    restores it (that is how ``torch.random.fork_rng`` restores both).
    """
    import torch.random as trandom

    for name, after, kind in (
        ("manual_seed", _after_manual_seed, ""),
        ("seed", _after_seed, ""),
        ("get_rng_state", None, "get"),
        ("set_rng_state", None, "set"),
    ):
        fn = getattr(trandom, name)
        if not _hooked(fn):
            setattr(trandom, name, _wrap(fn, after, kind))
        # torch.<name> may already be someone else's wrapper of the original:
        # importing torch._dynamo before us replaces torch.manual_seed with
        # a dynamo-disabled copy, and that copy reseeded torch only (a
        # reseed to the same seed then went unseen: the next draw continued
        # the old stream). Wrap whatever is there unless it reaches us.
        top = getattr(torch, name, None)
        if top is not None and not _hooked(top):
            setattr(torch, name, _wrap(top, after, kind))


def _hooked(fn) -> bool:
    """Whether ``fn`` is our hook or a wrapper (``__wrapped__`` chain) of it."""
    for _ in range(8):
        if getattr(fn, "_dtensor_hook", False):
            return True
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
    return False


install_torch_hooks()
