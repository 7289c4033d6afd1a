"""Vocabulary-parallel embedding lookup (``RowwiseParallel`` on ``nn.Embedding``).

Each rank holds a contiguous range of the table's rows. It looks up the ids
that fall in its range, zeroes the rows of the others, and the result is a
``Partial(sum)``: exactly one rank contributes each row, so the pending sum is
the full lookup. Nothing is gathered; the reduction happens when the output
is laid out (all-reduce to ``Replicate``, reduce-scatter to ``Shard``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtensor.placement import Partial, Replicate
from dtensor.tensor import DTensor

__all__ = ["vocab_parallel_forward"]


def vocab_parallel_forward(module: nn.Embedding, ids) -> DTensor:
    """``module(ids)`` with ``module.weight`` a ``Shard(0)`` DTensor on a 1-D mesh."""
    weight: DTensor = module.weight
    mesh = weight.device_mesh
    if isinstance(ids, DTensor):
        ids = ids.redistribute(mesh, [Replicate()]).to_local()
    out_shape = (*ids.shape, weight.shape[1])
    coord = mesh.get_coordinate()
    if coord is None:  # outside the mesh: an empty block, no communication
        return DTensor.from_local(weight.to_local().new_empty(0), mesh, [Partial()], shape=out_shape)
    (rows, _), (start, _) = weight._spec.local_block(coord)
    table = weight.to_local()  # [rows, dim]; its gradient comes back as Shard(0)
    outside = (ids < start) | (ids >= start + rows)
    if rows == 0:  # an uneven table can leave a rank without rows
        out = table.new_zeros(out_shape) + table.sum() * 0
    else:
        local_ids = torch.where(outside, torch.zeros_like(ids), ids - start)
        pad = module.padding_idx
        pad = pad - start if pad is not None and start <= pad < start + rows else None
        out = F.embedding(local_ids, table, pad, None, 2.0, False, module.sparse)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # [*ids.shape, dim]
    return DTensor.from_local(out, mesh, [Partial()], shape=out_shape)
