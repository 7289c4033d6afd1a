"""PyTorch's CPU ``_log_softmax_backward_data`` kernel checks neither that
``grad_output`` and ``output`` have one shape nor that ``grad_output`` holds
elements: an empty ``grad_output`` of shape ``(0, 4)`` with a ``(1, 4)``
``output`` kills the process with SIGFPE (an integer division by zero), where
a shape check would raise a ``RuntimeError``.

Each call runs in a child process, so the script survives the crash and prints
one line per case: ``ok``, the error a shape check raised, or the signal.

    python tools/log_softmax_backward_sigfpe.py

torch 2.13.0 CPU: equal shapes (empty ones included) are ``ok``; an empty
``(0, 4)`` grad with a ``(1, 4)`` or ``(4, 4)`` output along dim 0 dies with
SIGFPE. Such blocks meet in the runtime before redistribution (grad
``Shard(0)`` of 4 rows beside a replicated output: on 16 ranks, ranks 4-15
hold a ``(0, 4)`` grad block), so nothing there runs a kernel on blocks as
they are: ``dtensor.dispatch.binding.probe_binding`` runs none at all
(``tests/test_binding_probe.py``).
"""

from __future__ import annotations

import signal
import subprocess
import sys

CASES = (  # (grad_output shape, output shape, dim)
    ((0, 4), (0, 4), 0),
    ((1, 4), (1, 4), 0),
    ((4, 0), (4, 0), 0),
    ((0, 4), (1, 4), 0),
    ((0, 4), (4, 4), 0),
    ((1, 4), (0, 4), 0),
)

_CHILD = """
import sys, torch
g, o, dim = eval(sys.argv[1])
torch.ops.aten._log_softmax_backward_data.default(
    torch.randn(g), torch.randn(o), dim, torch.float32)
"""


def run(case) -> str:
    proc = subprocess.run([sys.executable, "-c", _CHILD, repr(case)],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode == 0:
        return "ok"
    if proc.returncode < 0:
        return f"killed by {signal.Signals(-proc.returncode).name}"
    lines = [x for x in proc.stderr.splitlines() if "Error" in x]
    return (lines[-1] if lines else f"exit {proc.returncode}")[:200]


def main() -> int:
    import torch

    print(f"torch {torch.__version__}: _log_softmax_backward_data(grad, output, dim)")
    crashed = 0
    for g, o, dim in CASES:
        res = run((g, o, dim))
        crashed += res.startswith("killed")
        print(f"  grad {g}, output {o}, dim {dim}: {res}")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
