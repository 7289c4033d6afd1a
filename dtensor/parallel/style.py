"""Tensor-parallel styles for one module: column-, row- and sequence-parallel.

A style lays out a module's parameters over a 1-D mesh and hooks its inputs
and outputs so that plain local tensors and DTensors meet the layout its
computation needs. Names and defaults follow
``torch.distributed.tensor.parallel``:

| style | nn.Linear weight / bias | nn.Embedding weight | input | output |
|---|---|---|---|---|
| ``ColwiseParallel`` | S(0) / S(0) | S(1) | R | S(-1) |
| ``RowwiseParallel`` | S(1) / R | S(0) (vocab-parallel) | S(-1) (Linear), R (Embedding) | R |
| ``SequenceParallel`` | R (any module) | R | S(sequence_dim) | S(sequence_dim) |

Example:
    >>> mlp = parallelize_module(mlp, mesh, {"up": ColwiseParallel(),
    ...                                      "down": RowwiseParallel()})
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import MethodType

import torch
from torch import nn

from dtensor._compile import trace_method_later
from dtensor.mesh import DeviceMesh
from dtensor.module import distribute_module, distribute_param
from dtensor.parallel.embedding import vocab_parallel_forward
from dtensor.parallel.errors import PlanError, UnsupportedModuleError
from dtensor.parallel.grad_reduce import reduce_partial_grads
from dtensor.placement import Placement, Replicate, Shard
from dtensor.tensor import DTensor

__all__ = ["ColwiseParallel", "ParallelStyle", "RowwiseParallel", "SequenceParallel"]


class ParallelStyle(ABC):
    """How ``parallelize_module`` lays out one module; subclass and implement ``_apply``.

    ``src_data_rank`` (set by ``parallelize_module``) is where parameter values
    come from: mesh index 0 by default (single-device semantics), ``None`` to
    keep every rank's own values.
    """

    src_data_rank: int | None = 0
    # Parameters whose source values parallelize_module already received (in
    # one broadcast for the whole plan): id(param) -> the source's values.
    _sources: dict | None = None

    @abstractmethod
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module: ...

    def _check(self, module: nn.Module, fqn: str) -> None:
        """Raise before any communication if this style cannot handle ``module``."""
        return None


# Helpers shared by the styles ---------------------------------------------------
def placement_arg(value, what: str, default: Placement) -> Placement:
    """A style's single-placement argument, checked."""
    if value is None:
        return default
    if not isinstance(value, Placement):
        raise PlanError(
            f"{what}: expected a Placement such as Shard(0) or Replicate(), got "
            f"{value!r}. Styles act on a 1-D mesh, so they take one placement."
        )
    return value


def as_dtensor(x, mesh: DeviceMesh, layout: Placement, who: str) -> DTensor:
    """``x`` as a DTensor: kept if it is one, else wrapped as this rank's ``layout`` block."""
    if isinstance(x, DTensor):
        return x
    if not isinstance(x, torch.Tensor):
        raise PlanError(
            f"{who}: expected a torch.Tensor or DTensor input, got {type(x).__name__}. "
            "Pass tensors, or prepare non-tensor inputs with PrepareModuleInput(..., None)."
        )
    return DTensor.from_local(x, mesh, [layout])


def relayout(x: DTensor, layout: Placement) -> DTensor:
    """``x`` redistributed to ``[layout]`` (no-op when already there)."""
    return x.redistribute(x.device_mesh, [layout])


def finish(x, use_local_output: bool):
    return x.to_local() if use_local_output and isinstance(x, DTensor) else x


def _partitioner(layouts: dict[str, Placement], src_data_rank: int | None, target: nn.Module,
                 sources: dict | None = None):
    """A ``partition_fn`` laying out ``target``'s named parameters, replicating the rest.

    ``sources``: values already received from the source rank, by parameter
    id (laid out as they are, without another broadcast)."""

    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if module is not target:
            return
        for key, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            layout = layouts.get(key, Replicate())
            got = sources.get(id(param)) if sources else None
            if got is not None:
                dt = distribute_param(got, mesh, [layout], None)
            else:
                dt = distribute_param(param.data, mesh, [layout], src_data_rank)
            module.register_parameter(key, nn.Parameter(dt, requires_grad=param.requires_grad))

    return partition


def _require(module: nn.Module, fqn: str, style: str, kinds: tuple[type, ...]) -> None:
    if not isinstance(module, kinds):
        names = " or ".join(f"nn.{k.__name__}" for k in kinds)
        raise UnsupportedModuleError(
            f"{style} on {fqn or 'the root module'!r}: expected {names}, got "
            f"{type(module).__name__}. Point the plan at the Linear/Embedding inside "
            "it, or use PrepareModuleInput/PrepareModuleOutput for other modules."
        )


# The styles --------------------------------------------------------------------
class _LinearStyle(ParallelStyle):
    """Column- and row-wise styles: lay out the parameters, bring the input to
    the layout the local matmul needs, lay out the output."""

    input_layouts: Placement
    output_layouts: Placement
    use_local_output: bool

    def _distribute(self, module: nn.Module, device_mesh: DeviceMesh,
                    layouts: dict[str, Placement], desired: Placement) -> nn.Module:
        who = type(self).__name__

        def input_fn(mod, inputs, mesh):
            x = as_dtensor(inputs[0], mesh, self.input_layouts, who)
            return (relayout(x, desired), *inputs[1:])

        def output_fn(mod, out, mesh):
            return finish(relayout(out, self.output_layouts), self.use_local_output)

        return distribute_module(
            module, device_mesh,
            _partitioner(layouts, self.src_data_rank, module, self._sources),
            input_fn, output_fn,
        )

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts="
                f"{self.output_layouts}, use_local_output={self.use_local_output})")


class ColwiseParallel(_LinearStyle):
    """Shard an ``nn.Linear``'s output features (weight and bias ``Shard(0)``) or an
    ``nn.Embedding``'s embedding dim (weight ``Shard(1)``).

    Args:
        input_layouts: layout of a plain-tensor input (default ``Replicate()``);
            the input is redistributed to ``Replicate()`` before the matmul.
        output_layouts: layout of the output (default ``Shard(-1)``).
        use_local_output: return the local block instead of a DTensor (default True).

    Example:
        >>> parallelize_module(nn.Linear(8, 16), mesh, ColwiseParallel())(x).shape
        torch.Size([4, 8])    # on 2 ranks: half the output features
    """

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=True):
        self.input_layouts = placement_arg(input_layouts, "ColwiseParallel(input_layouts)", Replicate())
        self.output_layouts = placement_arg(output_layouts, "ColwiseParallel(output_layouts)", Shard(-1))
        self.use_local_output = use_local_output

    def _check(self, module: nn.Module, fqn: str) -> None:
        _require(module, fqn, "ColwiseParallel", (nn.Linear, nn.Embedding))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._check(module, "")
        layouts = {"weight": Shard(0), "bias": Shard(0)}
        if isinstance(module, nn.Embedding):
            layouts = {"weight": Shard(1)}

        return self._distribute(module, device_mesh, layouts, Replicate())


class RowwiseParallel(_LinearStyle):
    """Shard an ``nn.Linear``'s input features (weight ``Shard(1)``, bias replicated)
    or an ``nn.Embedding``'s vocabulary (weight ``Shard(0)``).

    The local results are partial sums, reduced to ``output_layouts``
    (``Replicate()``: all-reduce; ``Shard(d)``: reduce-scatter). The embedding
    looks up only the ids in this rank's vocabulary range and zeroes the other
    rows, so the table is never gathered. The replicated bias's gradient is
    already replicated (the output's gradient is replicated before the sum:
    the backward of the reduce-scatter is an all-gather), so unlike
    ``SequenceParallel`` nothing needs reducing after backward.

    Args:
        input_layouts: layout of a plain-tensor input (default ``Shard(-1)``;
            embedding ids: give ``Replicate()``).
        output_layouts: layout of the output (default ``Replicate()``).
        use_local_output: return the local block instead of a DTensor (default True).

    Example:
        >>> parallelize_module(emb, mesh, RowwiseParallel(input_layouts=Replicate()))
    """

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=True):
        self.input_layouts = placement_arg(input_layouts, "RowwiseParallel(input_layouts)", Shard(-1))
        self.output_layouts = placement_arg(output_layouts, "RowwiseParallel(output_layouts)", Replicate())
        self.use_local_output = use_local_output

    def _check(self, module: nn.Module, fqn: str) -> None:
        _require(module, fqn, "RowwiseParallel", (nn.Linear, nn.Embedding))
        if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.scale_grad_by_freq):
            raise UnsupportedModuleError(
                f"RowwiseParallel on {fqn or 'the root module'!r}: a vocabulary-sharded "
                "nn.Embedding supports neither max_norm nor scale_grad_by_freq (got "
                f"max_norm={module.max_norm}, scale_grad_by_freq={module.scale_grad_by_freq}). "
                "Use ColwiseParallel for this embedding."
            )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._check(module, "")
        if isinstance(module, nn.Embedding):
            layouts, desired = {"weight": Shard(0)}, Replicate()
            # traced: under torch.compile a skipped forward breaks the model's graph
            module.forward = MethodType(vocab_parallel_forward, module)
            trace_method_later(module, "forward")
        else:
            layouts, desired = {"weight": Shard(1), "bias": Replicate()}, Shard(-1)

        return self._distribute(module, device_mesh, layouts, desired)


class SequenceParallel(ParallelStyle):
    """Replicate a module's parameters and run it on the sequence-sharded input.

    For modules that act on each position alone (``nn.LayerNorm``,
    ``nn.RMSNorm``, ``nn.Dropout``, an RMSNorm of your own): the input becomes
    ``Shard(sequence_dim)`` (a plain tensor is taken as this rank's block), and
    so is the output. The replicated weights' gradients, partial sums over the
    sequence shards, are all-reduced at the end of each backward, all in one
    collective, so ``p.grad`` is ``Replicate`` (``reduce_partial_grads``; PyTorch leaves them
    ``Partial`` and the optimizer reduces them again on every use). Dropout
    on a DTensor draws from dtensor's generator, so its mask is the
    single-device mask.

    Args:
        sequence_dim: the sequence dim of the input (default 1).
        use_local_output: return the local block instead of a DTensor (default False).

    Example:
        >>> parallelize_module(model, mesh, {"norm": SequenceParallel()})
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
            raise PlanError(f"SequenceParallel: sequence_dim must be an int, got {sequence_dim!r}")
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = Shard(self.sequence_dim)
        src, sources = self.src_data_rank, self._sources

        def partition(name, mod, mesh):
            _partitioner({}, src, mod, sources)(name, mod, mesh)

        def input_fn(mod, inputs, mesh):
            if not inputs:
                raise PlanError(f"SequenceParallel on {type(mod).__name__}: called with no inputs")
            reduce_partial_grads(mod)
            x = as_dtensor(inputs[0], mesh, layout, f"SequenceParallel on {type(mod).__name__}")
            return (relayout(x, layout), *inputs[1:])

        def output_fn(mod, out, mesh):
            return finish(out, self.use_local_output)

        distribute_module(module, device_mesh, partition, input_fn, output_fn)
        reduce_partial_grads(module)
        return module

    def __repr__(self) -> str:
        return (f"SequenceParallel(sequence_dim={self.sequence_dim}, "
                f"use_local_output={self.use_local_output})")
