"""Covers: dtensor/rules/matmul.py with pieces of a max or min against
PyTorch's DTensor, as the communication audit (bench/comm_audit.py) counts
it: the op plus making its result a full tensor, 2-rank Gloo world. Pieces
of a max/min must be reduced before a product; onto a shard of the
contracted dim (reduce-scatter) where the output is small, replicated
(all-reduce) where it is large. A bias counts what it must move to the
output's layout, so products with a bias keep the output where the bias
already is. Ours must send no more wire bytes (for equal bytes, no more
collectives) than PyTorch's and equal single device.
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


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("name", "shapes", "layouts"), [
    ("addmm", ((4, 6), (4, 5), (5, 6)), ("S1", "S0", "S1")),
    ("addmm", ((4, 6), (4, 5), (5, 6)), ("S0", "S1", "R")),
    ("addr", ((5, 10), (5,), (10,)), ("S0", "R", "S0")),
    ("addr", ((5, 10), (5,), (10,)), ("S1", "S0", "R")),
    ("baddbmm", ((4, 5, 6), (4, 5, 3), (4, 3, 6)), ("S0", "S2", "R")),
    ("baddbmm", ((4, 5, 6), (4, 5, 3), (4, 3, 6)), ("S1", "R", "S1")),
    ("baddbmm", ((4, 5, 6), (4, 5, 3), (4, 3, 6)), ("Psum", "R", "R")),
])
def test_products_with_a_bias_keep_the_bias_layout(world, name, shapes, layouts) -> None:
    fn = getattr(torch, name)
    _check_no_more_than_torch(world, fn, [(lay, _pieces(sh, 100 + i, 1 if lay[0] != "P" else 2))
                                          for i, (lay, sh) in enumerate(zip(layouts, shapes,
                                                                            strict=True))])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("R", "S1"), ("S2", "R"), ("S2", "S1"), ("S0", "S1")])
def test_a_small_operand_is_gathered_rather_than_a_large_partial_output(
        world, layouts) -> None:
    # (2, 16, 1) @ (2, 1, 32): the contracted dim is cut, but the partial
    # output (1,024 values) would cost more to reduce than gathering 64
    _check_no_more_than_torch(world, torch.bmm, [(layouts[0], _pieces((2, 16, 1), 92)),
                                                 (layouts[1], _pieces((2, 1, 32), 93))])
