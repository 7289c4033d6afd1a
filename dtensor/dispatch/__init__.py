"""``__torch_dispatch__`` for DTensor, split along its data flow.

``fast``: one pass over the arguments builds the call key, one lookup in the
call table (``cache``) -> a plan with a fast form runs at once; else
``general``: special ops, else one ``call.Call`` (the call flattened once) ->
``propagate``: the op's rule gives a ``Plan``, with ``meta`` for the outputs'
global metadata -> ``execute``: redistribute operands, run the op, write
back, wrap the results once. Every stage reads the op's one record
(``op.OpInfo``); ``cache.forget`` is the one way anything is dropped.
``shared``: the ranks of a simulated world take each other's plans,
re-bound to their own meshes, instead of each propagating the call.

Dispatch sits below the DTensor class (the class calls it), so it never
imports the class: ``dtensor.tensor`` hands it over once with ``serve``.
``guard``: users' rules' claimed output blocks are checked once per new plan.
"""

from __future__ import annotations

from dtensor.dispatch import fast, guard, wrap
from dtensor.dispatch.cache import forget
from dtensor.dispatch.call import implicit_replication
from dtensor.dispatch.fast import dispatch

__all__ = ["check_builtin_rules", "dispatch", "forget", "implicit_replication", "serve"]


def serve(tensor_type: type) -> None:
    """Make dispatch wrap results in ``tensor_type`` (called by dtensor.tensor).

    ``wrap.DTensor`` is where all of dispatch reads the class; the fast path
    keeps its own name for it (one global read per argument, not a global
    read and an attribute read).
    """
    wrap.DTensor = fast.DTensor = tensor_type


def check_builtin_rules(on: bool = True) -> None:
    """Check built-in rules' claimed output blocks too, as users' rules always
    are (a debugging aid: one meta run of the op per distinct block shape on
    each first-seen call; env ``DTENSOR_CHECK_RULES=all`` at import)."""
    guard.check_all(on)
    forget()  # the records carry the flag: rebuild them
