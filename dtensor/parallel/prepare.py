"""Styles that only lay out a module's inputs and/or outputs (no parameters).

``PrepareModuleInput`` turns the listed inputs into DTensors of the given
layouts and redistributes them to the desired ones before ``forward``;
``PrepareModuleOutput`` does the same to the outputs after it. ``None`` in a
layout tuple leaves that input or output alone.

Example:
    >>> parallelize_module(model, mesh, {"attention": PrepareModuleInput(
    ...     input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))})
"""

from __future__ import annotations

from torch import nn

from dtensor._compile import trace_hook_later
from dtensor.mesh import DeviceMesh
from dtensor.parallel.errors import PlanError
from dtensor.parallel.style import ParallelStyle, as_dtensor, finish, relayout
from dtensor.placement import Placement

__all__ = ["PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput"]


def _layouts(value, what: str, allow_none: bool = True) -> tuple | None:
    """A placement or a tuple of placements/None, as a tuple."""
    if value is None:
        return None
    if isinstance(value, Placement):
        return (value,)
    if isinstance(value, (tuple, list)) and all(
        (v is None and allow_none) or isinstance(v, Placement) for v in value
    ):
        return tuple(value)
    raise PlanError(
        f"{what}: expected a Placement or a tuple of Placements"
        f"{' (None to skip one)' if allow_none else ''}, got {value!r}"
    )


def _pair(have, want, what: str) -> None:
    if have is not None and (want is None or len(have) != len(want)):
        raise PlanError(
            f"{what}: expected as many desired layouts as layouts, got "
            f"{have} and {want}. Give one desired layout per layout (None to skip)."
        )


def _prepare(x, layout, desired, mesh: DeviceMesh, local: bool, who: str):
    if layout is None:
        return x
    dt = as_dtensor(x, mesh, layout, who)
    if desired is not None:
        dt = relayout(dt, desired)
    return finish(dt, local)


class PrepareModuleInput(ParallelStyle):
    """Lay out a module's positional and keyword inputs before its ``forward``.

    Args:
        input_layouts: the layout of each positional input (a plain tensor is
            taken as this rank's block of it); ``None`` skips an input.
        desired_input_layouts: the layout each is redistributed to.
        input_kwarg_layouts / desired_input_kwarg_layouts: the same by keyword.
        use_local_output: pass local blocks instead of DTensors (default False).

    Example:
        >>> PrepareModuleInput(input_layouts=(Shard(1), None),
        ...                    desired_input_layouts=(Replicate(), None))
    """

    def __init__(
        self,
        *,
        input_layouts=None,
        desired_input_layouts=None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_output: bool = False,
    ):
        self.input_layouts = _layouts(input_layouts, "PrepareModuleInput(input_layouts)")
        self.desired_input_layouts = _layouts(
            desired_input_layouts, "PrepareModuleInput(desired_input_layouts)"
        )
        _pair(self.input_layouts, self.desired_input_layouts, "PrepareModuleInput")
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise PlanError(
                "PrepareModuleInput: input_kwarg_layouts and desired_input_kwarg_layouts "
                f"must name the same keywords, got {sorted(self.input_kwarg_layouts)} and "
                f"{sorted(self.desired_input_kwarg_layouts)}"
            )
        for key, p in {**self.input_kwarg_layouts, **self.desired_input_kwarg_layouts}.items():
            _layouts(p, f"PrepareModuleInput(input_kwarg_layouts[{key!r}])")
        self.use_local_output = use_local_output

    def _prepare_args(self, mod, args: tuple, mesh: DeviceMesh) -> tuple:
        if self.input_layouts is None:
            return args
        if len(args) != len(self.input_layouts):
            raise PlanError(
                f"PrepareModuleInput on {type(mod).__name__}: expected "
                f"{len(self.input_layouts)} positional inputs (one per input layout "
                f"{self.input_layouts}), got {len(args)}. Match input_layouts to "
                "forward's arguments (None for ones to leave alone)."
            )
        who = f"PrepareModuleInput on {type(mod).__name__}"
        return tuple(
            _prepare(x, lay, want, mesh, self.use_local_output, who)
            for x, lay, want in zip(args, self.input_layouts, self.desired_input_layouts, strict=True)
        )

    def _prepare_kwargs(self, mod, kwargs: dict, mesh: DeviceMesh) -> dict:
        who = f"PrepareModuleInput on {type(mod).__name__}"
        return {
            k: _prepare(v, self.input_kwarg_layouts.get(k), self.desired_input_kwarg_layouts.get(k),
                        mesh, self.use_local_output, who)
            for k, v in kwargs.items()
        }

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(mod, args, kwargs):
            return (self._prepare_args(mod, args, device_mesh),
                    self._prepare_kwargs(mod, kwargs, device_mesh))

        trace_hook_later(module.register_forward_pre_hook(hook, with_kwargs=True))
        return module

    def __repr__(self) -> str:
        return (f"PrepareModuleInput(input_layouts={self.input_layouts}, "
                f"desired_input_layouts={self.desired_input_layouts}, "
                f"input_kwarg_layouts={self.input_kwarg_layouts}, "
                f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, "
                f"use_local_output={self.use_local_output})")


class PrepareModuleOutput(ParallelStyle):
    """Lay out a module's outputs after its ``forward``.

    Args:
        output_layouts: the layout of each output (a plain tensor is taken as
            this rank's block); ``None`` leaves an output alone.
        desired_output_layouts: the layout each is redistributed to.
        use_local_output: return local blocks instead of DTensors (default True).

    Example:
        >>> PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    """

    def __init__(self, *, output_layouts, desired_output_layouts, use_local_output: bool = True):
        self.output_layouts = _layouts(output_layouts, "PrepareModuleOutput(output_layouts)")
        self.desired_output_layouts = _layouts(
            desired_output_layouts, "PrepareModuleOutput(desired_output_layouts)"
        )
        if self.output_layouts is None:
            raise PlanError("PrepareModuleOutput: output_layouts is required, got None")
        _pair(self.output_layouts, self.desired_output_layouts, "PrepareModuleOutput")
        self.use_local_output = use_local_output

    def _prepare_outputs(self, mod, outputs, mesh: DeviceMesh):
        single = not isinstance(outputs, tuple)
        outs = (outputs,) if single else outputs
        if len(outs) != len(self.output_layouts):
            raise PlanError(
                f"PrepareModuleOutput on {type(mod).__name__}: expected "
                f"{len(self.output_layouts)} outputs (one per output layout), got "
                f"{len(outs)}. Match output_layouts to what forward returns."
            )
        who = f"PrepareModuleOutput on {type(mod).__name__}"
        done = tuple(
            _prepare(x, lay, want, mesh, self.use_local_output, who)
            for x, lay, want in zip(outs, self.output_layouts, self.desired_output_layouts, strict=True)
        )
        return done[0] if len(done) == 1 else done

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        trace_hook_later(module.register_forward_hook(
            lambda mod, inputs, outputs: self._prepare_outputs(mod, outputs, device_mesh)))
        return module

    def __repr__(self) -> str:
        return (f"PrepareModuleOutput(output_layouts={self.output_layouts}, "
                f"desired_output_layouts={self.desired_output_layouts}, "
                f"use_local_output={self.use_local_output})")


class PrepareModuleInputOutput(ParallelStyle):
    """``PrepareModuleInput`` and ``PrepareModuleOutput`` on one module.

    Example:
        >>> PrepareModuleInputOutput(input_layouts=Shard(0), desired_input_layouts=Replicate(),
        ...                          output_layouts=Replicate(), desired_output_layouts=Shard(0))
    """

    def __init__(
        self,
        *,
        input_layouts=None,
        desired_input_layouts=None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_input: bool = False,
        output_layouts,
        desired_output_layouts,
        use_local_output: bool = True,
    ):
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input,
        )
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts,
            desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.prepare_module_input._apply(module, device_mesh)
        self.prepare_module_output._apply(module, device_mesh)
        return module

    def __repr__(self) -> str:
        return f"PrepareModuleInputOutput({self.prepare_module_input}, {self.prepare_module_output})"
