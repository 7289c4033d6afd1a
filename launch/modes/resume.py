"""The command line that resumes a lockstep run after a given test, on the
run's own layout (ranks per node, nodes), as the report prints it."""

from __future__ import annotations

import shlex

import pytest

__all__ = ["nodes_text", "resume_command"]


def nodes_text(local: int, world: int) -> str:
    return f"{world // max(local, 1)} nodes of {local}, " if world > local else ""


def resume_command(config: pytest.Config, after: str | None, local: int, world: int) -> str:
    """The torchrun command line that reruns this session after test ``after``,
    on the run's own layout: ``local`` ranks per node, ``world`` in all."""
    nodes = max(1, world // max(local, 1))
    args, skip = [], False
    for a in config.invocation_params.args:
        if skip:
            skip = False
            continue
        if a == "--dist-start-after":
            skip = True
            continue
        if not a.startswith("--dist-start-after="):
            args.append(a)
    cmd = ["torchrun", f"--nproc_per_node={local}"]
    if nodes > 1:
        cmd += [f"--nnodes={nodes}", "--rdzv-backend=c10d", "--rdzv-endpoint=HOST:PORT"]
    cmd += ["-m", "pytest", *args]
    if after is not None:
        cmd.append(f"--dist-start-after={after}")
    return shlex.join(cmd)
