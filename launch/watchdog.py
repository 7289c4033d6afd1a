"""Per-rank hang watchdog and termination handler.

One daemon thread per rank. The main thread arms it around each test
(``arm`` -> ``agreeing`` -> ``disarm``, a few attribute writes). The thread
fires when the deadline passes or when the process gets SIGTERM (torchrun
sends it to the survivors when a rank dies). When it fires, every rank dumps
its Python stacks to its log and posts where its test thread is; rank 0 waits
briefly for the others, names the stuck and dead ranks, hands the report to
the mode's ``on_fatal`` callback, and all ranks exit.

It uses its own store client: the main thread may be blocked in a store wait.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "broadcast", "broadcast_object_list", "barrier",
    "monitored_barrier", "send", "recv", "isend", "irecv", "gather", "scatter",
    "reduce", "gather_object", "scatter_object_list", "wait", "new_group",
}


def where(frame: Any) -> dict[str, str]:
    """Innermost frame of a thread, its innermost frame outside torch, and the
    innermost torch.distributed collective on its stack."""
    inner = _fmt(frame)
    user = coll = ""
    f = frame
    while f is not None:
        path = f.f_code.co_filename.replace("\\", "/")
        in_torch = "/torch/" in path
        if not coll and in_torch and f.f_code.co_name in COLLECTIVES \
                and "/distributed/" in path:
            coll = f.f_code.co_name
        if not user and not in_torch and not _library(path):
            user = _fmt(f)
        f = f.f_back
    return {"innermost": inner, "user": user or inner, "collective": coll}


def _library(path: str) -> bool:
    return ("/site-packages/" in path or "/launch/" in path or path.startswith("<")
            or path.startswith(_STDLIB))


_STDLIB = os.path.dirname(os.__file__)


def _fmt(f: Any) -> str:
    return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"


class Watchdog:
    """See the module docstring. ``on_fatal(key, item, text)`` runs on rank 0
    only and returns the exit code."""

    def __init__(self, rank: int, size: int, side_store: Any, log: Any,
                 on_fatal: Callable[[str | None, Any, str], int]) -> None:
        self.rank, self.size, self.store, self.log = rank, size, side_store, log
        self.on_fatal = on_fatal
        self._lock = threading.Lock()
        self._key: str | None = None
        self._item: Any = None
        self._deadline = float("inf")
        self._timeout = 0.0
        self._phase = "idle"  # idle | test | agree
        self.fired = False
        self._main = threading.main_thread().ident
        self._rsock, self._wsock = socket.socketpair()
        self._rsock.setblocking(False)
        self._wsock.setblocking(False)

    def start(self) -> None:
        """Install the SIGTERM handler (main thread only) and start the thread."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: None)
            signal.set_wakeup_fd(self._wsock.fileno(), warn_on_full_buffer=False)
        self.store.set(f"pid/{self.rank}", f"{socket.gethostname()}:{os.getpid()}")
        threading.Thread(target=self._run, name="launch-watchdog", daemon=True).start()

    def arm(self, key: str, item: Any, timeout: float) -> None:
        self._key, self._item, self._timeout = key, item, timeout
        self._phase = "test"
        self._deadline = time.monotonic() + timeout

    def agreeing(self) -> None:
        self._phase = "agree"

    def disarm(self) -> None:
        """Back to idle; if the watchdog already fired, block until it exits us."""
        with self._lock:
            if not self.fired:
                self._phase, self._deadline = "idle", float("inf")
                return
        while True:
            time.sleep(3600)

    # -- the thread -------------------------------------------------------
    def _run(self) -> None:
        import select

        while True:
            left = self._deadline - time.monotonic()
            r, _, _ = select.select([self._rsock], [], [], max(0.0, min(left, 1.0)))
            if r:
                try:
                    sigs = self._rsock.recv(64)
                except BlockingIOError:
                    sigs = b""
                if signal.SIGTERM in sigs or signal.SIGINT in sigs:
                    self._fire("terminated (SIGTERM: a peer rank died or the launcher stopped the world)")
            elif time.monotonic() >= self._deadline:
                self._fire(f"timed out after {self._timeout:g} s")

    def _fire(self, reason: str) -> None:
        with self._lock:
            if self.fired:
                return
            self.fired = True
            key, item, phase = self._key if self._phase != "idle" else None, self._item, self._phase
        code = 1
        try:
            frame = sys._current_frames().get(self._main)
            info = where(frame) if frame is not None else {}
            info.update(phase=phase, reason=reason)
            self._dump(reason, item)
            self.store.set(f"fatal/{key}/{self.rank}", json.dumps(info))
            if self.rank == 0:
                text = self._report(key, item, reason)
                code = self.on_fatal(key, item, text)
                self.store.set("fatal_done", str(code))
            else:
                try:
                    self.store.wait(["fatal_done"], _td(30))
                except Exception:
                    pass
        except BaseException as e:  # we exit either way; leave a trace
            print(f"launch watchdog: {e!r}", file=self.log, flush=True)
        finally:
            for f in (sys.stdout, sys.stderr, self.log):
                try:
                    f.flush()
                except Exception:
                    pass
            os._exit(code)

    def _dump(self, reason: str, item: Any) -> None:
        name = getattr(item, "nodeid", "(between tests)")
        print(f"\n===== launch: rank {self.rank}: {reason} during {name}; "
              "Python stacks of every thread: =====", file=self.log, flush=True)
        faulthandler.dump_traceback(file=self.log, all_threads=True)
        self.log.flush()

    def _report(self, key: str | None, item: Any, reason: str) -> str:
        """Rank 0: collect every rank's fatal info and say who was where."""
        keys = [f"fatal/{key}/{r}" for r in range(self.size)]
        end = time.monotonic() + (10 if "timed out" in reason else 5)
        while time.monotonic() < end and not self.store.check(keys):
            time.sleep(0.1)
        name = getattr(item, "nodeid", None)
        lines = [f"launch: {reason} during {name or 'no test (between tests)'}"]
        stuck: list[int] = []
        dead: list[int] = []
        finished: list[int] = []
        for r in range(self.size):
            if self.store.check([keys[r]]):
                info = json.loads(self.store.get(keys[r]))
                if info.get("phase") == "test":
                    stuck.append(r)
                    coll = f" in collective {info['collective']}" if info.get("collective") else ""
                    state = "stuck" if "timed out" in reason else "was running the test"
                    lines.append(f"  rank {r}: {state}{coll} at {info['user']}"
                                 f" (innermost frame: {info['innermost']})")
                elif info.get("phase") == "agree":
                    lines.append(f"  rank {r}: finished the test{self._outcome(key, r)}, "
                                 "waiting for the others")
                    finished.append(r)
                else:
                    lines.append(f"  rank {r}: between tests")
            else:
                alive = self._alive(r)
                dead.append(r)
                lines.append(f"  rank {r}: {'DIED' if alive is False else 'no answer (dead or wedged)'}"
                             f" during {name or 'the run'}")
        if stuck and "timed out" in reason:
            lines.insert(1, f"stuck ranks: {', '.join(map(str, stuck))}")
        if dead:
            lines.insert(1, f"dead ranks: {', '.join(map(str, dead))}")
        for r in finished:
            text = self._outcome(key, r, full=True)
            if text:
                lines.append(f"{'-' * 20} rank {r} failed first {'-' * 20}\n{text}")
        lines.append("Python stacks of every rank are in the per-rank logs.")
        return "\n".join(lines)

    def _outcome(self, key: str | None, r: int, full: bool = False) -> str:
        """Rank r's posted verdict for the test: ' (failed)' or its traceback."""
        k = f"o/{key}/{r}"
        if not self.store.check([k]):
            return ""
        v = self.store.get(k).decode()
        if v in ("P", "-"):
            return "" if full else (" (passed)" if v == "P" else "")
        kind, _, text = json.loads(v)
        if full:
            return text if kind == "failed" else ""
        return f" ({kind})"

    def _alive(self, r: int) -> bool | None:
        if not self.store.check([f"pid/{r}"]):
            return None
        host, pid = self.store.get(f"pid/{r}").decode().rsplit(":", 1)
        if host != socket.gethostname():
            return None
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ", 1)[1][0] not in "ZX"
        except (OSError, IndexError):
            return False


def _td(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)
