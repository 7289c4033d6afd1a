"""``distribute_tensor``: one global tensor in, this rank's block of it out.

Differentiable (the gradient of the global tensor is the gathered gradient of
the blocks); ``src_data_rank`` picks whose copy is authoritative.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtensor import _comm, _compile
from dtensor.errors import MeshError, PlacementError
from dtensor.mesh import DeviceMesh
from dtensor.mesh import device_of as _device_of
from dtensor.placement import Placement, Replicate, Shard, replicated
from dtensor.redistribute import empty_local as _empty_local
from dtensor.redistribute import redistribute_local
from dtensor.spec import DTensorSpec, TensorMeta, contiguous_stride, shard_range
from dtensor.tensor import DTensor, _check_tensor, _resolve_mesh

__all__ = ["distribute_tensor"]


class _Distribute(torch.autograd.Function):
    """Cut a global tensor in forward; gather the gradient to a full tensor in backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, spec: DTensorSpec, src_data_rank):
        ctx.spec = spec
        mesh = spec.mesh
        coord = mesh.get_coordinate()
        if coord is None:
            return DTensor(_empty_local(spec, tensor.device), spec)
        local = tensor.detach()
        src = spec.with_placements(replicated(mesh))
        if src_data_rank is not None and mesh.size() > 1:
            if _compile.tracing() or any(
                    p.is_shard() and type(p) is not Shard for p in spec.placements):
                local = _broadcast_from(local, mesh, src_data_rank)
            else:
                local, src = _scatter_from(local, spec, src_data_rank)
        local = redistribute_local(local, src, spec)
        if local is tensor or local._base is tensor:
            local = local.clone()
        return DTensor(local, spec)

    @staticmethod
    def backward(ctx, grad: DTensor):
        spec = grad._spec
        if spec.mesh.get_coordinate() is None:
            return None, None, None
        full = redistribute_local(
            grad._local_tensor, spec, spec.with_placements(replicated(spec.mesh))
        )
        return full, None, None


def _check_src_data_rank(mesh: DeviceMesh, src_data_rank: int | None) -> None:
    # Pure shape check, so members and outsiders raise the same error.
    if src_data_rank is None:
        return
    smallest = min(mesh.shape)
    if not isinstance(src_data_rank, int) or not 0 <= src_data_rank < smallest:
        raise MeshError(
            f"distribute_tensor: src_data_rank={src_data_rank!r} is a rank within each "
            f"mesh axis, so it must be in [0, {smallest}) for mesh shape "
            f"{tuple(mesh.shape)}; pass 0 (the default) or None to use each rank's own copy"
        )


def _broadcast_from(local: torch.Tensor, mesh: DeviceMesh, src_data_rank: int) -> torch.Tensor:
    """Make every member hold the copy of mesh coordinate (k, k, ..., k).

    ``src_data_rank`` counts within each mesh axis (as in torch), so the
    default 0 names the mesh's first member on every mesh, sub-meshes that
    leave out global rank 0 included.
    """
    coord = mesh.get_coordinate()
    # Axis by axis, grow the set of holders of the source's copy: along axis
    # k only the lines whose later coordinates equal the source's take part,
    # so every sender already holds the source's copy.
    for axis in range(mesh.ndim):
        group = mesh.axis_group(axis)
        if group is None:
            continue
        if all(coord[a] == src_data_rank for a in range(axis + 1, mesh.ndim)):
            local = _comm.broadcast(local, src_data_rank, group)
    return local


def _scatter_from(local: torch.Tensor, spec: DTensorSpec, src_data_rank: int):
    """This rank's block of the source's copy, and the spec it is a block of.

    As ``_broadcast_from``, axis by axis, but a ``Shard`` axis scatters: each
    rank receives its own piece (``(n-1)/n`` of the block leaves the source,
    where a broadcast sends all of it to every rank), as PyTorch's
    ``distribute_tensor`` does. Partial axes are broadcast (the caller turns
    them into pieces locally): the spec returned replicates them.
    """
    mesh = spec.mesh
    coord = mesh.get_coordinate()
    for axis, p in enumerate(spec.placements):
        group = mesh.axis_group(axis)
        n = mesh.shape[axis]
        if group is None or not all(coord[a] == src_data_rank
                                    for a in range(axis + 1, mesh.ndim)):
            # A size-1 axis, or this rank's block arrives on a later axis:
            # until then only its shape matters (later buffers must match).
            if isinstance(p, Shard):
                start, size = shard_range(local.shape[p.dim], n, coord[axis])
                local = local.narrow(p.dim, start, size)
            continue
        if not isinstance(p, Shard):
            local = _comm.broadcast(local, src_data_rank, group)
            continue
        length = local.shape[p.dim]
        piece = -(-length // n)
        like_shape = list(local.shape)
        like_shape[p.dim] = piece
        pieces = None
        if coord[axis] == src_data_rank:
            pieces = []
            for i in range(n):
                start, size = shard_range(length, n, i)
                block = local.narrow(p.dim, start, size)
                if size != piece:  # uneven: pad to the largest piece
                    pad = list(block.shape)
                    pad[p.dim] = piece - size
                    block = torch.cat([block, block.new_zeros(pad)], dim=p.dim)
                pieces.append(block.contiguous())
        got = _comm.scatter(pieces, local.new_empty(like_shape), src_data_rank, group)
        keep = shard_range(length, n, coord[axis])[1]
        # An uneven piece as a slice of the padded buffer would not be
        # contiguous, and a view the global tensor allows (a merge of this
        # dim into the one before it) would then fail on this rank alone.
        local = got if keep == piece else got.narrow(p.dim, 0, keep).contiguous()
    kept = tuple(p if isinstance(p, Shard) else Replicate() for p in spec.placements)
    return local, spec.with_placements(kept)


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Lay a global tensor out over a mesh (differentiable).

    Every member passes a tensor of the same shape; the values of the member
    at index ``src_data_rank`` of every mesh axis are used (broadcast first;
    the default 0 is the mesh's first member), or each rank's own when it is
    ``None``. ``Partial`` placements keep the value on one coordinate (sum)
    or all of them (avg/max/min). A meta tensor gives a meta DTensor (block
    shapes only, no communication), for ``to_empty`` and initialisation later.

    Example:
        >>> distribute_tensor(torch.ones(4, 4), mesh, [Shard(1)]).to_local().shape
        torch.Size([4, 2])   # on 2 ranks
    """
    _check_tensor(tensor, "distribute_tensor")
    mesh = _resolve_mesh(device_mesh, "distribute_tensor")
    if placements is None:
        placements = replicated(mesh)
    if isinstance(tensor, DTensor):
        # As in PyTorch: already laid out so, it is returned; else a ValueError.
        if tensor.device_mesh == mesh and tensor.placements == tuple(placements):
            return tensor
        raise PlacementError(
            f"distribute_tensor: got a DTensor {tensor._spec} on {tensor.device_mesh!r}; "
            f"expected a plain tensor to lay out as {tuple(placements)} on {mesh!r}. Use "
            "x.redistribute(mesh, placements) to change its layout"
        )
    _check_src_data_rank(mesh, src_data_rank)
    meta = TensorMeta(tensor.shape, contiguous_stride(tensor.shape), tensor.dtype)
    spec = DTensorSpec(mesh, tuple(placements), meta)
    if tensor.is_meta:
        return _meta_dtensor(tensor, spec)
    device = _device_of(mesh)
    if tensor.device.type != device.type:
        tensor = tensor.to(device)
    if tensor.requires_grad and tensor.grad_fn is None:
        # A leaf (a parameter, say) gives a leaf DTensor that owns its .grad,
        # as in torch.distributed.tensor; computed tensors stay differentiable.
        with torch.no_grad():
            out = _Distribute.apply(tensor.detach(), spec, src_data_rank)
        return out.requires_grad_(True)
    return _Distribute.apply(tensor, spec, src_data_rank)


def _meta_dtensor(tensor: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A meta DTensor: this rank's block shape, no values, no communication.

    The meta-init pattern: build a model on the meta device, lay it out, then
    ``module.to_empty(device=...)`` and initialise the blocks in place.
    """
    shape = spec.local_shape(spec.mesh.get_coordinate())
    local = torch.empty(shape, dtype=tensor.dtype, device="meta")
    out = DTensor(local, spec)
    return out.requires_grad_(True) if tensor.requires_grad else out


# Dispatch sits below this class (the class calls it) and wraps results in it.


# torch.compile records it as a call in Dynamo's graph (see dtensor/_compile.py).
_compile.trace_as_calls(distribute_tensor)
