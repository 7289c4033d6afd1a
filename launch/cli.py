"""``python -m launch``: run pytest in lockstep on a world of N ranks.

A thin layer over ``torch.distributed.run``: it adds a run folder with
per-rank logs, restarts a world that a hang or a dead rank made unusable (the
run continues after the bad test) and a final summary line. The exit code is
pytest's, agreed by all ranks; non-zero on any failure.

    python -m launch --nproc-per-node 4 [--backend gloo] -- tests/ -q
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from launch.modes.lockstep import RUN_DIR_ENV, STATUS_ENV


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        k = argv.index("--")
        argv, rest = argv[:k], argv[k + 1:]
    else:
        rest = []
    p = argparse.ArgumentParser(prog="python -m launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=2)
    p.add_argument("--backend", default=None, help="gloo or nccl (default: by device)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="fresh worlds after a hang or dead rank (default 3)")
    p.add_argument("--timeout", type=float, default=None, help="per-test timeout (s)")
    p.add_argument("--log-dir", default=".launch-logs", help="root of run folders")
    args, unknown = p.parse_known_args(argv)
    return args, unknown + rest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fuzz"]:  # python -m launch fuzz ...: see launch.fuzz.cli
        from launch.fuzz.cli import main as fuzz

        return fuzz(argv[1:])
    args, pytest_args = parse(argv)
    from torch.distributed.run import get_args_parser, run

    run_dir = Path(args.log_dir).resolve() / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    status = run_dir / "status"
    os.environ.update({STATUS_ENV: str(status), RUN_DIR_ENV: str(run_dir)})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    extra = []
    if args.backend:
        extra.append(f"--dist-backend={args.backend}")
    if args.timeout:
        extra.append(f"--dist-timeout={args.timeout}")
    targs = get_args_parser().parse_args([
        "--standalone", f"--nproc-per-node={args.nproc_per_node}",
        f"--max-restarts={args.max_restarts}", "--monitor-interval=0.1",
        "-m", "pytest", *extra, *pytest_args])
    crashed = None
    try:
        run(targs)
    except Exception as e:  # ChildFailedError: torchrun printed the details
        crashed = e
    code = int(status.read_text()) if status.exists() else 1
    print(f"launch: {args.nproc_per_node} ranks, exit status {code}"
          f"{' (the world failed: ' + type(crashed).__name__ + ')' if crashed and not status.exists() else ''}"
          f"; rank logs in {run_dir}", file=sys.stderr)
    return code
