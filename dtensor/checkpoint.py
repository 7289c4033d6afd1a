"""Saving and loading DTensors: ``torch.save``/``torch.load`` and distributed checkpoints.

Two ways to persist DTensors:

1. ``torch.save(dt, f)`` / ``torch.load(f)`` (``weights_only=True``, the
   default, works): each rank saves and loads its own block. A DTensor pickles
   as (local block, mesh ranks, placements, global shape), rebuilt by one
   allowlisted function, ``dtensor.tensor.rebuild_dtensor`` (also
   importable from here). Load in a
   world of the same size as the one that saved; the loading rank's block is
   the one it saved.

2. ``torch.distributed.checkpoint`` (DCP), with **resharding**: save a state
   dict of DTensors on one mesh and layout, load it into DTensors on another
   mesh or layout (another number of ranks, uneven shards included). DTensor
   implements DCP's tensor-subclass protocol (``__create_write_items__``,
   ``__create_chunk_list__``, ``__get_tensor_shard__``), so plain
   ``dcp.save(sd, checkpoint_id=path)`` / ``dcp.load(sd, checkpoint_id=path)``
   work when every rank of the world calls them (ranks outside a DTensor's mesh
   write and read nothing for it). ``save``/``load`` below do the same but run
   DCP over only the ranks of the state dict's meshes, so a checkpoint of a
   sub-mesh never needs the other ranks.

Example (save on 4 ranks as Shard(0), resume on 2 ranks replicated)::

    import dtensor.checkpoint as ckpt
    mesh4 = init_device_mesh("cpu", (4,))
    ckpt.save({"w": distribute_tensor(w, mesh4, [Shard(0)]), "step": 7}, path)

    mesh2 = DeviceMesh("cpu", [0, 1])              # ranks 2, 3 need not call
    sd = {"w": distribute_tensor(torch.empty_like(w), mesh2, [Replicate()]),
          "step": 0}
    ckpt.load(sd, path)                            # fills sd["w"] in place
    sd["step"]                                     # 7 (non-tensors are replaced)

To load, build the state dict you want (the target meshes and placements,
any values, e.g. ``model.state_dict()`` of a freshly parallelised model) and
pass it to ``load``: DTensor blocks are overwritten in place, so the model's
parameters hold the checkpoint afterwards; other values are replaced in the
dict. Saved ``Partial`` DTensors are refused (reduce them first), as in torch.

Model and optimizer together (resume training on another mesh or layout):
torch's ``get_state_dict``/``set_state_dict`` work on our DTensor parameters
and key optimizer state by parameter name, so Adam's moments reshard like
the parameters (``tests/test_checkpoint_dist.py`` resumes a 4-rank run on 2
ranks this way)::

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, opt)
    ckpt.save({"model": msd, "optim": osd, "step": step}, path)
    # later, maybe elsewhere: build model/opt with the new plan, then
    msd, osd = get_state_dict(model, opt)          # the target layout
    sd = {"model": msd, "optim": osd, "step": 0}
    ckpt.load(sd, path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from dtensor import _comm, _persist
from dtensor.errors import ShardingError
from dtensor.tensor import DTensor, rebuild_dtensor

__all__ = [
    "CheckpointError",
    "load",
    "object_collectives_without_numpy",
    "process_group_for",
    "rebuild_dtensor",
    "save",
]


# save / load over the state dict's ranks ---------------------------------------
def _dtensors(obj: Any, name: str = ""):
    """(key path, DTensor) for every DTensor in a nested state dict."""
    if isinstance(obj, DTensor):
        yield name, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _dtensors(v, f"{name}.{k}" if name else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _dtensors(v, f"{name}.{i}" if name else str(i))
    elif hasattr(obj, "state_dict") and callable(obj.state_dict):
        yield from _dtensors(obj.state_dict(), name)


def process_group_for(state_dict: Mapping) -> tuple[bool, Any]:
    """(does this rank take part, process group) for checkpointing ``state_dict``.

    The group spans the union of the ranks of every DTensor's mesh in the
    state dict (the world when there is no DTensor). Ranks outside that union
    do not take part.
    """
    meshes = {dt._spec.mesh: None for _, dt in _dtensors(state_dict)}
    if not _comm.is_initialized():
        return True, None
    if not meshes:
        return True, None
    ranks = sorted({r for m in meshes for r in m.ranks})
    if _comm.get_rank() not in ranks:
        return False, None
    if ranks == list(range(_comm.get_world_size())):
        return True, None
    return True, _comm.group_for(ranks)


class CheckpointError(ShardingError):
    """A checkpoint call failed on another rank before DCP started on this one."""


def _agree(error: Exception | None, group, what: str) -> None:
    """Raise on every taking-part rank if any failed before DCP's collectives.

    DCP agrees on failures inside its own steps, but an error raised before it
    starts (a state dict that differs on one rank, say) would leave the other
    ranks blocked in its first collective. One small all-gather instead:
    the failing ranks raise their own error, the others a ``CheckpointError``
    naming them.
    """
    if _comm.is_initialized() and _comm.get_world_size() > 1:
        import torch.distributed as dist

        group = group if group is not None else dist.group.WORLD
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int64)
        flags = _comm.all_gather(flag, group)
        ranks = dist.get_process_group_ranks(group)
        failed = [r for r, f in zip(ranks, flags, strict=True) if int(f.item())]
    else:
        failed = [] if error is None else [_comm.get_rank()]
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(
            f"{what}: rank{'s' if len(failed) > 1 else ''} "
            f"{','.join(map(str, failed))} failed before writing or reading anything "
            "(see their error); no rank went on"
        )


def _prepare(state_dict: Mapping, verb: str, preposition: str) -> tuple[bool, Any]:
    """(does this rank take part, group), once every taking-part rank passed the checks.

    Checked before DCP runs, so a failing rank raises its own error (DCP
    would wrap it in a CheckpointException) and the others raise with it.
    """
    error = None
    try:
        for fqn, dt in _dtensors(state_dict):
            _persist.refuse_partial(dt, f"dtensor.checkpoint.{verb} {preposition} {fqn!r}")
    except Exception as e:  # any local failure: the others must not wait for us
        error = e
    member, group = process_group_for(state_dict)
    if not member:
        if error is not None:
            raise error
        return False, None
    _agree(error, group, f"dtensor.checkpoint.{verb}")
    return True, group


def _tensor_to_object(tensor, tensor_size, group):
    # Same as torch's, but reads the bytes without numpy.
    import torch.distributed.distributed_c10d as c10d

    t = tensor.cpu().contiguous()
    buf = ctypes.string_at(t.data_ptr(), min(int(tensor_size), t.numel()))
    return c10d._unpickler(io.BytesIO(buf)).load()


@contextlib.contextmanager
def object_collectives_without_numpy() -> Iterator[None]:
    """Let torch's object collectives (which DCP uses) run where numpy is missing.

    torch decodes every received object through ``Tensor.numpy()``; without
    numpy, DCP fails on its first plan exchange. Inside this block (entered by
    ``save``/``load``), received bytes are read directly instead. A no-op when
    numpy is installed.
    """
    import torch.distributed.distributed_c10d as c10d

    try:
        import numpy  # noqa: F401

        yield
        return
    except ImportError:
        pass
    # NOTE: patches a module global for the duration of the block; DCP calls
    # from other threads at the same time see it too (it is equivalent).
    saved = c10d._tensor_to_object
    c10d._tensor_to_object = _tensor_to_object
    try:
        yield
    finally:
        c10d._tensor_to_object = saved


def save(state_dict: Mapping, checkpoint_id: str | os.PathLike, **dcp_kwargs) -> None:
    """Write ``state_dict`` (DTensors, tensors, Python values) as a DCP checkpoint.

    Every rank of the state dict's meshes must call it; other ranks may call
    it too and return at once. Extra keyword arguments go to
    ``torch.distributed.checkpoint.save`` (``storage_writer``, ``planner``).

    Example:
        >>> dtensor.checkpoint.save(model.state_dict(), "/ckpt/step100")
    """
    import torch.distributed.checkpoint as dcp

    member, group = _prepare(state_dict, "save", "of")
    if not member:
        return
    with object_collectives_without_numpy():
        dcp.save(state_dict, checkpoint_id=checkpoint_id, process_group=group, **dcp_kwargs)


def load(state_dict: dict, checkpoint_id: str | os.PathLike, **dcp_kwargs) -> None:
    """Fill ``state_dict`` from a DCP checkpoint, resharding to its DTensors' layouts.

    DTensors (and plain tensors) are written in place, so a model whose
    ``state_dict()`` was passed holds the checkpoint afterwards; other values
    are replaced in ``state_dict``. The checkpoint may have been saved on
    another mesh, number of ranks or placements. Every rank of the state
    dict's meshes must call it; other ranks return at once.

    Example:
        >>> sd = model.state_dict()
        >>> dtensor.checkpoint.load(sd, "/ckpt/step100")
    """
    import torch.distributed.checkpoint as dcp

    member, group = _prepare(state_dict, "load", "into")
    if not member:
        return
    with object_collectives_without_numpy():
        dcp.load(state_dict, checkpoint_id=checkpoint_id, process_group=group, **dcp_kwargs)
