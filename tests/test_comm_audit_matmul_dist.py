"""Covers: dtensor/rules/matmul.py with pieces of a max or min against
PyTorch's DTensor, as the communication audit (bench/comm_audit.py) counts
it: the op plus making its result a full tensor, 2-rank Gloo world. Pieces
of a max/min must be reduced before a product; onto a shard of the
contracted dim (reduce-scatter) where the output is small, replicated
(all-reduce) where it is large. Ours must send no more wire bytes (for
equal bytes, no more collectives) than PyTorch's and equal single device.
"""

from __future__ import annotations

import pytest
import torch
from test_comm_audit_fixes_dist import _check_no_more_than_torch, _pieces


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("name", "sa", "sb", "layouts"), [
    ("dot", (6,), (6,), ("Pmax", "R")), ("dot", (6,), (6,), ("R", "Pmin")),
    ("dot", (6,), (6,), ("Pmax", "Pmax")),
    # a shard of the size-1 dim of ``b.view(6, 1)`` would leave a rank empty
    ("inner", (3, 6), (6,), ("R", "Pmin")),
])
def test_products_of_max_min_pieces_reduce_onto_the_cheaper_layout(
        world, name, sa, sb, layouts) -> None:
    fn = getattr(torch, name)
    _check_no_more_than_torch(world, fn, [(layouts[0], _pieces(sa, 90)),
                                          (layouts[1], _pieces(sb, 91))])
