"""``verify_rule``: prove a sharding rule against single device, as a property.

One call, in a test that runs on a world (the test service's ``world``
fixture, ``torchrun -m pytest``, ``pytest --dist-sim``), for an op whose rule
you wrote (``dtensor.register_rule``, ``dtensor.experimental.register_sharding``,
or PyTorch's ``register_sharding`` with ``impl="torch"``). It runs a
Hypothesis property in lockstep on every rank, drawing:

- meshes of 1 to 3 axes over the world (sub-meshes that leave ranks out,
  on the runtime that has them);
- for every tensor argument, placements: every ``Shard`` dim, ``Replicate``
  and ``Partial`` of each reduce op, with ``Partial`` inputs as random pieces
  whose reduction is the value (``dtensor.testing.partial_inputs``);
- the arguments themselves from ``sample_inputs`` (shapes with uneven and
  empty blocks, dtypes, keyword arguments: whatever your strategy draws);

and checks every output's global shape and dtype, every rank's block and
offset (the per-rank oracle) and the values against the op on the full
tensors. A wrong rule fails with a shrunk counterexample naming the op, the
mesh, the input placements, what the rule claimed and what single device
gives, and a ``Replay:`` line.

Example:
    >>> @pytest.mark.world_size(4)
    ... def test_my_rule(world):
    ...     verify_rule(torch.ops.mylib.scale.default,
    ...                 st.tuples(tensors(shape=tensor_shapes(min_dims=1))))
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, reject, seed, settings
from hypothesis import strategies as st

from dtensor.placement import REDUCE_OPS, Partial, Replicate, Shard
from dtensor.testing.impl import Impl, get_impl
from dtensor.testing.meshes import MeshLayout, mesh_layouts, mesh_shapes
from dtensor.testing.partial_inputs import partial_splits
from dtensor.testing.rule_case import (
    Case,
    InvalidCall,
    RuleCounterexample,
    Sample,
    as_sample,
    run_case,
    tensor_leaves_of,
)
from dtensor.testing.strategies import dtypes, tensor_shapes, tensors
from dtensor.testing.verify_shrink import run_drawn

__all__ = ["RuleCounterexample", "Sample", "default_samples", "replay_line",
           "rule_example", "rule_meshes", "rule_placements", "rule_test", "run_drawn",
           "verify_rule", "world_size_now"]


def default_samples() -> st.SearchStrategy[tuple]:
    """One tensor argument: 1-D to 3-D, sides 0..5 (uneven and empty blocks),
    float32 or float64, every fill (``dtensor.testing.tensors``)."""
    return st.tuples(tensors(shape=tensor_shapes(min_dims=1),
                             dtype=dtypes(include=(torch.float32, torch.float64))))


@functools.lru_cache(maxsize=256)  # strategies are immutable; drawn per example
def rule_placements(mesh_ndim: int, tensor_ndim: int, reduce_ops: tuple[str, ...],
                    mixed_reduce_ops: bool = True) -> st.SearchStrategy[tuple]:
    """One placement per mesh axis, each kind (``Replicate``, ``Shard``,
    ``Partial``) equally likely, so a rule's sharded paths are drawn as often as
    its Partial ones; shrinks towards ``Replicate``, then ``Shard(0)``."""

    def axis(ops: tuple[str, ...]) -> st.SearchStrategy:
        kinds = [st.just(Replicate())]
        if tensor_ndim:
            kinds.append(st.integers(0, tensor_ndim - 1).map(Shard))
        if ops:
            kinds.append(st.sampled_from(ops).map(Partial))
        return st.one_of(kinds)

    if mixed_reduce_ops or len(reduce_ops) < 2:
        return st.tuples(*[axis(reduce_ops)] * mesh_ndim)
    return st.sampled_from(reduce_ops).flatmap(
        lambda op: st.tuples(*[axis((op,))] * mesh_ndim))


@functools.lru_cache(maxsize=64)
def rule_meshes(world: int, max_ndim: int, allow_sub_meshes: bool
                ) -> st.SearchStrategy[MeshLayout]:
    """Meshes over the whole world with no size-1 axis half of the time (where a
    rule's layouts differ most), else any mesh ``mesh_layouts`` draws (size-1
    axes, sub-meshes with outsiders)."""
    every = mesh_layouts(world_size=world, max_ndim=max_ndim,
                         allow_sub_meshes=allow_sub_meshes)
    if world == 1:
        return every
    wide = mesh_shapes(world_size=world, max_ndim=max_ndim).filter(lambda s: 1 not in s)
    return st.one_of(wide.map(lambda s: MeshLayout(s, tuple(range(world)))), every)


def world_size_now(fn: str) -> int:
    """The running world's size; a clear error outside a world."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{fn}: no process group: call it from a test that runs on a world "
            "(take the `world` fixture, mark it @pytest.mark.world_size(n), and run "
            "`pytest`, `torchrun --nproc_per_node=4 -m pytest` or `pytest --dist-sim`)")
    return dist.get_world_size()


def replay_line(world: int) -> str:
    """``Replay:`` command for the running test (its examples are derandomized)."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    node = current.rsplit(" (", 1)[0] if current else "<this test>"
    return (f"Replay: torchrun --nproc_per_node={world} -m pytest '{node}'   "
            f"(or: pytest '{node}'; pytest --dist-sim '{node}')")


def _impl(impl: str | Impl) -> Impl:
    return get_impl(impl) if isinstance(impl, str) else impl


def verify_rule(
    op: Any,
    sample_inputs: st.SearchStrategy | None = None,
    *,
    impl: str | Impl = "dtensor",
    max_examples: int = 100,
    max_mesh_ndim: int = 3,
    reduce_ops: Sequence[str] = REDUCE_OPS,
    allow_partial: bool = True,
    allow_sub_meshes: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Check ``op``'s sharding rule against single device on drawn cases.

    Args:
        op: the op overload (``torch.ops.mylib.scale.default``) or any
            callable on tensors that dispatches to it.
        sample_inputs: a strategy drawing the call's arguments: a ``Sample``
            (args and kwargs), a tuple of args, or one tensor. Default:
            ``default_samples()``. Draw from ``dtensor.testing.tensors`` so
            contents shrink to ``arange``.
        impl: ``"dtensor"`` (this runtime) or ``"torch"``
            (``torch.distributed.tensor``; no sub-meshes, one reduce op per
            placement tuple).
        max_examples: drawn cases (every rank runs the same ones).
        max_mesh_ndim: mesh axes, 1 up to this.
        reduce_ops, allow_partial: the ``Partial`` inputs drawn.
        allow_sub_meshes: also meshes that leave ranks out (dtensor only).
        rtol, atol: value tolerances (default: per dtype).

    Raises ``RuleCounterexample`` (an ``AssertionError``), after Hypothesis
    shrank it, on every rank.

    Example:
        >>> verify_rule(torch.ops.mylib.rowscale.default, impl="torch")
    """
    example = rule_example(op, sample_inputs, impl=impl, max_mesh_ndim=max_mesh_ndim,
                           reduce_ops=reduce_ops, allow_partial=allow_partial,
                           allow_sub_meshes=allow_sub_meshes, rtol=rtol, atol=atol)

    @seed(zlib.crc32(f"{op}/{_impl(impl).name}".encode()))
    @settings(max_examples=max_examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck),
              phases=[p for p in Phase if p != Phase.explain])
    @given(data=st.data())
    def check(data: Any) -> None:
        example(data)

    try:
        check()
    except RuntimeError as e:
        # A simulated world (pytest --dist-sim) refuses a Hypothesis run inside
        # a test body, at once and on every rank: draw and shrink the cases
        # without the engine, in lockstep (dtensor.testing.verify_shrink).
        if type(e).__name__ != "InnerGivenInSimWorld":
            raise
        key = zlib.crc32(f"{op}/{_impl(impl).name}".encode())
        run_drawn(example, max_examples, key)


def rule_example(
    op: Any,
    sample_inputs: st.SearchStrategy | None = None,
    *,
    impl: str | Impl = "dtensor",
    max_mesh_ndim: int = 3,
    reduce_ops: Sequence[str] = REDUCE_OPS,
    allow_partial: bool = True,
    allow_sub_meshes: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
) -> Callable[[Any], None]:
    """The body of one ``verify_rule`` example: ``example(data)`` draws a case
    from ``data`` (``st.data()``) and checks it. For a test that is itself the
    property (``rule_test``, or ``@given(data=st.data())`` on the test): the
    form simulated worlds run, where an inner ``@given`` is refused."""
    the_impl = _impl(impl)
    world = world_size_now("verify_rule")
    strategy = default_samples() if sample_inputs is None else sample_inputs
    if not isinstance(strategy, st.SearchStrategy):
        raise ValueError(f"verify_rule: sample_inputs must be a Hypothesis strategy, "
                         f"got {type(strategy).__name__}; e.g. st.tuples(tensors())")
    ops = tuple(reduce_ops) if allow_partial else ()
    replay = replay_line(world)
    sub = allow_sub_meshes and the_impl.sub_meshes
    layouts = rule_meshes(world, max_mesh_ndim, sub)

    def example(data: Any) -> None:
        sample = as_sample(data.draw(strategy, label="sample"))
        layout = data.draw(layouts, label="mesh")
        ps = tuple(
            data.draw(rule_placements(layout.ndim, t.ndim, ops,
                                      the_impl.mixed_partials),
                      label=f"placements of tensor {i}")
            for i, t in enumerate(tensor_leaves_of(sample)))
        split = data.draw(partial_splits(mesh_ndim=layout.ndim), label="partial pieces")
        try:
            run_case(the_impl, Case(op, sample, layout, ps, split), rtol=rtol,
                     atol=atol, replay=replay)
        except InvalidCall:
            reject()  # single device refuses this sample too: not a case

    return example


def rule_test(op: Any, sample_inputs: st.SearchStrategy | None = None, *,
              world_size: int = 4, max_examples: int = 100, **kwargs: Any) -> Callable:
    """A pytest test proving ``op``'s rule: the test is the Hypothesis property
    (``@given(data=st.data())``), so it runs under ``pytest``, ``torchrun -m
    pytest`` and ``pytest --dist-sim`` alike. ``kwargs`` as for ``verify_rule``.

    Example (a whole test module's content):
        >>> test_scale_rule = rule_test(torch.ops.mylib.scale.default, world_size=4)
    """
    import pytest

    @pytest.mark.world_size(world_size)
    @settings(max_examples=max_examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck),
              phases=[p for p in Phase if p != Phase.explain])
    @given(data=st.data())
    def test_rule(world: Any, data: Any) -> None:
        rule_example(op, sample_inputs, **kwargs)(data)

    test_rule.__name__ = test_rule.__qualname__ = f"test_rule_of_{_slug(op)}"
    return test_rule


def _slug(op: Any) -> str:
    name = str(op) if isinstance(op, torch._ops.OpOverload) else getattr(
        op, "__name__", "op")
    return "".join(c if c.isalnum() else "_" for c in name)
