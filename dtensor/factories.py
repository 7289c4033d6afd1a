"""DTensor factories: each rank builds only its own block, with no communication.

``zeros``, ``ones``, ``empty`` and ``full`` mirror ``torch.distributed.tensor``;
the random factories (``rand``, ``randn``, ``randint``) draw from
``dtensor.random``'s generator and produce the single-device values for every
layout; ``manual_seed`` seeds that generator.

Example:
    >>> w = zeros(8, 4, device_mesh=mesh, placements=[Shard(0)])
    >>> w.to_local().shape     # on 2 ranks
    torch.Size([4, 4])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dtensor import _comm, _compile, _seeding
from dtensor import random as rng
from dtensor.dispatch.random_ops import no_generator
from dtensor.errors import ShardingError
from dtensor.mesh import DeviceMesh, device_of
from dtensor.placement import Placement, norm_pieces_from, partial_fill, replicated
from dtensor.spec import DTensorSpec, TensorMeta, contiguous_stride
from dtensor.tensor import DTensor, _resolve_mesh

__all__ = [
    "empty",
    "full",
    "manual_seed",
    "ones",
    "rand",
    "randint",
    "randn",
    "zeros",
]


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
        placements = replicated(mesh)
    dtype = dtype or torch.get_default_dtype()
    shape = tuple(size)
    spec = DTensorSpec(mesh, tuple(placements), TensorMeta(shape, contiguous_stride(shape), dtype))
    device = device_of(mesh)
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
    """A Partial(sum/product/bxor) constant keeps the value on one coordinate,
    the op's identity elsewhere (``dtensor.placement.partial_fill``)."""
    norm_pieces_from(out._spec.placements, "a constant factory", fill)
    coord = out._spec.mesh.get_coordinate()
    new = None if coord is None else partial_fill(out._spec.placements, coord)
    if new is not None and new != fill:
        out._local_tensor.fill_(new)
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


# Random factories and seeding ----------------------------------------------
def _random_factory(block_fn, name: str, **fixed):
    def factory(*size, dtype=None, device_mesh=None, placements=None,
                requires_grad: bool = False, **kwargs):
        kwargs.pop("layout", None)
        if kwargs.pop("generator", None) is not None:
            no_generator({"generator": True}, name)
        dt = dtype or torch.get_default_dtype()
        if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
            size = tuple(size[0])
        seed, offset = _seeding.take(_resolve_mesh(device_mesh, name), name)

        def block(shape, start, device):
            return block_fn(seed, offset, tuple(size), start, shape, device=device,
                            dtype=dt, **fixed, **kwargs)

        out = build(tuple(int(s) for s in size), block, dtype=dt, device_mesh=device_mesh,
                    placements=placements, requires_grad=requires_grad, what=name)
        norm_pieces_from(out._spec.placements, name)
        coord = out._spec.mesh.get_coordinate()
        fill = None if coord is None else partial_fill(out._spec.placements, coord)
        if fill is not None:
            out._local_tensor.fill_(fill)
        return out

    factory.__name__ = name
    factory.__doc__ = (
        f"A DTensor of {name} values whose full tensor equals "
        f"``dtensor.random.{name}`` under the same seed, for every layout.\n\n"
        f"Example:\n    >>> dtensor.manual_seed(0)\n"
        f"    >>> x = dtensor.{name}(8, 4, device_mesh=mesh, placements=[Shard(0)])"
    )
    return factory


rand = _random_factory(rng.uniform_block, "rand")
randn = _random_factory(rng.normal_block, "randn")


def randint(low, high=None, size=None, *, dtype=torch.int64, device_mesh=None,
            placements=None, requires_grad=False):
    """Integers in ``[low, high)`` as a DTensor (``randint(high, size)`` also works)."""
    if size is None:
        low, high, size = 0, low, high
    make = _random_factory(rng.randint_block, "randint", low=low, high=high)
    return make(*tuple(size), dtype=dtype, device_mesh=device_mesh,
                placements=placements, requires_grad=requires_grad)


def manual_seed(seed: int, device_mesh=None) -> None:
    """Seed the sharding-invariant generator; the same seed is required everywhere.

    With ``device_mesh`` (or when a world is initialised) the seed is checked
    across the mesh's ranks (or the world's; then every rank must call this),
    and a mismatch raises on every rank.

    Example:
        >>> dtensor.manual_seed(1234)
    """
    rng.manual_seed(seed)
    if device_mesh is None:
        if not _comm.is_initialized() or _comm.get_world_size() == 1:
            return
        device_mesh = DeviceMesh("cpu", list(range(_comm.get_world_size())))
    if device_mesh.get_coordinate() is None:
        return
    fp = rng.seed_fingerprint()
    lo = fp.neg()
    for axis in range(device_mesh.ndim):
        group = device_mesh.axis_group(axis)
        if group is not None:
            fp = _comm.all_reduce(fp, "max", group)
            lo = _comm.all_reduce(lo, "max", group)
    if not torch.equal(fp, lo.neg()):
        raise ShardingError(
            f"manual_seed({seed}): ranks of {device_mesh!r} were given different "
            "seeds; call dtensor.manual_seed with the same seed on every rank"
        )


# torch.compile records these as calls in its graph (layouts are constants);
# the random factories still run eagerly through a graph break.
_compile.trace_as_calls(zeros, ones, empty, full)
