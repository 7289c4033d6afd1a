"""Collective results still in flight: tensors that wait on their first use.

``dtensor._comm`` issues a collective with ``async_op=True`` and hands back its
output buffer wrapped in an ``AsyncCollectiveTensor``. Views of the wrapper
(``view``, ``narrow``, ``t``, ``detach``, a dtype view...) are views of the
buffer and stay in flight, sharing one ``Flight``; the first op that reads or
writes data waits for the collective and then runs on the plain buffer, as
does ``wait()``. Every later use of any wrapper of that flight is a plain op.

Only ``dtensor._comm`` builds these (it is the only caller of collectives);
this module only waits on the handles it is given.

Example (2 ranks, from ``redistribute(..., async_op=True)``)::

    >>> y = x.redistribute(mesh, [Replicate()], async_op=True)
    >>> t = y.to_local()          # AsyncCollectiveTensor, still in flight
    >>> t.completed
    False
    >>> t + 1                     # waits here, returns a plain tensor
    tensor([1., 2., 3., 4.])
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

__all__ = ["AsyncCollectiveTensor", "Flight", "settle"]


class Flight:
    """The pending handles of one collective; ``wait()`` waits on them once."""

    __slots__ = ("_works",)

    def __init__(self, works) -> None:
        self._works = list(works)

    @property
    def done(self) -> bool:
        return not self._works

    def wait(self) -> None:
        works, self._works = self._works, []
        for w in works:
            w.wait()


class AsyncCollectiveTensor(torch.Tensor):
    """A collective's output that waits for the collective on its first use.

    Views keep it in flight (they alias the buffer the collective fills);
    any other op, ``wait()``, ``tolist()``, ``numpy()`` and ``repr`` wait
    first. The result of a waiting op is a plain tensor.

    Example:
        >>> t = y.to_local()          # y = x.redistribute(..., async_op=True)
        >>> t.completed, t[0].completed
        (False, False)
        >>> t.wait()                  # the plain tensor
        tensor([0., 1., 2., 3.])
    """

    _elem: torch.Tensor
    _flight: Flight
    __slots__ = ("_elem", "_flight")
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor, flight: Flight):
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=elem.device,
            requires_grad=False,
        )
        r._elem = elem
        r._flight = flight
        return r

    @property
    def completed(self) -> bool:
        """Whether the collective has been waited on (by any of its wrappers)."""
        return self._flight.done

    def wait(self) -> torch.Tensor:
        """Wait for the collective; returns the plain tensor (no copy)."""
        self._flight.wait()
        return self._elem

    def tolist(self):
        return self.wait().tolist()

    def numpy(self, *args, **kwargs):
        return self.wait().numpy(*args, **kwargs)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"AsyncCollectiveTensor({self.wait()!r})"

    # Saved and copied as the plain result (the handle cannot be pickled).
    def __reduce_ex__(self, protocol):
        return self.wait().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return self.wait().__deepcopy__(memo)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.is_view:
            # A view of a buffer still being filled is a view of the result:
            # no data is read, so the collective stays in flight.
            flights = []

            def keep(t):
                flights.append(t._flight)
                return t._elem

            out = func(*tree_map_only(cls, keep, args), **tree_map_only(cls, keep, kwargs))
            if len(flights) == 1:
                return tree_map_only(torch.Tensor, lambda e: cls(e, flights[0]), out)
            for f in flights:  # a view of several wrappers: unusual; wait
                f.wait()
            return out
        return func(*tree_map_only(cls, AsyncCollectiveTensor.wait, args),
                    **tree_map_only(cls, AsyncCollectiveTensor.wait, kwargs))


def settle(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor: an in-flight result is waited for first."""
    return t.wait() if type(t) is AsyncCollectiveTensor else t
