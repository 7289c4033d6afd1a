"""One FSDP parameter group: its parameters move together, one collective each way.

A group holds the parameters one ``fully_shard`` call manages. Each is kept
as a DTensor ``Shard(0)`` on the data-parallel axis (``sharded``); the full
parameters live in one flat buffer (``unsharded``) only between an
all-gather and the next reshard. The layout on the wire: every rank sends
one segment, the concatenation of its row blocks of every parameter, each
padded to ``ceil(rows / n)`` rows (``torch.chunk`` pieces, the layout of
``Shard(0)``), so that one all-gather fills the buffer for all parameters
and one reduce-scatter hands every rank the gradient rows it owns.

In the flat buffer every parameter takes its padded size (``n * chunk``
rows) and is the view of its first rows, so the gathered segments land with
one strided copy.

The unsharded parameters reach the module through ``_Unshard``, an autograd
function: the forward hands out views of the flat buffer, the backward
receives every parameter's gradient at once, frees the flat buffer and
reduce-scatters them (the dual of the all-gather). Resharding frees the
buffer's storage but keeps its tensor object: autograd's saved views of it
are filled again, in place, by the re-gather before backward, without
bumping their version counters. Communication buffers are freed (storage
resized to 0) as soon as they are read, not when Gloo drops its work
object, so the peak does not depend on when its worker thread runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from dtensor import _comm
from dtensor.mesh import DeviceMesh
from dtensor.placement import Placement
from dtensor.spec import DTensorSpec, TensorMeta, contiguous_stride, shard_range
from dtensor.tensor import DTensor

__all__ = ["FSDPParam", "ParamGroup"]


@dataclass
class FSDPParam:
    """Where a parameter lives and how its rows travel.

    ``inner_spec`` is the tensor-parallel spec of the unsharded parameter
    (None: a plain tensor); ``block_shape`` is the shape that is all-gathered
    over the data-parallel axis (the parameter's, or its tensor-parallel
    block's).
    """

    owners: list[tuple[nn.Module, str]]  # a shared parameter has several
    inner_spec: DTensorSpec | None
    block_shape: tuple[int, ...]
    orig_dtype: torch.dtype

    @property
    def rows(self) -> int:
        return self.block_shape[0] if self.block_shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.block_shape[1:])

    def sharded(self) -> DTensor:
        # Looked up each time: to_empty and load_state_dict may swap the object.
        owner, name = self.owners[0]
        return owner._parameters[name]


class ParamGroup:
    """The parameters of one ``fully_shard`` call and their unshard state.

    ``mesh`` is the sharded parameters' mesh; ``shard_axis`` its data-parallel
    axis, ``replicate_axis`` the HSDP replica axis (or None).
    """

    def __init__(self, params: list[FSDPParam], mesh: DeviceMesh, shard_axis: int,
                 replicate_axis: int | None, param_dtype, reduce_dtype) -> None:
        self.params = params
        self.mesh = mesh
        self.shard_axis = shard_axis
        self.replicate_axis = replicate_axis
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.n = mesh.size(shard_axis)
        self.rank = mesh.get_local_rank(shard_axis) if mesh.is_member() else 0
        self.chunk_rows = [-(-p.rows // self.n) for p in params]
        self.seg_sizes = [c * p.row_numel for c, p in zip(self.chunk_rows, params, strict=True)]
        self.segment = sum(self.seg_sizes)
        self.flat: torch.Tensor | None = None  # the unsharded buffer (storage freed when sharded)
        self.views: list[torch.Tensor] = []
        self.is_unsharded = False
        self.outputs: tuple | None = None  # this forward's unsharded params (autograd's)
        self.requires_gradient_sync = True
        self.reshard_after_backward = True
        self.grad_accum: list[torch.Tensor | None] | None = None
        self.final_task: int | None = None  # the backward whose end will check this group

    # Sharding ---------------------------------------------------------------
    def local_rows(self, block: torch.Tensor) -> torch.Tensor:
        """This rank's ``torch.chunk`` rows of ``block`` (its ``Shard(0)`` block)."""
        start, length = shard_range(block.shape[0], self.n, self.rank)
        return block.narrow(0, start, length)

    def dtype(self) -> torch.dtype:
        return self.param_dtype or self.params[0].sharded().dtype

    # All-gather -------------------------------------------------------------
    def unshard(self) -> None:
        """All-gather every parameter of the group in one collective (if sharded).

        Memory at its peak: the gathered buffer and the unsharded one (plus
        this rank's segment while the collective runs); the copy between
        them is one ``split_with_sizes_copy`` into the padded parameters.
        """
        if self.is_unsharded:
            return
        dtype = self.dtype()
        local = self.params[0].sharded()._local_tensor
        send = torch.empty(self.segment, dtype=dtype, device=local.device)
        # A cast to ``dtype`` (mixed precision) happens in the copy: no temporaries.
        torch.cat(self._send_pieces(), out=send)
        gathered = _comm.all_gather_cat(send, self._shard_group())
        _free(send)  # before the unsharded buffer is allocated
        self._alloc_flat(dtype, local.device)
        with torch.no_grad():
            torch.split_with_sizes_copy(gathered.view(self.n, self.segment), self.seg_sizes,
                                        dim=1, out=self._copy_out)
        _free(gathered)
        self.is_unsharded = True

    def _send_pieces(self) -> list[torch.Tensor]:
        """This rank's segment as pieces: each local block, then its padding."""
        pieces = []
        for p, size in zip(self.params, self.seg_sizes, strict=True):
            local = p.sharded()._local_tensor.reshape(-1)
            pieces.append(local)
            if local.numel() != size:
                pieces.append(local.new_zeros(size - local.numel()))
        return pieces

    def _alloc_flat(self, dtype: torch.dtype, device: torch.device) -> None:
        """Give the unsharded buffer storage (a new buffer when dtype or device changed).

        Every parameter holds ``n * chunk`` rows in it (its padded size), so
        that the gathered rows of all ranks land with one strided copy; the
        parameter is the view of its first ``rows`` rows.
        """
        total = self.n * self.segment
        if self.flat is None or self.flat.dtype != dtype or self.flat.device != device:
            self.flat = torch.empty(total, dtype=dtype, device=device)
            # ``.data``: a write autograd's saved views must not count as a change.
            data = self.flat.data
            self.views, self._copy_out = [], []
            start = 0
            for p, size in zip(self.params, self.seg_sizes, strict=True):
                numel = math.prod(p.block_shape)
                self.views.append(self.flat[start:start + numel].view(p.block_shape))
                self._copy_out.append(data[start:start + self.n * size].view(self.n, size))
                start += self.n * size
        storage = self.flat.untyped_storage()
        if storage.size() == 0:
            storage.resize_(total * self.flat.element_size())

    def reshard(self) -> None:
        """Free the unsharded buffer's storage (its tensor stays for autograd's views)."""
        if self.flat is not None:
            self.flat.untyped_storage().resize_(0)
        self.is_unsharded = False

    def aliases_flat(self, tensors) -> bool:
        """Whether any of ``tensors`` shares the unsharded buffer's storage."""
        if self.flat is None or not self.is_unsharded:
            return False
        ptr = self.flat.untyped_storage().data_ptr()
        return any(t is not None and t.numel() and _storage_ptr(t) == ptr for t in tensors)

    def unsharded_params(self) -> list[torch.Tensor]:
        """The parameters as the module's forward sees them (no autograd link)."""
        out = []
        for p, v in zip(self.params, self.views, strict=True):
            if p.inner_spec is None:
                out.append(v)
                continue
            spec = p.inner_spec
            if spec.tensor_meta.dtype != v.dtype:  # mixed precision
                spec = spec_of(spec.mesh, spec.placements, spec.tensor_meta.shape, v.dtype)
            out.append(DTensor(v, spec))
        return out

    def install(self, tensors) -> None:
        """Show ``tensors`` as the parameters' attributes on their modules.

        An instance attribute wins over ``nn.Module.__getattr__``, so the
        module's forward reads the unsharded tensor while ``parameters()``
        and ``state_dict()`` still see the sharded ``nn.Parameter``.
        """
        for p, t in zip(self.params, tensors, strict=True):
            for owner, name in p.owners:
                owner.__dict__[name] = t

    def uninstall(self) -> None:
        for p in self.params:
            for owner, name in p.owners:
                owner.__dict__.pop(name, None)

    # Reduce-scatter ---------------------------------------------------------
    def reduce_grads(self, grads: list) -> list[DTensor | None]:
        """One reduce-scatter (and, for HSDP, one all-reduce) for the whole group."""
        blocks = []
        for p, g in zip(self.params, grads, strict=True):
            if isinstance(g, DTensor):
                if g.placements != p.inner_spec.placements:  # partial sums over tp
                    g = g.redistribute(g.device_mesh, p.inner_spec.placements)
                g = g._local_tensor
            blocks.append(g)
        if self.grad_accum is not None:  # micro-batches without gradient sync
            blocks = [a if b is None else (b if a is None else a + b)
                      for a, b in zip(self.grad_accum, blocks, strict=True)]
            self.grad_accum = None
        if not self.requires_gradient_sync:
            self.grad_accum = [None if b is None else b.detach() for b in blocks]
            return [None] * len(blocks)
        dtype = self.reduce_dtype or self.dtype()
        device = self.params[0].sharded()._local_tensor.device
        send = torch.empty(self.n, self.segment, dtype=dtype, device=device)
        # Row chunks of every block, padded, rank by rank: the wire layout in
        # one copy (and cast). Empty blocks send nothing; a missing gradient
        # sends zeros.
        rows = [b.reshape(p.rows, p.row_numel) if b is not None
                else torch.zeros(p.rows, p.row_numel, dtype=dtype, device=device)
                for p, b in zip(self.params, blocks, strict=True)]
        rows = [r for r in rows if r.numel()]
        if rows:
            torch._chunk_cat(rows, 0, self.n, out=send)
        else:
            send.zero_()
        del rows, blocks
        # Summed, then divided in place: no second buffer for the average.
        mine = _comm.reduce_scatter(send, "sum", 0, self._shard_group()).view(-1)
        _free(send)
        mine.div_(self.n)
        replicas = 1 if self.replicate_axis is None else self.mesh.size(self.replicate_axis)
        if replicas > 1:  # HSDP: in place, the same division
            mine = _comm.all_reduce(mine, "sum", self.mesh.get_group(self.replicate_axis),
                                    _fresh=True)
            mine.div_(replicas)
        out, offset = [], 0
        for p, size in zip(self.params, self.seg_sizes, strict=True):
            param = p.sharded()
            local_shape = param._local_tensor.shape
            piece = mine[offset:offset + math.prod(local_shape)].view(local_shape)
            out.append(DTensor(piece.to(param.dtype), param._spec))
            offset += size
        return out

    def _shard_group(self):
        return self.mesh.get_group(self.shard_axis)


class _Unshard(torch.autograd.Function):
    """All-gather in forward, reduce-scatter in backward.

    Forward: the group's unsharded parameters (gathered before, by the
    pre-forward hook) as tensors autograd links to the sharded ones.
    Backward: all their gradients at once; the group reshards, then reduces
    and scatters them into the sharded layout in one collective.
    """

    @staticmethod
    def forward(ctx, group: ParamGroup, *sharded):
        ctx.group = group
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in group.unsharded_params())

    @staticmethod
    def backward(ctx, *grads):
        group: ParamGroup = ctx.group
        # The reduction does not read the unsharded parameters: reshard first,
        # so their buffer is free before the reduce-scatter's is allocated
        # (unless a gradient shares the buffer's storage).
        early = group.reshard_after_backward and not group.aliases_flat(grads)
        if early:
            _release(group)
        out = group.reduce_grads(list(grads))
        if group.reshard_after_backward and not early:
            _release(group)
        return (None, *out)


def _release(group: ParamGroup) -> None:
    group.reshard()
    group.uninstall()
    group.outputs = None


def unshard_for_forward(group: ParamGroup) -> tuple:
    """Gather (if needed) and return the unsharded parameters, linked to autograd."""
    group.unshard()
    sharded = [p.sharded() for p in group.params]
    if torch.is_grad_enabled() and any(s.requires_grad for s in sharded):
        outs = _Unshard.apply(group, *sharded)
        group.outputs = outs
        return outs
    return tuple(group.unsharded_params())


def _free(t: torch.Tensor) -> None:
    """Free ``t``'s storage now. Gloo's work object holds a finished
    collective's buffers until its worker thread drops it, which on a loaded
    machine comes late; the storage is ours, so it goes when we are done."""
    if type(t) is torch.Tensor and not torch.compiler.is_compiling():
        t.untyped_storage().resize_(0)


def _storage_ptr(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):
        t = t._local_tensor
    return t.untyped_storage().data_ptr()


def spec_of(mesh: DeviceMesh, placements: tuple[Placement, ...], shape, dtype) -> DTensorSpec:
    return DTensorSpec(mesh, placements, TensorMeta(tuple(shape), contiguous_stride(shape), dtype))
