"""``verify_plan``: prove a parallel plan against the single-device model.

The model is built twice from one seed; one copy is parallelized with the
plan (``parallelize_module`` of the runtime under test), and, on drawn
inputs (batch shapes included), both copies run one training step with the
same RNG seed (dropout as users seed it). Compared, in the order a user
would look: every submodule's forward output (where the parallel copy's is
a DTensor or a plain tensor of the full shape), the loss, every parameter's
gradient and every parameter after one SGD step, each as a full tensor. A
wrong plan fails with the first module and tensor that differ, shrunk by
Hypothesis, on every rank.

Example:
    >>> verify_plan(lambda: MLP(8, 16),
    ...             {"w1": ColwiseParallel(), "w2": RowwiseParallel()},
    ...             inputs=tensors(shape=st.tuples(st.integers(1, 4), st.just(8)),
    ...                            dtype=torch.float32))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from dtensor.testing.compare import compare_block
from dtensor.testing.impl import Impl, get_impl
from dtensor.testing.rule_case import RuleCounterexample, _short
from dtensor.testing.verify import replay_line, world_size_now
from dtensor.testing.verify_shrink import run_drawn

__all__ = ["PlanCounterexample", "verify_plan"]


class PlanCounterexample(RuleCounterexample):
    """A parallelized model differs from its single-device copy."""


def _parallelize(impl: Impl) -> Callable:
    if impl.name == "dtensor":
        from dtensor.parallel import parallelize_module
    else:
        from torch.distributed.tensor.parallel import parallelize_module
    return parallelize_module


def _full(x: Any, impl: Impl) -> Any:
    if isinstance(x, impl.DTensor):
        return x.full_tensor()
    return x


def _default_loss(out: Any) -> Any:
    return (out.float() ** 2).mean()


def verify_plan(
    make_model: Callable[[], torch.nn.Module],
    plan: Any,
    *,
    inputs: st.SearchStrategy,
    mesh_shape: tuple[int, ...] | None = None,
    loss_fn: Callable[[Any], Any] = _default_loss,
    impl: str | Impl = "dtensor",
    max_examples: int = 10,
    lr: float = 0.1,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> None:
    """Check that ``plan`` keeps ``make_model()``'s training step single-device exact.

    Args:
        make_model: builds the model (called twice per example, after
            ``torch.manual_seed`` with one seed, so both copies start equal).
        plan: what ``parallelize_module`` takes (a style, or a dict from
            submodule paths to styles) for the runtime ``impl``.
        inputs: a strategy drawing the model's input tensor (or a tuple of
            positional inputs), the same on every rank.
        mesh_shape: default ``(world,)`` (``parallelize_module`` takes 1-D meshes).
        loss_fn: ``output -> scalar``; default mean of squares. Given the
            parallel copy's output as is (plain or DTensor).
        impl: ``"dtensor"`` or ``"torch"``.
        max_examples, lr, rtol, atol: examples drawn, SGD step, tolerances.

    Raises ``PlanCounterexample`` (an ``AssertionError``) on every rank.
    """
    the_impl = get_impl(impl) if isinstance(impl, str) else impl
    world = world_size_now("verify_plan")
    shape = tuple(mesh_shape or (world,))
    parallelize = _parallelize(the_impl)
    replay = replay_line(world)
    from dtensor.testing.meshes import MeshLayout

    layout = MeshLayout(shape, tuple(range(_prod(shape))))

    @seed(20261128)  # fixed: a replay draws the same cases
    @settings(max_examples=max_examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck),
              phases=[p for p in Phase if p != Phase.explain])
    @given(data=st.data())
    def check(data: Any) -> None:
        example(data)

    def example(data: Any) -> None:
        x = data.draw(inputs, label="inputs")
        model_seed = data.draw(st.integers(0, 2**16), label="model seed")
        rng_seed = data.draw(st.integers(0, 2**16), label="rng seed")
        args = x if isinstance(x, tuple) else (x,)
        mesh = the_impl.mesh(layout)
        torch.manual_seed(model_seed)
        ref = make_model()
        torch.manual_seed(model_seed)
        par = make_model()
        err: BaseException | None = None
        running: list[str] = []  # the parallel copy's modules whose forward is open
        where = "parallelize_module"
        try:
            parallelize(par, mesh, plan)
            where = "the parallel copy"
            records = _run_step(ref, par, args, loss_fn, lr, rng_seed, the_impl, running)
        except Exception as e:  # a plan that cannot run: the same on every rank
            err = e
            records = []
        if err is not None:
            if running:  # the innermost module whose forward raised
                where += f", in module {_module(par, running[-1], the_impl)}"
            why = f"{where} raised {type(err).__name__}: {err}"
            raise PlanCounterexample(_report(args, layout, why, replay)) from err
        for what, got, want in records:
            problem = _differs(got, want, rtol, atol)
            if problem is not None:
                why = f"{what}: {problem}"
                raise PlanCounterexample(_report(args, layout, why, replay))

    try:
        check()
    except RuntimeError as e:  # a simulated world: no engine inside a test body
        if type(e).__name__ != "InnerGivenInSimWorld":
            raise
        run_drawn(example, max_examples, 20261128, max_shrinks=100,
                  error=PlanCounterexample)


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _module(model: torch.nn.Module, name: str, impl: Impl) -> str:
    """``'w2' (Linear; weight S(1), bias R)``: a module of the parallel copy
    with its own parameters' placements (plain: not distributed)."""
    mod = model.get_submodule(name)
    parts = []
    for key, p in mod.named_parameters(recurse=False):
        where = (", ".join(str(x) for x in p.placements) if isinstance(p, impl.DTensor)
                 else "plain")
        parts.append(f"{key} {where}")
    own = f"; {', '.join(parts)}" if parts else ""
    return f"{name or '(the model)'!r} ({type(mod).__name__}{own})"


def _param(model: torch.nn.Module, name: str, impl: Impl) -> str:
    p = model.get_parameter(name)
    where = (", ".join(str(x) for x in p.placements) if isinstance(p, impl.DTensor)
             else "plain")
    return f"{name!r} ({where} in the parallel copy)"


def _run_step(ref, par, args, loss_fn, lr, rng_seed, impl, running):
    """Forward (every submodule's output recorded), loss, backward, one SGD
    step on both copies; ``[(what, parallel value, single-device value)]`` in
    the order to compare. Every collective (full tensors) happens here, on
    every rank, before any comparison. ``running`` holds the parallel copy's
    modules whose forward has begun and not returned (where an error arose)."""
    outs: dict[str, list] = {"ref": [], "par": []}
    hooks = []
    for tag, model in (("ref", ref), ("par", par)):
        for name, mod in model.named_modules():
            def hook(m, inp, out, name=name, tag=tag):
                if tag == "par":
                    running.pop()
                full = _full(out, impl) if isinstance(out, torch.Tensor) else None
                outs[tag].append((name, full))
            hooks.append(mod.register_forward_hook(hook))
            if tag == "par":
                hooks.append(mod.register_forward_pre_hook(  # before the plan's own
                    lambda m, inp, name=name: running.append(name), prepend=True))
    try:
        torch.manual_seed(rng_seed)
        y_ref = ref(*args)
        torch.manual_seed(rng_seed)
        y_par = par(*args)
    finally:
        for h in hooks:
            h.remove()
    loss_ref, loss_par = loss_fn(y_ref), loss_fn(y_par)
    loss_ref.backward()
    loss_par.backward()
    records = []
    for (name, got), (_, want) in zip(outs["par"], outs["ref"], strict=False):
        if got is not None and want is not None and got.shape == want.shape:
            records.append((f"forward output of module {_module(par, name, impl)}",
                            got.detach(), want.detach()))
    records.append(("the model's output", _full(y_par, impl).detach(), y_ref.detach()))
    records.append(("the loss", _full(loss_par, impl).detach(), loss_ref.detach()))
    pars = dict(par.named_parameters())
    for name, p in ref.named_parameters():
        q = pars[name]
        g = None if q.grad is None else _full(q.grad, impl)
        records.append((f"gradient of {_param(par, name, impl)}", g, p.grad))
    with torch.no_grad():
        for model in (ref, par):
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr)
    for name, p in ref.named_parameters():
        records.append((f"{_param(par, name, impl)} after one SGD step (lr={lr})",
                        _full(pars[name], impl).detach(), p.detach()))
    return records


def _differs(got, want, rtol, atol) -> str | None:
    if got is None or want is None:
        return None if got is None and want is None else (
            f"parallel copy has {'no' if got is None else 'a'} value, single device "
            f"{'none' if want is None else 'has one'}")
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {list(got.shape)}, single device {list(want.shape)}"
    try:
        compare_block(got, want.to(got.dtype), (0,) * want.ndim, "", "", rtol, atol,
                      True)
    except AssertionError as e:
        return (f"{str(e).lstrip(': ')}; single device: {_short(want)}; "
                f"got: {_short(got)}")
    return None


def _report(args, layout, problem: str, replay: str) -> str:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    ins = ", ".join(_short(a) for a in args)
    return (f"parallel plan counterexample (rank {rank}):\n  mesh: {layout}\n"
            f"  inputs: {ins}\n  first difference: {problem}\n{replay}")
