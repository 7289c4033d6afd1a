"""What dispatch remembers, in one place: the op records and the call table.

``OPS``: one ``OpInfo`` per op overload (``dtensor.dispatch.op``), keyed by
the overload's C handle (``func._op`` hashes in C; an ``OpOverload`` hashes
in Python). ``TABLE``: one ``Plan`` per call key. A call key is built in one
pass over the arguments by ``dtensor.dispatch.fast`` and nowhere else: the op
handle, then each argument in order: a DTensor as its spec, a plain operand
as ``(PLAIN, shape, dtype, device)``, an int or None as itself, a float or
complex as its type alone (no rule or result type depends on its value, but
for the ops in ``VALUE_KEYED``, whose floats are appended as values), a
list or tuple as the tuple of its items' keys, any other value as
``(type, value)`` (2, 2.0 and True hash alike but promote differently);
then each keyword and its value's key.

Nothing here is per rank or per world: a spec's mesh carries its rank and
world in its identity, so a plan, and the fast form it carries, is a function
of its key, and ranks that share a process (threads of a simulated world)
share the table safely. A gone world's plans are never served again, and
``dist.destroy_process_group()`` drops them (with everything else: plans are
cheap to make again), so they do not keep its groups alive.

``SHARED``: the plans of ``TABLE`` once more, keyed by their call key with
every spec's rank left out, kept only where several ranks share the process
(a simulated world): each rank takes another's plan re-bound to its own mesh
instead of propagating the call again (``dtensor.dispatch.shared``).

Beside these, ``dtensor.dispatch.meta`` keeps what meta kernels gave, keyed
by global metadata and argument values (no mesh, no rule), so every rank of
a process shares it and no rule change can make it stale.

``forget`` is the one way anything here is dropped: ``register_rule`` calls it
for the ops it changes (through ``sharding.on_register``), and the end of a
world (``dtensor._comm.on_world_end``) calls it with no argument, which drops
everything (``dtensor.dispatch.forget()``).
"""

from __future__ import annotations

import torch

from dtensor import _comm
from dtensor.dispatch.op import OpInfo, describe
from dtensor.sharding import on_register

__all__ = [
    "CACHE_LIMIT", "OPS", "PLAIN", "SHARED", "TABLE", "VALUE_KEYED", "forget", "record",
    "remember",
]

_aten = torch.ops.aten

CACHE_LIMIT = 1 << 16  # calls in TABLE (and in SHARED); cleared when full (new shapes forever)
PLAIN = object()  # key marker: a plain tensor operand follows as shape, dtype, device
OPS: dict = {}
TABLE: dict = {}
SHARED: dict = {}  # rank-free call key -> (mesh planned on, plan): dtensor.dispatch.shared
# Ops whose placements depend on a float argument's value: a norm of a
# sharded tensor is Partial("norm<p>") with p its order (dtensor/rules/norms.py).
VALUE_KEYED = frozenset(op._op for op in (
    _aten._foreach_norm.Scalar, _aten.linalg_vector_norm.default, _aten.dist.default,
))


def record(func) -> OpInfo:
    """The record of op overload ``func``."""
    info = OPS.get(func._op)
    if info is None:
        info = OPS[func._op] = describe(func)
    return info


def remember(key, plan) -> None:
    """Keep ``plan`` for calls with ``key``."""
    if len(TABLE) >= CACHE_LIMIT:
        TABLE.clear()
    TABLE[key] = plan


def forget(ops: frozenset | None = None) -> None:
    """Drop the records and plans of ``ops`` (overloads), or of every op."""
    if ops is None:
        OPS.clear()
        TABLE.clear()
        SHARED.clear()
        return
    handles = {op._op for op in ops}
    for h in handles:
        OPS.pop(h, None)
    for table in (TABLE, SHARED):  # both keys start with the op's handle
        for key in [k for k in list(table) if k[0] in handles]:
            table.pop(key, None)


on_register(forget)
_comm.on_world_end(forget)
