"""Covers: dtensor/dispatch/binding.py, the probe that picks the quickest
Python callable for an op overload (one process, no process group).

- the probe runs no kernel on data: the blocks an op meets before
  redistribution need not fit together, and PyTorch's CPU
  ``_log_softmax_backward_data`` kills the process (SIGFPE) on an empty
  gradient beside a non-empty output;
- its verdict for every registered rule's schema call equals what full
  recorded runs of each candidate say (one dispatcher call, the op itself,
  the same arguments), on host tensors that fit and on meta tensors.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dtensor.dispatch import binding
from dtensor.dispatch.binding import probe_binding
from dtensor.testing.schema_calls import example_tensors, sample_calls

aten = torch.ops.aten


class _NoDataKernels(TorchDispatchMode):
    """Below the probe's own mode: sees every op the probe lets run, and runs
    none that holds data (an op on meta tensors only may run)."""

    def __init__(self) -> None:
        super().__init__()
        self.ran: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [*args, *(kwargs or {}).values()]
        tensors = [t for x in flat for t in (x if isinstance(x, (list, tuple)) else [x])
                   if isinstance(t, torch.Tensor)]
        if any(t.device.type != "meta" for t in tensors):
            self.ran.append(func)
            raise RuntimeError(f"the probe ran {func} on data")
        return func(*args, **(kwargs or {}))


_MISMATCHED = [  # (op, local blocks before redistribution, binding)
    # grad Shard(0) of 4 rows over 16 ranks beside a replicated output
    (aten._log_softmax_backward_data.default,
     [torch.zeros(0, 4), torch.zeros(4, 4), 0, torch.float32],
     torch._C._VariableFunctions._log_softmax_backward_data),
    (aten._softmax_backward_data.default,
     [torch.zeros(0, 4), torch.zeros(4, 4), 0, torch.float32],
     torch._C._VariableFunctions._softmax_backward_data),
    (aten.mm.default, [torch.zeros(2, 4), torch.zeros(2, 4)], torch._C._VariableFunctions.mm),
    (aten.add_.Tensor, [torch.zeros(0, 4), torch.zeros(4, 4)], torch._C.TensorBase.add_),
    (aten.bernoulli.p, [torch.zeros(4), 0.5], torch._C._VariableFunctions.bernoulli),
]


@pytest.mark.parametrize(("func", "loc", "want"), _MISMATCHED,
                         ids=[str(c[0]) for c in _MISMATCHED])
def test_the_probe_runs_no_kernel_on_blocks_that_do_not_fit(func, loc, want) -> None:
    spy = _NoDataKernels()
    with spy:
        found = probe_binding(func, loc, {})
    assert not spy.ran, f"the probe ran {spy.ran} on host tensors"
    assert found is want


def test_an_empty_gradient_block_beside_the_output_gets_its_binding() -> None:
    # PyTorch's CPU kernel on these blocks dies with SIGFPE (no shape check):
    # a probe that runs it takes the test process down.
    found = probe_binding(aten._log_softmax_backward_data.default,
                          [torch.zeros(0, 4), torch.zeros(4, 4), 0, torch.float32], {})
    assert found is torch._C._VariableFunctions._log_softmax_backward_data


class _Capture(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, list(args), dict(kwargs or {})))
        return func(*args, **(kwargs or {}))


def _full_run_verdict(func, loc, kwargs):
    """The binding that full recorded runs find (every dispatcher call the
    candidate makes, kernels run): on zero host tensors of the blocks' shapes
    (these fit: the op ran on them), then on meta tensors; else ``func._op``."""
    if any(map(binding._holds_tensors, [*loc, *kwargs.values()])):
        return func._op  # lists of tensors are never probed
    host = [torch.zeros_like(x) if isinstance(x, torch.Tensor) else x for x in loc]
    random = torch.Tag.nondeterministic_seeded in func.tags
    for pargs in ([] if random else [host]) + [binding._meta_args(loc)]:
        for cand in binding._candidates(func):
            rec = binding._Record()
            try:
                with rec:
                    cand(*pargs, **kwargs)
            except Exception:  # not a way to call func
                continue
            if len(rec.calls) == 1:
                f, a, k = rec.calls[0]
                if f is func and binding._same(list(a), pargs) and binding._same(k, kwargs):
                    return cand
    return func._op


def test_verdicts_equal_a_full_recorded_run_on_every_schema_call() -> None:
    seen, found = 0, 0
    for call in sample_calls().values():
        cap = _Capture()
        try:
            with cap:
                call.run(example_tensors(call))
        except Exception:  # the op refuses these values: nothing to probe
            continue
        for func, args, kwargs in cap.calls:
            want = _full_run_verdict(func, args, kwargs)
            got = probe_binding(func, args, kwargs)
            assert got is want, f"{func}: probe {got}, full run {want}"
            seen += 1
            found += got is not func._op
    assert seen > 100 and found > 50, (seen, found)
