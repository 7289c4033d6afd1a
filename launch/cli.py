"""``python -m launch``: run pytest in lockstep on a world of N ranks.

A thin layer over ``torch.distributed.run``: it adds a run folder with
per-rank logs, restarts a world that a hang or a dead rank made unusable (the
run continues after the bad test) and a final summary line (the whole
command's time and its world restarts). The exit code is pytest's, agreed by
all ranks; non-zero on any failure.

    python -m launch --nproc-per-node 4 [--backend gloo] -- tests/ -q
    python -m launch fuzz tests/properties --minutes 10   # see launch.fuzz.cli

Its own options come before ``--``, pytest's after it. Both are checked
before any world starts: a bad value, an unknown option, a path that does not
exist or a pytest usage error exits 2 (or pytest's 4) with the reason, once.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import time
from pathlib import Path

from launch.modes.lockstep import RUN_DIR_ENV, STATUS_ENV

BACKENDS = ("gloo", "nccl")
EPILOG = """\
pytest's own arguments go after --:
  python -m launch --nproc-per-node 4 -- tests/ -q -x
subcommand:
  python -m launch fuzz PATHS [--minutes M] [--nproc N | --sim N]
      a time-boxed fuzzing session of every @given test (--help for more)
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # NOTE: argparse's own: usage + exit 2
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> _Parser:
    p = _Parser(prog="python -m launch", description=__doc__.split("\n\n")[0].replace("``", ""),
                usage="%(prog)s [options] [paths ...] [-- pytest arguments]\n"
                      "       %(prog)s fuzz [paths ...] [fuzz options]",
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=2,
                   help="ranks of the world, >= 1 (default 2)")
    p.add_argument("--backend", default=None, choices=BACKENDS,
                   help="process group backend (default: nccl with a GPU per rank, "
                        "else gloo)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="fresh worlds after a hang or dead rank, >= 0 (default 3)")
    p.add_argument("--timeout", type=float, default=None,
                   help="per-test hang watchdog in seconds, > 0 (default: the "
                        "plugin's --dist-timeout, 120)")
    p.add_argument("--log-dir", default=".launch-logs", help="root of run folders")
    p.add_argument("paths", nargs="*", help="test paths (or give them after --)")
    return p


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This command's options and pytest's arguments; exits 2 with the reason
    on an unknown option or a value out of range."""
    if "--" in argv:
        k = argv.index("--")
        argv, rest = argv[:k], argv[k + 1:]
    else:
        rest = []
    p = _parser()
    args, unknown = p.parse_known_args(argv)
    if unknown:
        own = [s for a in p._actions for s in a.option_strings if "_" not in s]
        bad = unknown[0].split("=")[0]
        near = difflib.get_close_matches(bad, own, n=1, cutoff=0.5)
        p.error(f"unknown option {unknown[0]}"
                + (f" (did you mean {near[0]}?)" if near else "")
                + f"; pytest's options go after --: python -m launch [options] -- "
                  f"{shlex_join(unknown)}")
    for flag, value, ok, allowed in (
            ("--nproc-per-node", args.nproc_per_node, args.nproc_per_node >= 1, ">= 1"),
            ("--max-restarts", args.max_restarts, args.max_restarts >= 0, ">= 0"),
            ("--timeout", args.timeout, args.timeout is None or args.timeout > 0,
             "> 0 seconds (leave it out for the default, 120)")):
        if not ok:
            p.error(f"{flag} must be {allowed}, got {value:g}")
    if args.backend == "nccl":
        why = _no_nccl(args.nproc_per_node)
        if why:  # one line: the usage is not what is wrong
            p.exit(2, f"{p.prog}: error: --backend nccl {why}; use --backend gloo "
                      "(or leave --backend out)\n")
    return args, [*args.paths, *rest]


def shlex_join(words: list[str]) -> str:
    import shlex

    return shlex.join(words)


def _no_nccl(n: int) -> str:
    """Why a world of ``n`` NCCL ranks cannot start here ("" when it can)."""
    import torch

    if not torch.cuda.is_available():
        build = "no CUDA (a CPU-only build)" if torch.version.cuda is None else "no CUDA device visible"
        return f"needs a CUDA device per rank; here torch {torch.__version__} has {build}"
    if torch.cuda.device_count() < n:
        return (f"needs a CUDA device per rank; {n} ranks, "
                f"{torch.cuda.device_count()} devices")
    return ""


def check_pytest_args(pytest_args: list[str]) -> tuple[int, str]:
    """Parse ``pytest_args`` as the ranks will (plugins, conftests, options)
    and check that the paths exist, in this process, before any world starts:
    (0, "") when they are fine, else (pytest's exit status, its message)."""
    import pytest
    from _pytest.config import ConftestImportFailure, _prepareconfig

    try:
        config = _prepareconfig(list(pytest_args))
    except pytest.UsageError as e:
        return int(pytest.ExitCode.USAGE_ERROR), "\n".join(f"ERROR: {m}" for m in e.args)
    except ConftestImportFailure as e:
        return int(pytest.ExitCode.USAGE_ERROR), f"ImportError while loading conftest '{e.path}': {e.cause!r}"
    except Exception:  # anything else: the world reports it as pytest does
        return 0, ""
    base = Path(config.invocation_params.dir)
    for arg in config.args:
        path = re.split(r"::|\[", arg, maxsplit=1)[0]
        if path and not (base / path).exists():
            return (int(pytest.ExitCode.USAGE_ERROR),
                    f"ERROR: file or directory not found: {arg}")
    return 0, ""


def _restarts(run_dir: Path) -> int:
    """World restarts in this run: the attempts rank 0 logged, less one."""
    try:
        text = (run_dir / "rank0.log").read_text(errors="replace")
    except OSError:
        return 0
    attempts = {int(a) for a in re.findall(r"^===== attempt (\d+),", text, re.M)}
    return max(attempts, default=0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fuzz"]:  # python -m launch fuzz ...: see launch.fuzz.cli
        from launch.fuzz.cli import main as fuzz

        return fuzz(argv[1:])
    t0 = time.monotonic()
    args, pytest_args = parse(argv)
    code, why = check_pytest_args(pytest_args)
    if code:
        print(f"{why}\nlaunch: pytest refused its arguments ({shlex_join(pytest_args)}); "
              "no world started", file=sys.stderr)
        return code
    from torch.distributed.run import get_args_parser, run

    run_dir = Path(args.log_dir).resolve() / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    status = run_dir / "status"
    os.environ.update({STATUS_ENV: str(status), RUN_DIR_ENV: str(run_dir)})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    extra = []
    if args.backend:
        extra.append(f"--dist-backend={args.backend}")
    if args.timeout is not None:
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
    restarts = _restarts(run_dir)
    print(f"launch: {args.nproc_per_node} ranks, exit status {code}"
          f"{' (the world failed: ' + type(crashed).__name__ + ')' if crashed and not status.exists() else ''}"
          f", {time.monotonic() - t0:.1f} s in all, {restarts} world restart"
          f"{'' if restarts == 1 else 's'}; rank logs in {run_dir}", file=sys.stderr)
    return code
