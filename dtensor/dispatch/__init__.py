"""``__torch_dispatch__`` for DTensor, split along its data flow.

``fast``: one pass over the arguments, one lookup, the op on local tensors ->
``general``: special ops, else one ``call.Call`` (the call flattened once) ->
``propagate``: the op's rule (cached) gives a ``Plan``, with ``meta`` for the
outputs' global metadata -> ``execute``: redistribute operands, run the op,
write back, wrap the results once.

Dispatch sits below the DTensor class (the class calls it), so it never
imports the class: ``dtensor.tensor`` hands it over once with ``serve``.
"""

from __future__ import annotations

from dtensor.dispatch import call, execute, fast, general, random_ops
from dtensor.dispatch.call import implicit_replication
from dtensor.dispatch.fast import dispatch

__all__ = ["dispatch", "implicit_replication", "serve"]


def serve(tensor_type: type) -> None:
    """Make dispatch wrap results in ``tensor_type`` (called by dtensor.tensor)."""
    for module in (call, execute, fast, general, random_ops):
        module.DTensor = tensor_type
