"""Which module is running, and in which phase, for ``CommDebugMode``.

Attributes a collective to a module the way PyTorch's ``CommDebugMode``
does, so per-module counts read the same:

- forward: a module is current from its forward pre-hook until a forward
  hook of its own that is registered the first time it runs, i.e. *after*
  the hooks a parallel style registered earlier. A collective issued by a
  style's output hook (a row-parallel all-reduce) belongs to the module,
  not to its parent.
- backward: the module whose backward pre-hook ran last (its gradient
  computation, the input-gradient collectives of a column-parallel style
  included); the phase is "backward" while autograd's engine runs.
- outside any module (an optimizer step, ``clip_grad_norm_``): "Global"
  only, in the "forward" phase, the only other phase PyTorch reports.

A collective counts for the current module and every module that was on
the forward stack when it first ran (its parents), plus "Global".
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["ModuleTracker", "in_backward"]


def in_backward() -> bool:
    """Is autograd's engine running (this thread's backward pass)?"""
    return torch._C._current_graph_task_id() != -1


class ModuleTracker:
    """Current module FQN and its parents, from global module hooks (see module doc)."""

    def __init__(self, on_forward: Callable[[str, nn.Module], None] | None = None) -> None:
        self._on_forward = on_forward
        self.name = "Global"
        self._stack = ["Global"]
        self.parents: dict[str, frozenset[str]] = {"Global": frozenset({"Global"})}
        self._fqns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._hooked: weakref.WeakSet = weakref.WeakSet()
        self._handles: list = []
        self._reset_queued = False

    def fqn(self, mod: nn.Module) -> str:
        """``Root.child.grandchild``: the first module seen names its subtree."""
        name = self._fqns.get(mod)
        if name is None:
            name = self._fqns[mod] = type(mod).__name__
            for child_path, child in mod.named_modules(prefix=name):
                self._fqns.setdefault(child, child_path)
        return name

    def modules(self) -> frozenset[str]:
        """The modules a collective issued now counts for ("Global" included)."""
        return self.parents.get(self.name, frozenset({self.name, "Global"}))

    def __enter__(self) -> ModuleTracker:
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._pre),
            nn.modules.module.register_module_full_backward_pre_hook(self._backward_pre),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, mod: nn.Module, inputs) -> None:
        if in_backward():
            return  # activation checkpointing's recompute: backward's module stays
        name = self.fqn(mod)
        self._stack.append(name)
        self.parents.setdefault(name, frozenset(self._stack))
        self.name = name
        if mod not in self._hooked:
            # Registered now, so it runs after the module's existing forward
            # hooks (a parallel style's output redistribute).
            self._handles.append(mod.register_forward_hook(self._post, always_call=True))
            self._hooked.add(mod)
        if self._on_forward is not None:
            self._on_forward(name, mod)

    def _post(self, mod: nn.Module, inputs, outputs) -> None:
        if in_backward():
            return
        if len(self._stack) > 1:
            self._stack.pop()
        self.name = self._stack[-1]

    def _backward_pre(self, mod: nn.Module, grad_output) -> None:
        self.name = self.fqn(mod)
        if not self._reset_queued:
            # After backward, collectives belong to the forward stack again.
            self._reset_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._reset_queued = False
        self.name = self._stack[-1]
