"""Per-rank hang watchdog and termination handler.

One daemon thread per rank. The main thread arms it around each test
(``arm`` -> ``agreeing`` -> ``disarm``, a few attribute writes). The thread
fires when

- the test (or the wait for the peers' verdicts) outlives its timeout;
- a peer has failed the test and this rank has sat in a collective for
  ``PEER_GRACE`` seconds: a collective the failed peer will never enter (a rank
  that raised before an ``all_reduce`` its peers are in);
- the process gets SIGTERM (torchrun sends it to the survivors when a rank
  dies), or a peer's process on this host is gone (a rank that exited with
  status 0 mid-test, which torchrun does not act on);
- a peer's watchdog fired for the same test (the ``fire/<test>`` key).

A watchdog whose test has run for ``POLL`` seconds checks those store keys (and
whether its peers' processes live) every ``POLL`` seconds; a quick test costs no
store traffic beyond its verdict. When it fires, every rank dumps its Python
stacks to its log and posts where its test thread is; rank 0 waits briefly for
the others (not for dead ones), names the stuck and dead ranks, hands the
report to the mode's ``on_fatal`` callback, and all ranks exit.

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
    "wait_tensor",
}
POLL = 0.5  # seconds between an armed watchdog's store checks (tests that run longer)
PEER_GRACE = 3.0  # seconds a rank may sit in a collective after a peer failed the test


def where(frame: Any) -> dict[str, str]:
    """Innermost frame of a thread, its innermost frame outside torch, and the
    innermost torch.distributed collective on its stack."""
    while frame.f_back is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back  # our SIGTERM handler, run on top of the interrupted frame
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
        self._armed_at = 0.0
        self._deadline = float("inf")
        self._timeout = 0.0
        self._phase = "idle"  # idle | test | agree
        self._pids: dict[int, str | None] = {}  # rank -> pid on this host (None: elsewhere)
        self.fired = False
        # ``pending() -> (key, item) | None``: the test this rank runs next, for
        # a fault while it is between tests (server mode: a peer may already
        # be in that test, so the fault belongs to it, not to "no test").
        self.pending: Callable[[], tuple[str, Any] | None] | None = None
        # Set before on_fatal runs: the world was stopped from outside (SIGINT,
        # or SIGTERM while every rank still lives), not broken by a fault.
        self.interrupted: str | None = None
        self._main = threading.main_thread().ident
        self._rsock, self._wsock = socket.socketpair()
        self._rsock.setblocking(False)
        self._wsock.setblocking(False)

    def start(self) -> None:
        """Install the SIGTERM handler (main thread only) and start the thread."""
        if threading.current_thread() is threading.main_thread():
            # NOTE: torchrun forwards the signal it got (Ctrl-C: SIGINT) to its
            # workers' process groups; both only wake this thread, which stops
            # every rank together (a KeyboardInterrupt mid-collective would not).
            faulthandler.unregister(signal.SIGTERM)  # a start-up dump handler, if any
            signal.signal(signal.SIGTERM, lambda *_: None)
            signal.signal(signal.SIGINT, lambda *_: None)
            signal.set_wakeup_fd(self._wsock.fileno(), warn_on_full_buffer=False)
        self.store.set(f"pid/{self.rank}", f"{socket.gethostname()}:{os.getpid()}")
        self.store.set(f"node/{self.rank}", f"node {os.environ.get('GROUP_RANK', '0')} "
                                            f"(host {socket.gethostname()})")
        threading.Thread(target=self._run, name="launch-watchdog", daemon=True).start()

    def arm(self, key: str, item: Any, timeout: float) -> None:
        now = time.monotonic()
        with self._lock:
            self._key, self._item, self._timeout = key, item, timeout
            self._phase, self._armed_at, self._deadline = "test", now, now + timeout

    def agreeing(self) -> None:
        """The test is over here; the rank waits for its peers' verdicts."""
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

        next_poll = 0.0
        in_coll: tuple[str | None, float] = (None, 0.0)  # (key, since) blocked in a collective
        while True:
            with self._lock:
                key, phase, deadline, armed = self._key, self._phase, self._deadline, self._armed_at
            now = time.monotonic()
            wait = POLL if phase == "idle" else max(0.0, min(deadline - now, POLL))
            r, _, _ = select.select([self._rsock], [], [], wait)
            if r:
                try:
                    sigs = self._rsock.recv(64)
                except BlockingIOError:
                    sigs = b""
                if signal.SIGINT in sigs:
                    self._fire("interrupted (SIGINT: the run was stopped)", None, "signal")
                elif signal.SIGTERM in sigs:
                    self._fire("terminated (SIGTERM: a peer rank died or the launcher "
                               "stopped the world)", None, "signal")
                continue
            if phase == "idle" or key is None:
                continue
            now = time.monotonic()
            if now - armed >= POLL and now >= next_poll:
                next_poll = now + POLL
                try:
                    echo = self._check(f"fire/{key}")
                    if echo is not None:
                        reason, kind = json.loads(echo)
                        self._fire(reason, key, kind)
                        continue
                    gone = self._dead_peer()
                    if gone is not None:  # e.g. os._exit(0): torchrun does not react
                        self._fire(f"rank {gone} died (its process is gone)", key, "dead")
                        continue
                    peer = self._check(f"failed/{key}") if phase == "test" else None
                except Exception:  # the store went away: the world is going down
                    peer = None
                coll = self._collective() if peer is not None else ""
                if not coll:
                    in_coll = (None, 0.0)
                elif in_coll[0] != key:
                    in_coll = (key, now)
                elif now - in_coll[1] >= PEER_GRACE:
                    self._fire(f"rank {self.rank} was stuck in {coll} for "
                               f"{now - in_coll[1]:.0f} s after rank {peer} failed", key, "peer")
            if now >= deadline:
                self._fire(f"timed out after {self._timeout:g} s", key, "timeout")

    def _check(self, k: str) -> str | None:
        return self.store.get(k).decode() if self.store.check([k]) else None

    def _collective(self) -> str:
        frame = sys._current_frames().get(self._main)
        return where(frame)["collective"] if frame is not None else ""

    def _fire(self, reason: str, expect: str | None, kind: str) -> None:
        """Dump stacks, post where this rank is, tell the peers; rank 0 reports.

        ``expect`` is the test key the caller saw (None for a signal): a test
        that finished meanwhile is not fired on."""
        with self._lock:
            if self.fired or (kind != "signal" and (self._key != expect or self._phase == "idle")):
                return
            self.fired = True
            key, item, phase = self._key if self._phase != "idle" else None, self._item, self._phase
            ran = time.monotonic() - self._armed_at
        code = 1
        try:
            if key is None and self.pending is not None:
                nxt = self.pending()
                if nxt is not None:
                    (key, item), ran = nxt, None
            frame = sys._current_frames().get(self._main)
            info = where(frame) if frame is not None else {}
            info.update(phase=phase, reason=reason)
            self._dump(reason, item)
            self.store.set(f"fatal/{key}/{self.rank}", json.dumps(info))
            if key is not None and kind != "signal":
                self.store.compare_set(f"fire/{key}", "", json.dumps([reason, kind]))
            if self.rank == 0:
                text = self._report(key, item, reason, kind, ran if key is not None else None)
                code = self.on_fatal(key, item, text)
                self.store.set("fatal_done", str(code))
            else:
                try:
                    self.store.wait(["fatal_done"], _td(30))
                except Exception:
                    pass
        except BaseException as e:  # we exit either way; leave a trace
            import traceback

            print(f"launch watchdog: {e!r}\n{traceback.format_exc()}", file=self.log, flush=True)
            if self.rank == 0:  # release the peers now, not after their 30 s wait
                try:
                    self.store.set("fatal_done", str(code))
                except Exception:
                    pass
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

    def _report(self, key: str | None, item: Any, reason: str, kind: str,
                ran: float | None) -> str:
        """Rank 0: collect every rank's fatal info and say who was where."""
        keys = [f"fatal/{key}/{r}" for r in range(self.size)]
        end = time.monotonic() + (5 if kind == "signal" else 10)
        waiting = list(range(self.size))
        while waiting and time.monotonic() < end:  # for each rank's post, or its death
            waiting = [r for r in waiting
                       if not self.store.check([keys[r]]) and self._alive(r) is not False]
            if waiting:
                time.sleep(0.05)
        name = getattr(item, "nodeid", None)
        during = f"during {name} ({ran:.1f} s into the test)" if name and ran is not None \
            else f"during {name or 'no test (between tests)'}"
        lines = [f"launch: {reason} {during}"]
        stuck: list[int] = []
        dead: list[int] = []
        finished: list[int] = []
        for r in range(self.size):
            if self.store.check([keys[r]]):
                info = json.loads(self.store.get(keys[r]))
                if info.get("phase") == "test":
                    stuck.append(r)
                    coll = f" in collective {info['collective']}" if info.get("collective") else ""
                    state = "was running the test" if kind == "signal" else "stuck"
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
        if kind == "signal" and not dead:
            # Every rank lives and posted: torchrun itself was stopped (SIGTERM
            # or Ctrl-C of the run), no fault of the test.
            self.interrupted = "SIGINT" if reason.startswith("interrupted") else "SIGTERM"
        if stuck and kind != "signal":
            lines.insert(1, f"stuck ranks: {', '.join(map(str, stuck))}")
        if dead:
            lines.insert(1, f"dead ranks: {', '.join(map(str, dead))}{self._nodes(dead)}")
        for r in finished:
            text = self._outcome(key, r, full=True)
            if text:
                how = "failed (a peer died)" if dead else "failed first"
                lines.append(f"{'-' * 20} rank {r} {how} {'-' * 20}\n{text}")
        lines.append("Python stacks of every rank are in the per-rank logs.")
        return "\n".join(lines)

    def _nodes(self, dead: list[int]) -> str:
        """Where the dead ranks ran, when the world spans several nodes:
        ' on node 1 (host h): all its ranks'."""
        try:
            where = {r: self.store.get(f"node/{r}").decode() for r in range(self.size)}
        except Exception:
            return ""
        if len(set(where.values())) < 2:
            return ""
        parts = []
        for node in sorted({where[r] for r in dead}):
            on = [r for r in range(self.size) if where[r] == node]
            whole = all(r in dead for r in on)
            parts.append(f"{node}{': the whole node died' if whole else ''}")
        return " on " + "; ".join(parts)

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
        """Whether rank r's process lives; None when unknown (another host)."""
        if r not in self._pids:
            if not self.store.check([f"pid/{r}"]):
                return None
            host, pid = self.store.get(f"pid/{r}").decode().rsplit(":", 1)
            self._pids[r] = pid if host == socket.gethostname() else None
        pid = self._pids[r]
        if pid is None:
            return None
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ", 1)[1][0] not in "ZX"
        except (OSError, IndexError):
            return False

    def _dead_peer(self) -> int | None:
        """A peer rank on this host whose process is gone, if any."""
        for r in range(self.size):
            if r != self.rank and self._alive(r) is False:
                return r
        return None


def _td(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)
