"""Covers: dtensor._mesh_layout. Meshes of one layout share one ``Layout``
(the rank tuple, the grid, each rank's coordinate and axis lines), so the
ranks of a simulated world check and index a big mesh once, not once each;
what a rank reads from it equals what indexing its own grid gives."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dtensor import DeviceMesh
from dtensor._mesh_layout import shared_layout

SHAPES = [(6,), (2, 3), (3, 1, 4), (2, 2, 2, 2)]


def _brute_line(grid: torch.Tensor, coord: tuple[int, ...], axis: int) -> tuple[int, ...]:
    index = list(coord)
    index[axis] = slice(None)
    return tuple(grid[tuple(index)].tolist())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_coordinates_and_lines_match_the_grid(shape) -> None:
    # Ranks in a scrambled order with a gap (rank 2 * size is absent), so a
    # coordinate that assumed row-major 0..n-1 would be caught.
    n = math.prod(shape)
    ranks = [(7 * i + 3) % (2 * n + 1) for i in range(n)]
    grid = torch.tensor(ranks).reshape(shape)
    layout = shared_layout(tuple(ranks), grid)
    for coord in itertools.product(*(range(s) for s in shape)):
        rank = int(grid[coord])
        assert layout.coordinate(rank) == coord
        for axis in range(len(shape)):
            assert layout.line(coord, axis) == _brute_line(grid, coord, axis), (coord, axis)
    assert layout.coordinate(2 * n + 5) is None  # not in the grid


def _mesh(grid, **kw) -> DeviceMesh:
    # Geometry only (no groups): the same on any rank of any world, torchrun's too.
    return DeviceMesh("cpu", grid, _init_backend=False, **kw)


def test_equal_layouts_are_one_object_and_lines_are_shared() -> None:
    a = _mesh([[0, 1, 2], [3, 4, 5]])
    b = _mesh(torch.arange(6).reshape(2, 3))
    assert a._layout is b._layout and a.mesh is b.mesh and a.ranks is b.ranks
    coord = a.get_coordinate()
    if coord is None:  # a rank of a bigger world, outside these 6
        return
    assert a._axis_ranks(1) is b._axis_ranks(1) == _brute_line(a.mesh, coord, 1)
    assert a._axis_ranks(0) == _brute_line(a.mesh, coord, 0)
    other = _mesh([[0, 1], [2, 3], [4, 5]])  # same ranks, other shape
    assert other._layout is not a._layout
    assert other._axis_ranks(0) == _brute_line(other.mesh, other.get_coordinate(), 0)


def test_a_mesh_from_a_shared_grid_is_checked_against_its_names() -> None:
    # The shared grid skips the O(ranks) checks, never the names' ones.
    from dtensor._mesh_layout import _row_major
    from dtensor.errors import MeshError

    mesh = _mesh(_row_major((2, 3)))  # init_device_mesh's grid
    assert _row_major((2, 3)) is mesh.mesh
    with pytest.raises(MeshError, match="expected 2 unique mesh_dim_names"):
        _mesh(mesh.mesh, mesh_dim_names=("dp",))
    assert _mesh(mesh.mesh, mesh_dim_names=("dp", "tp")).shape == (2, 3)


def test_a_changed_caller_grid_never_changes_a_mesh() -> None:
    mine = torch.tensor([[0, 1], [2, 3]])
    mesh = _mesh(mine)
    mine[0, 0] = 3  # the caller's tensor, not the shared copy
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
