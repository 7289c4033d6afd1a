"""Count the bytes collectives move, the same way for any implementation.

``CommBytes`` is a ``TorchDispatchMode`` that sees every collective op that
goes through the dispatcher: the in-place ``c10d`` ops behind
``torch.distributed.all_reduce`` & co. (what ``dtensor`` calls in eager mode)
and the functional ``_c10d_functional`` ops (what
``torch.distributed.tensor`` calls). Neither runtime is asked to report on
itself, so both are measured by the same code: a runtime that forgot to
count one of its collectives cannot look cheaper than it is.

Two measures per collective (``n`` = ranks in its group):

- ``buffer``: bytes of the full-size buffer (an all-reduce's tensor, an
  all-gather's output, a reduce-scatter's input). This is what
  ``dtensor.debug.CommDebugMode`` reports.
- ``wire``: bytes one rank receives under the bandwidth-optimal (ring)
  algorithm: all-gather, reduce-scatter and all-to-all ``(n-1)/n * buffer``,
  all-reduce ``2 (n-1)/n * buffer`` (a reduce-scatter plus an all-gather),
  broadcast ``(n-1)/n * buffer`` (scatter + all-gather halves, counted once).
  Comparing plans that use different collectives (an all-reduce then a slice
  vs a reduce-scatter) needs this measure; buffers alone would call them
  equal.

Example:
    >>> with CommBytes() as cb:
    ...     dist.all_reduce(torch.ones(4))         # 2 ranks
    >>> cb.by_kind()["all_reduce"]
    {'count': 1, 'buffer': 16, 'wire': 16.0}
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CommBytes", "Record", "wire_bytes"]


@dataclass(frozen=True, slots=True)
class Record:
    kind: str
    buffer: int
    n: int
    phase: str

    @property
    def wire(self) -> float:
        return wire_bytes(self.kind, self.buffer, self.n)


def wire_bytes(kind: str, buffer: int, n: int) -> float:
    """Bytes one rank receives for ``kind`` on ``n`` ranks (ring algorithms)."""
    if n <= 1:
        return 0.0
    share = (n - 1) / n * buffer
    return 2 * share if kind == "all_reduce" else share


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _pg_size(x) -> int | None:
    if isinstance(x, torch.ScriptObject):
        try:
            return dist.ProcessGroup.unbox(x).size()
        except RuntimeError:  # another script class (ReduceOp, options)
            return None
    if isinstance(x, str):
        try:
            return dist.distributed_c10d._resolve_process_group(x).size()
        except (RuntimeError, ValueError, KeyError):
            return None
    return None


def _group_size(args) -> int:
    for a in args:
        n = _pg_size(a)
        if n is not None:
            return n
    return 1


# op name -> (kind, index of the argument whose bytes are the full buffer)
_C10D = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "allgather_": ("all_gather", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_": ("all_to_all", 1),
    "alltoall_base_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0),
    "scatter_": ("scatter", 1),
    "gather_": ("gather", 0),
    "reduce_": ("reduce", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
}
# functional ops: buffer = output for gathers, input otherwise
_FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}


class CommBytes(TorchDispatchMode):
    """Records every collective (kind, full buffer bytes, group size, phase).

    ``phase`` is a label the caller sets (``cb.phase = "backward"``), or, when
    ``label`` is given, what ``label()`` returns at the time of the collective
    (e.g. the innermost module running, from a ``ModTracker``).
    """

    def __init__(self, label=None) -> None:
        super().__init__()
        self.records: list[Record] = []
        self.phase = "all"
        self.label = label

    def _phase(self) -> str:
        return self.label() if self.label is not None else self.phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Modes run before tensor subclasses, and a mode is off while its
        # handler runs: collectives a DTensor issues inside its own
        # __torch_dispatch__ (an operand redistributed for an op, a loss
        # handler) would go unseen. Deferring to the subclass keeps this mode
        # on the stack while it runs, so they are counted too.
        # (Only distributed tensors: fake tensors, used inside sharding
        # propagation, must be served here.)
        if any(t.__name__ == "DTensor" for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ns = func.namespace
        name = func._schema.name.split("::")[-1]
        if ns == "c10d" and name in _C10D:
            kind, idx = _C10D[name]
            n = _group_size(args)
            self.records.append(Record(kind, _nbytes(args[idx]), n, self._phase()))
        elif ns in ("_c10d_functional", "c10d_functional") and name in _FUNCTIONAL:
            kind = _FUNCTIONAL[name]
            n = _group_size(args)
            buf = _nbytes(out) if kind == "all_gather" else _nbytes(args[0])
            self.records.append(Record(kind, buf, n, self._phase()))
        return out

    def by_kind(self, phase: str | None = None) -> dict[str, dict[str, float]]:
        """``{kind: {"count", "buffer", "wire"}}`` over records (of ``phase``)."""
        table: dict[str, dict[str, float]] = defaultdict(
            lambda: {"count": 0, "buffer": 0, "wire": 0.0}
        )
        for r in self.records:
            if phase is None or r.phase == phase:
                row = table[r.kind]
                row["count"] += 1
                row["buffer"] += r.buffer
                row["wire"] += r.wire
        return dict(table)

    @property
    def wire(self) -> float:
        return sum(r.wire for r in self.records)

    @property
    def buffer(self) -> int:
        return sum(r.buffer for r in self.records)
