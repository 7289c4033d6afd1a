"""DTensor factories: each rank builds only its own block, with no communication.

``zeros``, ``ones``, ``empty`` and ``full`` mirror ``torch.distributed.tensor``;
the random factories (``rand``, ``randn``, ``randint``) live in
``dtensor.random`` and produce the single-device values for every layout.

Example:
    >>> w = zeros(8, 4, device_mesh=mesh, placements=[Shard(0)])
    >>> w.to_local().shape     # on 2 ranks
    torch.Size([4, 4])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dtensor import _compile
from dtensor.mesh import DeviceMesh
from dtensor.placement import Partial, Placement, Replicate
from dtensor.spec import DTensorSpec, TensorMeta, contiguous_stride
from dtensor.tensor import DTensor, _device_of, _resolve_mesh

__all__ = ["empty", "full", "ones", "zeros"]


def _size(size: tuple) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = tuple(size[0])
    return tuple(int(s) for s in size)


def build(
    size: Sequence[int],
    make_block: Callable[[tuple[int, ...], tuple[int, ...], torch.device], torch.Tensor],
    *,
    dtype: torch.dtype | None,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | None,
    requires_grad: bool,
    what: str,
) -> DTensor:
    """A DTensor whose block at each coordinate is ``make_block(shape, offset, device)``.

    Outsiders build nothing: they get an empty block of the right dtype.
    """
    mesh = _resolve_mesh(device_mesh, what)
    if placements is None:
        placements = (Replicate(),) * mesh.ndim
    dtype = dtype or torch.get_default_dtype()
    shape = tuple(size)
    spec = DTensorSpec(mesh, tuple(placements), TensorMeta(shape, contiguous_stride(shape), dtype))
    device = _device_of(mesh)
    coord = mesh.get_coordinate()
    local_shape, offset = spec.local_block(coord)
    if coord is None:
        local = torch.empty(local_shape, dtype=dtype, device=device)
    else:
        local = make_block(local_shape, offset, device)
    return DTensor(local, spec, requires_grad=requires_grad)


def _constant(value_of: Callable[[torch.dtype], object], what: str):
    def factory(
        *size,
        dtype: torch.dtype | None = None,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        requires_grad: bool = False,
        **_layout,
    ) -> DTensor:
        dt = dtype or torch.get_default_dtype()
        fill = value_of(dt)

        def block(shape, offset, device):
            return torch.full(shape, fill, dtype=dt, device=device)

        out = build(
            _size(size), block, dtype=dt, device_mesh=device_mesh,
            placements=placements, requires_grad=requires_grad, what=what,
        )
        return _fix_partial(out, fill)

    factory.__name__ = what
    return factory


def _fix_partial(out: DTensor, fill) -> DTensor:
    """A Partial(sum) constant keeps the value on one coordinate, zero elsewhere."""
    spec = out._spec
    coord = spec.mesh.get_coordinate()
    if coord is None or fill == 0:
        return out
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Partial) and p.reduce_op == "sum" and coord[axis] != 0:
            out._local_tensor.zero_()
            break
    return out


zeros = _constant(lambda dt: 0, "zeros")
ones = _constant(lambda dt: 1, "ones")
zeros.__doc__ = "A DTensor of zeros of the given global size (mirrors torch.distributed.tensor.zeros)."
ones.__doc__ = "A DTensor of ones of the given global size (mirrors torch.distributed.tensor.ones)."


def empty(*size, dtype=None, device_mesh=None, placements=None, requires_grad=False, **_layout):
    """An uninitialised DTensor of the given global size."""
    dt = dtype or torch.get_default_dtype()
    return build(
        _size(size), lambda s, o, d: torch.empty(s, dtype=dt, device=d), dtype=dt,
        device_mesh=device_mesh, placements=placements, requires_grad=requires_grad,
        what="empty",
    )


def full(size, fill_value, *, dtype=None, device_mesh=None, placements=None,
         requires_grad=False, **_layout):
    """A DTensor filled with ``fill_value`` (mirrors torch.distributed.tensor.full)."""
    if dtype is None:
        dtype = torch.full((), fill_value).dtype
    out = build(
        _size((size,)), lambda s, o, d: torch.full(s, fill_value, dtype=dtype, device=d),
        dtype=dtype, device_mesh=device_mesh, placements=placements,
        requires_grad=requires_grad, what="full",
    )
    return _fix_partial(out, fill_value)


# torch.compile records these as calls in its graph (layouts are constants);
# the random factories still run eagerly through a graph break.
_compile.trace_as_calls(zeros, ones, empty, full)
