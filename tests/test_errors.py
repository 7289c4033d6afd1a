"""Covers: dtensor/errors.py: the same bad inputs are catchable as the type
PyTorch's DTensor raises, checked side by side on a Gloo world."""

from __future__ import annotations

import pytest
import torch
from torch.distributed import tensor as tt
from torch.distributed.device_mesh import DeviceMesh as TorchMesh

import dtensor as dt
from dtensor.experimental import local_map

BUILTINS = (NotImplementedError, KeyError, IndexError, ValueError, RuntimeError)


def _raised(fn) -> BaseException:
    try:
        fn()
    except Exception as e:
        return e
    raise AssertionError(f"{fn} raised nothing")


def _builtin(e: BaseException) -> type:
    return next(t for t in type(e).__mro__ if t in BUILTINS)


def _same_catch(theirs, ours) -> dt.ShardingError:
    """Ours is catchable as the built-in type torch raised, and is one of ours."""
    t_err, o_err = _raised(theirs), _raised(ours)
    want = _builtin(t_err)
    assert isinstance(o_err, want), f"torch raised {want.__name__}, we raised {o_err!r}"
    assert isinstance(o_err, dt.ShardingError) and not isinstance(o_err, TypeError)
    assert not str(o_err).startswith("'")  # KeyError's quoting is not ours
    return o_err


@pytest.fixture
def meshes(world):
    ours = dt.DeviceMesh("cpu", list(world.ranks), mesh_dim_names=("tp",))
    theirs = TorchMesh.from_group(world.group, "cpu", mesh_dim_names=("tp",))
    return ours, theirs


@pytest.mark.world_size(2)
def test_placement_errors_match_torch(world, meshes) -> None:
    ours, theirs = meshes
    t = torch.ones(4, 4)
    e = _same_catch(lambda: tt.distribute_tensor(t, theirs, [tt.Shard(0), tt.Shard(1)]),
                    lambda: dt.distribute_tensor(t, ours, [dt.Shard(0), dt.Shard(1)]))
    assert isinstance(e, ValueError) and "one per mesh axis" in str(e)
    e = _same_catch(lambda: tt.distribute_tensor(t, theirs, [tt.Shard(2)]),
                    lambda: dt.distribute_tensor(t, ours, [dt.Shard(2)]))
    assert isinstance(e, dt.ShardDimError) and "valid shard dims are -2..1" in str(e)
    _same_catch(lambda: tt.DTensor.from_local(t, theirs, [tt.Shard(0)], stride=(4, 1)),
                lambda: dt.DTensor.from_local(t, ours, [dt.Shard(0)], stride=(4, 1)))


@pytest.mark.world_size(2)
def test_mesh_errors_match_torch(world, meshes) -> None:
    ours, theirs = meshes
    e = _same_catch(lambda: theirs["zz"], lambda: ours["zz"])
    assert isinstance(e, KeyError) and "no axis named 'zz'" in str(e)
    _same_catch(lambda: theirs.get_local_rank("zz"), lambda: ours.get_local_rank("zz"))
    e = _same_catch(lambda: theirs.size(5), lambda: ours.size(5))
    assert isinstance(e, IndexError) and "out of range" in str(e)
    _same_catch(lambda: TorchMesh("cpu", [0, 1, 2, 3, 4, 5, 6, 7, 8]),
                lambda: dt.DeviceMesh("cpu", [0, 1, 2, 3, 4, 5, 6, 7, 8]))


@pytest.mark.world_size(2)
def test_cross_mesh_and_mixed_operand_errors_match_torch(world, meshes) -> None:
    ours, theirs = meshes
    ours2 = dt.DeviceMesh("cpu", list(world.ranks), mesh_dim_names=("other",))
    theirs2 = TorchMesh.from_group(world.group, "cpu", mesh_dim_names=("other",))
    t = torch.ones(4, 4)
    a, b = dt.distribute_tensor(t, ours, [dt.Shard(0)]), dt.distribute_tensor(t, ours2, [dt.Shard(0)])
    ta, tb = tt.distribute_tensor(t, theirs, [tt.Shard(0)]), tt.distribute_tensor(t, theirs2, [tt.Shard(0)])
    e = _same_catch(lambda: ta.redistribute(theirs2, [tt.Replicate()]),
                    lambda: a.redistribute(ours2, [dt.Replicate()]))
    assert isinstance(e, NotImplementedError) and isinstance(e, dt.CrossMeshError)
    _same_catch(lambda: ta + tb, lambda: a + b)
    _same_catch(lambda: ta + t, lambda: a + t)


@pytest.mark.world_size(2)
def test_checkpoint_and_local_map_errors_match_torch(world, meshes) -> None:
    ours, theirs = meshes
    t = torch.ones(4)
    p_theirs = tt.distribute_tensor(t, theirs, [tt.Partial()])
    p_ours = dt.distribute_tensor(t, ours, [dt.Partial()])
    _same_catch(lambda: p_theirs.__create_write_items__("p", p_theirs),
                lambda: p_ours.__create_write_items__("p", p_ours))
    from torch.distributed.tensor.experimental import local_map as torch_local_map

    s_theirs = tt.distribute_tensor(t, theirs, [tt.Shard(0)])
    s_ours = dt.distribute_tensor(t, ours, [dt.Shard(0)])
    _same_catch(
        lambda: torch_local_map(torch.neg, [tt.Shard(0)], ([tt.Replicate()],))(s_theirs),
        lambda: local_map(torch.neg, [dt.Shard(0)], ([dt.Replicate()],))(s_ours),
    )


def test_no_error_of_ours_is_a_type_error() -> None:
    for name in dt.errors.__all__:
        err = getattr(dt.errors, name)
        assert issubclass(err, dt.ShardingError) and issubclass(err, RuntimeError)
        assert not issubclass(err, TypeError), name
    assert str(dt.MeshAxisError("plain message")) == "plain message"
