"""Covers: dtensor/rules/matmul.py (and the products that decompose into
``mul``, ``take`` and ``gather``) against PyTorch's DTensor, as the
communication audit (bench/comm_audit.py) counts it: the op plus making its
result a full tensor, 2-rank Gloo world. Pieces of a max/min must be reduced
before a product; onto a shard of the contracted dim (reduce-scatter) where
the output is small, replicated (all-reduce) where it is large. A bias
counts what it must move to the output's layout, so products with a bias
keep the output where the bias already is. An outer product gathers its
vectors rather than its output; an operand moves to a shard of another dim
only where that and the output's gather cost less than replicating; a
product of two partial sums reduces the smaller factor; ``take`` keeps
pieces against a reduced index, and ``take_along_dim`` moves the smaller of
source and index. Ours must send no more wire bytes (for equal bytes, no
more collectives) than PyTorch's and equal single device.
"""

from __future__ import annotations

import pytest
import torch
from test_comm_audit_fixes_dist import _check_no_more_than_torch, _pieces, _run


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


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("R", "S0", "R"), ("R", "R", "S0"), ("R", "S0", "S0")])
def test_an_outer_product_gathers_its_vectors_rather_than_its_output(world, layouts) -> None:
    # addr's (5, 10) output holds more than both vectors together
    shapes = ((), (5,), (10,))
    _check_no_more_than_torch(world, torch.addr, [(lay, _pieces(sh, 110 + i, 1))
                                                  for i, (lay, sh) in enumerate(zip(
                                                      layouts, shapes, strict=True))])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("S0", "S0"), ("R", "S0"), ("S0", "R")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_vdot_reduces_a_partial_sum_of_shards(world, layouts, dtype) -> None:
    a, b = _pieces((6,), 120, 1), _pieces((6,), 121, 1)
    if dtype.is_complex:  # vdot conjugates its first operand
        a, b = [torch.complex(x, x.flip(0)) for x in a], [torch.complex(x.flip(0), x) for x in b]
    _check_no_more_than_torch(world, torch.vdot, [(layouts[0], a), (layouts[1], b)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("sa", "sb", "layouts"), [
    # batch-shard b (a gather), keep a's, gather the smaller output later
    ((10, 5, 10), (10, 10, 5), ("S0", "S1")), ((10, 5, 10), (10, 10, 5), ("S2", "S0")),
    # of equal moves, the one that keeps an operand's shard
    ((10, 5, 10), (10, 10, 5), ("S0", "S2")), ((10, 5, 10), (10, 10, 5), ("S1", "S0")),
])
def test_an_operand_moves_to_another_shard_only_where_that_moves_less(
        world, sa, sb, layouts) -> None:
    _check_no_more_than_torch(world, torch.bmm, [(layouts[0], _pieces(sa, 130, 1)),
                                                 (layouts[1], _pieces(sb, 131, 1))])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("S1", "S0"), ("S2", "S0")])
def test_operands_are_replicated_where_a_moved_shard_leaves_a_large_output(
        world, layouts) -> None:
    # moving a to the batch shard costs 32 values, but leaves the (2, 16, 32)
    # output to gather; gathering both operands (96 values) costs less
    inputs = [(layouts[0], _pieces((2, 16, 1), 132, 1)), (layouts[1], _pieces((2, 1, 32), 133, 1))]
    _check_no_more_than_torch(world, torch.bmm, inputs)
    got, _ = _run(world, torch.bmm, inputs)
    assert got["ours"][1] < 512, f"ours {got['ours'][1]:.0f} B: the output was gathered"


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("R", "S1", "S0"), ("S1", "S1", "S0")])
def test_linear_moves_the_weight_to_the_bias_shard(world, layouts) -> None:
    # one gather of the weight, not of the weight and the bias
    shapes = ((0, 3), (4, 3), (4,))
    _check_no_more_than_torch(world, torch.nn.functional.linear,
                              [(lay, _pieces(sh, 140 + i, 1))
                               for i, (lay, sh) in enumerate(zip(layouts, shapes, strict=True))])


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("fn", "sa", "sb"), [
    (lambda a, b: torch.einsum("i,j->ij", a, b), (3,), (4,)),
    (torch.inner, (), (5, 5)), (torch.outer, (5,), (10,)), (torch.kron, (5, 5), (10, 20)),
], ids=["einsum", "inner", "outer", "kron"])
def test_a_product_of_partial_sums_reduces_the_smaller_factor(world, fn, sa, sb) -> None:
    _check_no_more_than_torch(world, fn, [("Psum", _pieces(sa, 150)), ("Psum", _pieces(sb, 151))])


@pytest.mark.world_size(2)
def test_take_of_partial_sums_by_a_partial_index_keeps_the_pieces(world) -> None:
    index = torch.tensor([0, 4, 8])
    off = torch.ones_like(index)
    _check_no_more_than_torch(world, torch.take, [("Psum", _pieces((3, 3), 160)),
                                                  ("Psum", [index - off, off])])


@pytest.mark.world_size(2)
def test_take_along_dim_moves_the_smaller_of_source_and_index(world) -> None:
    # the int64 index holds twice the bytes of the float source
    index = torch.randint(0, 5, (5, 5), generator=torch.Generator().manual_seed(170))
    _check_no_more_than_torch(world, lambda x, i: torch.take_along_dim(x, i, 0),
                              [("S1", _pieces((5, 5), 171, 1)), ("S0", [index])])
