"""One op call taken apart once: its operands, their specs, and its key.

``Call(func, args, kwargs)`` walks the arguments a single time. Operands are
DTensors and the plain tensors allowed beside them (0-d or one-element
tensors, or any tensor under ``implicit_replication``); in the key form of
the arguments (what rules see and caches key on) each operand is replaced by
its spec (``PlainKey`` for a plain operand). Every later step that needs the
arguments with their operands swapped (for local blocks, meta tensors)
uses ``Call.replace``, the one walker that puts values back in place.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

from dtensor.dispatch import wrap as _served  # holds the DTensor class
from dtensor.errors import MeshError, ShardingError

__all__ = [
    "SCALAR_TYPES",
    "Call",
    "PlainKey",
    "implicit",
    "implicit_replication",
    "tensor_leaves",
]

_state = threading.local()

# Keyed by type alone (dtensor.dispatch.cache): no rule and no result's
# metadata depends on the value of a float or complex scalar (type promotion
# looks at types only), so ``p.add_(g, alpha=-lr)`` with a new ``lr`` every
# step shares cached results.
SCALAR_TYPES = frozenset({float, complex})


@contextlib.contextmanager
def implicit_replication():
    """Allow plain (non-scalar) tensors as operands: they count as ``Replicate``.

    Example:
        >>> with implicit_replication():
        ...     y = dt + torch.ones(4)     # the plain tensor is replicated
    """
    old = getattr(_state, "implicit", False)
    _state.implicit = True
    try:
        yield
    finally:
        _state.implicit = old


def implicit() -> bool:
    """Whether plain tensors of any size count as replicated operands now:
    inside ``implicit_replication()`` or PyTorch's own flag for it (set by
    ``torch.distributed.tensor.experimental.implicit_replication`` and by
    vmap's embedding rule, which adds a plain offset tensor to the indices)."""
    return getattr(_state, "implicit", False) or _torch_implicit()


_torch_implicit = torch._C._get_dtensor_allow_implicit_replication


@dataclass(frozen=True, slots=True)
class PlainKey:
    """A plain operand in key form: what of it a rule or a cache may look at."""

    shape: tuple
    dtype: torch.dtype
    device: str


class _Plain:
    """A plain tensor that may not be implicitly replicated (an error later)."""

    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t


class Call:
    """One call of ``func``, flattened once.

    ``operands``: the tensors taking part, in argument order (top-level and
    one level into lists/tuples, then kwargs); ``specs``: each one's spec
    (None for a plain operand); ``key_args``/``key_kwargs``: the arguments
    with every operand replaced by its spec or ``PlainKey``.
    """

    __slots__ = ("args", "func", "key_args", "key_kwargs", "kwargs", "operands", "specs")

    def __init__(self, func, args: tuple, kwargs: dict) -> None:
        # NOTE: plain loops, no closures or generators: this runs on every
        # call that misses the fast path.
        self.func, self.args, self.kwargs = func, args, kwargs
        self.specs = specs = []
        self.operands = operands = []
        implicit = getattr(_state, "implicit", False) or _torch_implicit()
        key_args = []
        for a in args:
            if isinstance(a, torch.Tensor):
                a = _key(a, specs, operands, implicit)
            elif isinstance(a, (list, tuple)):
                a = _key_seq(a, specs, operands, implicit)
            key_args.append(a)
        self.key_args = tuple(key_args)
        key_kwargs = []
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                v = _key(v, specs, operands, implicit)
            elif isinstance(v, (list, tuple)):
                v = _key_seq(v, specs, operands, implicit)
            key_kwargs.append((k, v))
        self.key_kwargs = tuple(key_kwargs)

    def replace(self, values) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with the operands replaced by ``values``, in order."""
        it = iter(values)
        args = []
        for a in self.args:
            if isinstance(a, torch.Tensor):
                a = next(it)
            elif isinstance(a, (list, tuple)):
                a = _swap_seq(a, it)
            args.append(a)
        kwargs = {}
        for k, v in self.kwargs.items():
            if isinstance(v, torch.Tensor):
                v = next(it)
            elif isinstance(v, (list, tuple)):
                v = _swap_seq(v, it)
            kwargs[k] = v
        return tuple(args), kwargs

    def check_plain(self) -> None:
        """Raise for a plain tensor that may not mix with DTensors."""
        for a in (*self.key_args, *(v for _, v in self.key_kwargs)):
            items = a if isinstance(a, tuple) else (a,)
            bad = next((x for x in items if isinstance(x, _Plain)), None)
            if bad is not None:
                raise ShardingError(
                    f"{self.func}: got a plain torch.Tensor of shape {tuple(bad.t.shape)} "
                    "mixed with DTensors. Convert it with distribute_tensor(t, mesh, "
                    "placements) or DTensor.from_local, or wrap the call in "
                    "dtensor.implicit_replication() to treat it as replicated."
                )

    def first_mesh(self):
        """The mesh of the first DTensor operand (None: no DTensor operand).

        Dispatch's one answer to "which mesh does this call run on" once the
        operands are known to share it (``mesh`` checks that).
        """
        for s in self.specs:
            if s is not None:
                return s.mesh
        return None

    def mesh(self):
        """The operands' common mesh; raises if they live on different meshes."""
        mesh = None
        for s in self.specs:
            if s is None:
                continue
            if mesh is None:
                mesh = s.mesh
            elif s.mesh != mesh:
                raise MeshError(
                    f"{self.func}: operands live on different meshes ({mesh!r} and "
                    f"{s.mesh!r}); redistribute or re-create one of them on the "
                    "other's mesh"
                )
        return mesh


def _key(x, specs: list, operands: list, implicit: bool):
    """A tensor argument in key form; records it as an operand if it is one."""
    if isinstance(x, _served.DTensor):
        specs.append(x._spec)
        operands.append(x)
        return x._spec
    if x.dim() == 0 or implicit or x.numel() == 1:
        specs.append(None)
        operands.append(x)
        return PlainKey(tuple(x.shape), x.dtype, x.device.type)
    return _Plain(x)


def _key_seq(seq, specs: list, operands: list, implicit: bool) -> tuple:
    return tuple([_key(x, specs, operands, implicit) if isinstance(x, torch.Tensor) else x
                  for x in seq])


def _swap_seq(seq, it):
    for y in seq:
        if isinstance(y, torch.Tensor):
            return type(seq)([next(it) if isinstance(x, torch.Tensor) else x for x in seq])
    return seq


def tensor_leaves(out) -> list:
    """The tensors of an op's result, in order (nested lists and tuples)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for x in out for t in tensor_leaves(x)]
    return []
