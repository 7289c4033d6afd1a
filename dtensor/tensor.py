"""The DTensor subclass and the differentiable ways in and out of it.

A ``DTensor`` wraps this rank's local block and an immutable ``DTensorSpec``.
Autograd records ops on the DTensor itself; the local tensor never requires
grad. ``from_local``, ``to_local``, ``redistribute`` and ``distribute_tensor``
are autograd functions, so gradients flow between local and distributed code.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Sequence

import torch

from dtensor import _arith, _compile, _local_check, _optim, _persist
from dtensor._tensor_grad import _FromLocal, _Redistribute, _ToLocal
from dtensor._tensor_grad import redistribute_cast as _redistribute_cast
from dtensor.dispatch import dispatch as _dispatch
from dtensor.dispatch import serve
from dtensor.errors import CrossMeshError, PlacementError, ShardingError
from dtensor.mesh import DeviceMesh
from dtensor.mesh import resolve_mesh as _resolve_mesh  # its old home; importers use it
from dtensor.placement import (
    Placement,
    Replicate,
    format_placements,
    replicated,
)
from dtensor.redistribute import empty_local as _empty_local
from dtensor.redistribute import redistribute_local
from dtensor.spec import (
    DTensorSpec,
    TensorMeta,
    contiguous_stride,
    normalize_placements,
)

__all__ = ["DTensor", "rebuild_dtensor"]


def _check_tensor(x, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ShardingError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")


class DTensor(torch.Tensor):
    """A tensor distributed over a ``DeviceMesh`` by a tuple of placements.

    Build one with ``distribute_tensor`` or ``DTensor.from_local``; read it with
    ``to_local()`` or ``full_tensor()``.

    Example:
        >>> mesh = init_device_mesh("cpu", (2,))
        >>> x = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
        >>> x.to_local()            # rank 1
        tensor([2., 3.])
        >>> (x * 2).full_tensor()
        tensor([0., 2., 4., 6.])
    """

    _local_tensor: torch.Tensor
    _spec: DTensorSpec
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False):
        if requires_grad is False and local_tensor.requires_grad and torch.is_grad_enabled():
            # PyTorch's DTensor warns the same (its tests expect the warning):
            # the DTensor would silently cut the local tensor's graph. (Not
            # under no_grad, e.g. in an autograd.Function's forward, whose
            # view of a requires-grad input still reports requires_grad.)
            warnings.warn(
                "To construct DTensor from torch.Tensor, it's recommended to use "
                "local_tensor.detach() and make requires_grad consistent.",
                stacklevel=2,
            )
        meta = spec.tensor_meta
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride,
            dtype=meta.dtype,
            device=local_tensor.device,
            layout=local_tensor.layout,
            requires_grad=requires_grad,
        )
        r._local_tensor = local_tensor
        r._spec = spec
        return r

    # Public metadata ---------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    def __repr__(self, *, tensor_contents=None) -> str:
        return (
            f"DTensor(local_tensor={self._local_tensor}, spec={self._spec}, "
            f"device_mesh={self._spec.mesh!r}, placements={self._spec.placements})"
        )

    # NOTE: detach/view_as/alias go through the dispatcher like every op (its
    # fast path hands the output this DTensor's spec object). Overriding them
    # here in Python was faster but made outputs autograd does not know as
    # aliases: a fresh version counter, so an in-place write through
    # `x.detach()` went unnoticed by a backward that had saved `x`.

    # torch.compile needs to take DTensors apart and rebuild them.
    def __tensor_flatten__(self):
        return ["_local_tensor"], (self._spec, self.requires_grad)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        spec, requires_grad = flatten_spec
        local = inner_tensors["_local_tensor"]
        meta = spec.tensor_meta
        if tuple(outer_size) != meta.shape or tuple(outer_stride) != meta.stride:
            spec = spec.with_meta(TensorMeta(outer_size, outer_stride, local.dtype))
        return DTensor(local, spec, requires_grad=requires_grad)

    def _stable_hash_for_caching(self) -> str:
        # torch.compile's autograd cache keys DTensor inputs by this string. A
        # traced program depends on this rank's coordinate and names its
        # world's process groups, hence the mesh's cache key.
        key = f"{self._spec!r}|{self.requires_grad}|{self._spec.mesh._cache_key()!r}"
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    def __coerce_same_metadata_as_tangent__(self, flatten_spec, expected_type=None):
        # A compiled backward traced each gradient in one layout; move a
        # gradient given in another layout (same mesh and shape) to it.
        spec = flatten_spec[0]
        if expected_type not in (None, DTensor) or (spec.mesh, spec.tensor_meta) != (
            self._spec.mesh, self._spec.tensor_meta
        ):
            return None
        return self.redistribute(spec.mesh, spec.placements)

    # torch.save (weights_only loads) and torch.distributed.checkpoint's
    # tensor-subclass protocol; the logic lives in dtensor/_persist.py.
    def __reduce_ex__(self, protocol):
        return rebuild_dtensor, _persist.reduce_args(self)

    def __create_write_items__(self, fqn: str, object):
        return _persist.create_write_items(self, fqn)

    def __create_chunk_list__(self):
        return _persist.create_chunk_list(self)

    def __get_tensor_shard__(self, index):
        return _persist.get_tensor_shard(self, index)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # dispatch() handles random ops too (off its fast path).
        return _dispatch(func, args, kwargs)

    # Ways in and out ------------------------------------------------------------
    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        run_check: bool = False,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
    ) -> DTensor:
        """Wrap this rank's block ``local_tensor`` as a DTensor (differentiable).

        Without ``shape`` the global shape is inferred assuming even shards
        (every rank's block as large as this one). Pass ``shape`` for uneven
        shards. ``run_check=True`` (collectives over the mesh; see
        ``dtensor/_local_check.py``) makes the members agree: the same dtype,
        dims and arguments, blocks that fit ``shape`` (inferred from all
        blocks, uneven ones included, when not given), and under
        ``Replicate`` the values of the first rank on that mesh axis. Bad
        input raises ``PlacementError`` (a ``ValueError``) on every member.

        Example:
            >>> DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)]).shape
            torch.Size([4, 3])      # on 2 ranks
        """
        _check_tensor(local_tensor, "from_local")
        if isinstance(local_tensor, DTensor):
            raise PlacementError(
                f"from_local: expected this rank's block as a plain torch.Tensor, got a "
                f"DTensor {local_tensor._spec}; pass x.to_local(), or use "
                "x.redistribute(mesh, placements) to change its layout"
            )
        mesh = _resolve_mesh(device_mesh, "from_local")
        if placements is None:
            placements = replicated(mesh)
        if shape is None and stride is not None:
            raise PlacementError("from_local: stride given without shape")
        coord = mesh.get_coordinate()
        inferred = None
        if run_check and coord is not None:
            if _compile.tracing():
                raise PlacementError(
                    "from_local: run_check=True is not supported under torch.compile "
                    "(it reads a collective's result on the host); check once eagerly"
                )
            # Before any check of our own: a rank-dependent error here would
            # leave the other ranks blocked in the check's collectives.
            local_tensor, inferred = _local_check.run_check(
                local_tensor, mesh, placements, shape, stride,
                lambda ps, ndim: _norm(ps, mesh, ndim),
            )
        if shape is None:
            shape, stride = _global_shape_stride(
                local_tensor, mesh, _norm(placements, mesh, local_tensor.ndim), inferred
            )
        shape = tuple(int(s) for s in shape)
        stride = tuple(stride) if stride is not None else contiguous_stride(shape)
        spec = DTensorSpec(mesh, tuple(placements), TensorMeta(shape, stride, local_tensor.dtype))
        if coord is None:
            local_tensor = _empty_local(spec, local_tensor.device)
        elif not run_check and len(shape) == local_tensor.ndim:
            expected = spec.local_shape(coord)
            if tuple(local_tensor.shape) != expected:
                raise PlacementError(
                    f"from_local: local block of shape {tuple(local_tensor.shape)} does "
                    f"not fit global shape {shape} with {format_placements(spec.placements)} "
                    f"at coordinate {coord}: expected {expected}. Pass the global "
                    "shape= for uneven shards."
                )
        if not (local_tensor.requires_grad and torch.is_grad_enabled()):
            return DTensor(local_tensor, spec)
        return _FromLocal.apply(local_tensor, spec, DTensor)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's block as a plain tensor (differentiable).

        ``grad_placements`` says how the gradient of the result is laid out
        (default: this DTensor's placements).
        """
        if not torch.is_grad_enabled() or not self.requires_grad:
            return self._local_tensor
        spec = self._spec
        if grad_placements is not None:
            spec = spec.with_placements(_norm(grad_placements, spec.mesh, spec.ndim))
        return _ToLocal.apply(self, spec)

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> DTensor:
        """The same global tensor laid out by ``placements`` (differentiable).

        ``forward_dtype`` casts the block before it moves (the result keeps
        that dtype); ``backward_dtype`` is the dtype of the gradient's
        collectives (default: this tensor's), the gradient arriving in this
        tensor's dtype. ``async_op=True`` returns before the last collective
        completes: the result's block is an ``AsyncCollectiveTensor`` that
        stays in flight through views and ``to_local()`` and waits on its
        first use (or ``wait()``).

        Example:
            >>> x.redistribute(mesh, [Replicate()]).to_local()   # all-gather
        """
        mesh = device_mesh or self._spec.mesh
        if mesh != self._spec.mesh:
            raise CrossMeshError(
                f"redistribute: cannot move between meshes ({self._spec.mesh} -> "
                f"{mesh}); redistribute on {self._spec.mesh} or use from_local"
            )
        if placements is None:
            placements = [Replicate() if p.is_partial() else p for p in self.placements]
        dst = _norm(placements, mesh, self.ndim)
        if forward_dtype is not None or backward_dtype is not None:
            return _redistribute_cast(self, mesh, dst, forward_dtype, backward_dtype)
        if dst == self._spec.placements:
            return self
        spec = self._spec.with_placements(dst)
        if not (self.requires_grad and torch.is_grad_enabled()) and not _compile.tracing():
            # No graph to record: skip autograd.Function's bookkeeping, which
            # costs more than the planning and shows up next to a collective.
            local = redistribute_local(self._local_tensor, self._spec, spec, async_op=async_op)
            return DTensor(local, spec)
        return _Redistribute.apply(self, spec, async_op and not _compile.tracing())

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every member rank (differentiable).

        Ranks outside the mesh get an empty tensor of the right dtype.
        """
        full = self.redistribute(self._spec.mesh, replicated(self._spec.mesh))
        return full.to_local(grad_placements=grad_placements)


def _global_shape_stride(local: torch.Tensor, mesh: DeviceMesh, placements, inferred):
    """Global (shape, stride) of ``from_local`` without ``shape=``, as PyTorch's.

    Shape: even shards of ``local``, or ``inferred`` from every block by the
    run check. Stride: each ``Shard(d)`` scales the strides at least as large
    as dim ``d``'s by the axis size, so a contiguous block gives a contiguous
    tensor and a permuted block the same permutation of the whole; uneven
    blocks (only the run check infers those) give a contiguous tensor.
    """
    shape, stride = list(local.shape), list(local.stride())
    for axis, p in enumerate(placements):
        if p.is_shard():  # Shard and StridedShard: even pieces of the dim
            shape[p.dim] *= mesh.shape[axis]
            pivot = stride[p.dim]
            for d in range(len(stride)):
                if d != p.dim and stride[d] >= pivot:
                    stride[d] *= mesh.shape[axis]
    if inferred is not None and tuple(inferred) != tuple(shape):
        return tuple(inferred), contiguous_stride(inferred)
    if local.is_contiguous():
        return tuple(shape), contiguous_stride(shape)
    return tuple(shape), tuple(stride)


def _norm(placements, mesh: DeviceMesh, ndim: int) -> tuple[Placement, ...]:
    return normalize_placements(placements, mesh.ndim, ndim)


serve(DTensor)
_arith.install(DTensor, _dispatch)
_optim.install(DTensor)

# clip_grad_norm_, get_total_norm and optimizers take their foreach paths only
# for types listed here (their rules: dtensor/rules/foreach.py, norms.py).
if DTensor not in torch.utils._foreach_utils._foreach_supported_types:
    torch.utils._foreach_utils._foreach_supported_types.append(DTensor)

# torch.compile records these as calls in Dynamo's graph (see dtensor/_compile.py).
_compile.trace_as_calls(
    DTensor.from_local, DTensor.to_local, DTensor.redistribute, DTensor.full_tensor,
)


def rebuild_dtensor(
    local, device_type, ranks, mesh_shape, mesh_dim_names, placements, shape, stride,
    requires_grad,
):
    """Rebuild a pickled DTensor in this process (its mesh over the same ranks).

    The mesh is rebuilt by its ranks; a rank outside it gets an empty block,
    as for any DTensor.
    """
    grid = torch.tensor(list(ranks), dtype=torch.int64).reshape(tuple(mesh_shape))
    mesh = DeviceMesh(device_type, grid, mesh_dim_names=mesh_dim_names)
    meta = TensorMeta(tuple(shape), tuple(stride), local.dtype)
    spec = DTensorSpec(mesh, tuple(_persist.decode_placement(p) for p in placements), meta)
    if mesh.get_coordinate() is None:
        local = _empty_local(spec, local.device)
    out = DTensor(local, spec)
    return out.requires_grad_(True) if requires_grad else out


# The one global a weights_only load of a DTensor needs.
torch.serialization.add_safe_globals([rebuild_dtensor])
