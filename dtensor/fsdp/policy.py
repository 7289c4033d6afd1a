"""Policies of ``fully_shard`` (names and fields as ``torch.distributed.fsdp``),
and the check that refuses the options this runtime does not have."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtensor.fsdp.errors import FSDPError

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy", "check_options"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the unsharded parameters (``param_dtype``: all-gathered and
    computed in), of the gradient reduction (``reduce_dtype``; default
    ``param_dtype``), of the forward outputs (``output_dtype``), and whether
    floating-point forward inputs are cast to ``param_dtype``.

    Example:
        >>> fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(
        ...     param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (the default); ``CPUOffloadPolicy`` is refused."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Offload sharded parameters to host memory: not supported here
    (``fully_shard`` raises ``FSDPError`` naming it)."""

    pin_memory: bool = True


def check_options(module, *, shard_placement_fn, offload_policy, ignored_params, dp_mesh_dims,
                  mp_policy) -> None:
    """Raise ``FSDPError`` naming the first option given that is not supported."""
    from torch import nn

    if not isinstance(module, nn.Module):
        raise FSDPError(
            f"fully_shard: expected one nn.Module, got {type(module).__name__}; a list of "
            "modules sharing one group is not supported, call fully_shard on each"
        )
    unsupported = {
        "shard_placement_fn": shard_placement_fn is not None,
        "ignored_params": bool(ignored_params),
        "dp_mesh_dims": dp_mesh_dims is not None,
        "offload_policy": offload_policy is not None
        and type(offload_policy).__name__ != "OffloadPolicy",
    }
    for name, given in unsupported.items():
        if given:
            value = {"shard_placement_fn": shard_placement_fn, "offload_policy": offload_policy,
                     "ignored_params": ignored_params, "dp_mesh_dims": dp_mesh_dims}[name]
            raise FSDPError(
                f"fully_shard: {name}={value!r} is not supported; leave {name} at its default (parameters shard on dim 0 over "
                "the data-parallel axis, kept on their device)"
            )
    if not isinstance(mp_policy, MixedPrecisionPolicy) and (
        type(mp_policy).__name__ != "MixedPrecisionPolicy"
    ):
        raise FSDPError(
            f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {mp_policy!r}"
        )

