"""Random ops on plain tensors inside an FSDP forward: the single-device draw.

Under FSDP each data-parallel rank runs the model on its rows of the batch,
as plain tensors. While the root ``FSDPModule``'s forward runs in training
mode, dropout (``F.dropout``, ``nn.Dropout``), ``torch.rand_like`` and
``torch.randn_like`` on a plain tensor draw from dtensor's generator as this
rank's block of the draw for the whole batch: the global tensor is every data-parallel rank's
tensor concatenated along dim 0, in rank order (HSDP: replica-major). So the
masks are the ones ``dtensor.random.dropout`` gives the whole batch on one
device, and training with dropout equals single-device training. The
routing stays on for models that hold a dropout module (``_DropoutNd`` with
``p > 0``) or whose first training forward drew through one of these ops
(not looked for in models with compiled blocks); other models run later
forwards without it.

The local batch is dim 0 of the root forward's first tensor argument; the
first random op of a forward all-gathers it over the data-parallel ranks
(one 8-byte collective per forward, none without random ops). A plain tensor
whose dim 0 is ``k`` times the local batch is ``k`` rows per sample (batch
major, e.g. ``(batch * seq, dim)``). Under FSDP + TP, a DTensor on another
mesh (a tensor-parallel activation, e.g. sequence-parallel dropout's input)
holds this rank's rows the same way: its block of the draw moves down by
the rows of the data-parallel ranks before this one. Partial DTensors and
interleaved (``StridedShard``) rows keep the DTensor rules.
``dtensor.random.dropout`` on a plain tensor defers to this mode too.

Example:
    >>> fully_shard(model, mesh=mesh)          # model holds nn.Dropout(0.1)
    >>> loss = model(x.chunk(n)[rank]).sum()   # masks: rows of the full batch's
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from dtensor import _comm, _seeding
from dtensor._random_blocks import (
    _threshold,
    bernoulli_block,
    normal_block,
    uniform_block,
)
from dtensor.fsdp.errors import FSDPError
from dtensor.spec import TensorMeta
from dtensor.strided import has_strided
from dtensor.tensor import DTensor

__all__ = ["DataParallelRandom"]


class DataParallelRandom(TorchFunctionMode):
    """Active during the root FSDP module's forward (see the module docstring)."""

    def __init__(self, mesh, local_batch: int | None) -> None:
        super().__init__()
        self.mesh = mesh
        self.local_batch = local_batch
        self.rows: tuple[int, int] | None = None  # (rows before this rank, total rows)
        self.drew = False  # a routed op drew (dropout with 0 < p, or a *_like)

    draws_batch_rows = True  # dtensor.random.dropout defers to this mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else kwargs.get("input")
        if func not in _OPS or not isinstance(x, torch.Tensor) or not _rows_of_batch(x, self):
            return func(*args, **kwargs)
        return _OPS[func](self, *args, **kwargs)

    def draw_block(self, t: torch.Tensor, op: str):
        """(global shape, offset, local shape) of ``t``'s piece of the whole
        batch's draw; None when the batch is empty (no rank draws), ``_OUTSIDE``
        on a rank outside a DTensor's mesh (it takes the offset only). A DTensor (tensor
        parallel activations of this rank's rows) contributes its own block,
        moved down by the rows of the data-parallel ranks before this one."""
        where = self.block(t, op)
        if where is None:
            return None
        gshape, (base, *_) = where
        if not isinstance(t, DTensor):
            return gshape, (base,) + (0,) * (t.dim() - 1), tuple(t.shape)
        coord = t._spec.mesh.get_coordinate()
        if coord is None:
            return _OUTSIDE
        shape, start = t._spec.local_block(coord)
        return gshape, (start[0] + base, *start[1:]), tuple(shape)

    def block(self, t: torch.Tensor, op: str):
        """(global shape, local offset) of ``t`` as its rank's rows of the batch;
        None when the whole batch is empty (nothing is drawn anywhere). A rank
        with no rows of a non-empty batch gets an empty block."""
        if self.local_batch is None:
            raise FSDPError(
                f"{op} inside an FSDP forward: the root module's forward got no tensor "
                "argument, so the data-parallel batch is unknown; pass the batch as "
                "the first tensor argument of the root module"
            )
        if self.rows is None:
            self.rows = _gather_rows(self.mesh, self.local_batch)
        before, total = self.rows
        b = self.local_batch
        if t.dim() == 0 or (b == 0 and t.shape[0] != 0) or (b and t.shape[0] % b):
            raise FSDPError(
                f"{op} inside an FSDP forward: expected a tensor whose dim 0 is a "
                f"multiple of the local batch {b} (batch-major rows), got shape "
                f"{tuple(t.shape)}; move the batch to dim 0 or draw on a DTensor"
            )
        if total == 0:
            return None
        k = t.shape[0] // b if b else 1  # an empty rank's block is empty at any k
        return (total * k, *t.shape[1:]), (before * k,) + (0,) * (t.dim() - 1)


_OUTSIDE = ("outside",)


def _rows_of_batch(x: torch.Tensor, mode: DataParallelRandom) -> bool:
    """Plain tensors are; so are DTensors on meshes apart from the
    data-parallel one (FSDP + TP) whose blocks are plain rectangles: not
    partial (its draws follow the DTensor rules), not interleaved rows."""
    if not isinstance(x, DTensor):
        return True
    spec = x._spec
    return (spec.mesh is not mode.mesh and not spec.has_partial()
            and not has_strided(spec.placements) and x.dim() > 0)


def _gather_rows(mesh, local_batch: int) -> tuple[int, int]:
    """(rows of the data-parallel ranks before this one, rows of all of them)."""
    sizes = torch.tensor([local_batch], dtype=torch.int64)
    for axis in reversed(range(mesh.ndim)):  # shard axis first, then replicas
        sizes = _comm.all_gather_cat(sizes.view(1, -1), mesh.get_group(axis)).view(-1)
    # Now replica-major over the whole mesh: position = flattened coordinate.
    coord = mesh.get_coordinate()
    pos = 0
    for axis, c in enumerate(coord):
        pos = pos * mesh.size(axis) + c
    return int(sizes[:pos].sum()), int(sizes.sum())


def _dropout(mode: DataParallelRandom, input, p=0.5, training=True, inplace=False):
    _threshold(float(p), "dropout")
    if not training or p == 0.0:
        return input
    mode.drew = True
    if p == 1.0:
        return input.mul_(0.0) if inplace else input * torch.zeros((), dtype=input.dtype)
    where = mode.draw_block(input, "dropout")
    if where is None:
        return input
    seed, off = _seeding.take()  # every rank, even one with no rows
    if where is _OUTSIDE:
        return input
    keep = 1.0 - p
    noise = bernoulli_block(seed, off, *where, p=keep, dtype=input.dtype,
                            device=_local(input).device)
    noise = _like_input(noise.div_(keep), input)
    return input.mul_(noise) if inplace else input * noise


def _like(kind, name: str):
    def draw(mode: DataParallelRandom, input, *, dtype=None, device=None, **kwargs):
        mode.drew = True
        dtype = dtype or input.dtype
        device = device or _local(input).device
        where = mode.draw_block(input, name)
        if where is not None:
            seed, off = _seeding.take()
        if where is None or where is _OUTSIDE:
            return torch.empty_like(input, dtype=dtype, device=device)
        out = _like_input(kind(seed, off, *where, dtype=dtype, device=device), input)
        return out.requires_grad_(bool(kwargs.get("requires_grad", False)))

    return draw


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _like_input(block: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``block`` as ``like`` holds it: a DTensor of ``like``'s layout (its
    global shape and placements) when ``like`` is one."""
    if not isinstance(like, DTensor):
        return block
    spec = like._spec
    return DTensor(block, spec.with_meta(TensorMeta(spec.shape, spec.stride, block.dtype)))


_OPS = {
    F.dropout: _dropout,
    torch.rand_like: _like(uniform_block, "torch.rand_like"),
    torch.randn_like: _like(normal_block, "torch.randn_like"),
}
