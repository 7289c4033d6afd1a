"""One Hypothesis run (one ``@given`` call) of a multi-rank test on one rank.

Per run: the settings agreed by every rank before it starts, one seed for
every rank, the database read by rank 0 only, and after every example an
exchange over the store of a digest of the choices and of the drawn values,
then the agreed outcome. See ``launch.hypo.lockstep``
for how a run is started.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import traceback
from datetime import timedelta
from typing import Any

from launch.agree import LockstepDivergence, RankFailure, example_verdict, span
from launch.hypo.db import mirror_db_class as _mirror_db_class
from launch.hypo.engine import is_data, multi_process_settings

__all__ = ["LockstepDivergence", "RankFailure"]

RUN_NPROC_ENV = "LAUNCH_RUN_NPROC"  # ranks per node of the run (lockstep mode sets it)
LEFT = "LEFT:"  # store value: the rank that should have set this key left the test
SETTINGS = "settings"  # store keys SETTINGS/<rank>: each rank's settings of a run


# One Hypothesis run in lockstep ---------------------------------------------------------
class _Run:
    """One Hypothesis run (one ``@given`` call) of a multi-rank test on one rank."""

    def __init__(self, test_: _Test, index: int, fn: Any, wrapped_test: Any,
                 current: Any, stuff: Any) -> None:
        self.t, self.members, self.item = test_, test_.members, test_.item
        self.rank, self.index = test_.rank, index
        self.store = test_.run_store(index)
        self.timeout = timedelta(seconds=test_.timeout)
        self.name = getattr(fn, "__qualname__", repr(fn))
        self.wrapped_test = wrapped_test
        self.given = set(getattr(stuff, "given_kwargs", {}) or {})
        self.current = current
        db = _mirror_db_class()(current.database, self.store, self.rank, self.timeout,
                                self.read)
        self.settings = multi_process_settings(current, database=db)
        self.k = 0
        self.seed: int | None = None
        self.agree_on_settings(current, wrapped_test)

    def agree_on_settings(self, current: Any, wrapped_test: Any) -> None:
        """Every rank starts this run with the settings that steer Hypothesis'
        engine, or none does: ranks that differ would read the database or
        stop at different points and wait for each other until the timeout
        (an import of ``torch.testing._internal.common_utils`` on some ranks
        only loads PyTorch's own profile there, without a database)."""
        key = getattr(wrapped_test, "_hypothesis_internal_database_key", b"")
        mine = (f"max_examples={current.max_examples}, phases="
                f"{[p.name for p in current.phases]}, derandomize={current.derandomize}, "
                f"database={'none' if current.database is None else 'set'}, "
                f"database_key={'none' if key is None else 'set'}, "
                f"backend={getattr(current, 'backend', 'hypothesis')}")
        self.store.set(f"{SETTINGS}/{self.rank}", mine)
        keys = [f"{SETTINGS}/{r}" for r in self.members]
        got = dict(zip(self.members, (v.decode() for v in self.read(keys, "settings")),
                       strict=True))
        if len(set(got.values())) == 1:
            return
        by_value: dict[str, list[int]] = {}
        for r, v in got.items():
            by_value.setdefault(v, []).append(r)
        lines = "\n".join(f"  rank(s) {span(rs)}: {v}" for v, rs in by_value.items())
        raise LockstepDivergence(
            f"hypothesis lockstep: {self.item.nodeid}: the ranks start {self.name} with "
            f"different Hypothesis settings:\n{lines}\nEvery rank must run it with the "
            "same settings: load the profile on every rank (a profile a test loads is "
            "undone when the test ends), or pass settings to this run explicitly "
            "(@settings, or find(..., settings=...)).")

    def shared_random(self, random: Any) -> Any:
        """Hypothesis' Random for this run, the same on every rank."""
        from random import Random

        from hypothesis import core

        wt = self.wrapped_test
        if getattr(wt, "_hypothesis_internal_use_seed", None) is not None \
                or self.current.derandomize:
            return random  # from @seed or the test's source digest: equal everywhere
        forced = getattr(core, "global_force_seed", None)
        if forced is not None:  # --hypothesis-seed, given to every rank alike
            self.seed = forced
            return random
        if self.rank == 0:
            self.store.set("seed", str(random.getrandbits(64)))
        self.seed = int(self.read(["seed"], "rank 0's seed")[0])
        wt._hypothesis_internal_use_generated_seed = self.seed  # hypothesis' @seed hint
        return Random(self.seed)

    def wrap(self, inner: Any) -> Any:
        @functools.wraps(inner)
        def lockstep_example(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            return self.example(inner, args, kwargs)

        return lockstep_example

    # -- one example -------------------------------------------------------------------
    def example(self, inner: Any, args: tuple, kwargs: dict) -> Any:
        from hypothesis.control import current_build_context
        from hypothesis.errors import Found, UnsatisfiedAssumption

        __tracebackhide__ = True
        draws = [f"{k}={v!r}"[:300] for k, v in sorted(kwargs.items())
                 if k in self.given and not is_data(v)]
        for v in kwargs.values():
            _record_draws(v, draws)
        outcome, err, control, result = "pass", "", None, None
        try:
            result = inner(*args, **kwargs)
        except UnsatisfiedAssumption:
            outcome = "reject"
        except Found as e:  # find()'s condition held: its signal, not a failure
            outcome, control = "found", e
        except Exception as e:
            outcome = "fail"
            tb = traceback.format_exception(type(e), e, e.__traceback__, limit=-4)
            err = "".join(tb)[-2500:]
        except BaseException as e:  # skip, exit, hypothesis control flow: re-raised
            outcome, control = "control", e
        try:  # NOTE: the choice sequence is exact; reprs may hide differences
            choices = repr(current_build_context().data.choices)
        except Exception:
            choices = repr(draws)
        # Both: choices catch what a repr abbreviates, reprs catch values that
        # took no choice (st.just of a rank-local value).
        digest = hashlib.sha1(f"{self.name}|{choices}|{draws}".encode()).hexdigest()
        slot = str(self.k)
        self.k += 1
        got = self.exchange(slot, {"h": digest, "o": outcome, "e": err,
                                   "d": [d[:300] for d in draws][:20]})
        self.check_same(got, slot)
        kind, ranks = example_verdict({r: got[r]["o"] for r in self.members})
        if kind == "diverged" and got[ranks[0]]["o"] == "found":
            raise LockstepDivergence(
                f"hypothesis lockstep: {self.item.nodeid}: the find() condition held "
                f"for example #{slot} of {self.name} on rank(s) {ranks} only "
                f"({'; '.join(draws) or 'no draws'}); a find() condition must not "
                f"depend on the rank. {self.replay_hint()}")
        if kind == "diverged":
            raise LockstepDivergence(
                f"hypothesis lockstep: {self.item.nodeid}: example #{slot} of {self.name} "
                f"stopped the test (skip/exit/interrupt) on rank(s) {ranks} only. "
                f"{self.replay_hint()}")
        if kind in ("control", "found"):
            raise control
        if kind == "failed":
            raise RankFailure(self.failure_text(got, ranks))
        if kind == "rejected":
            raise UnsatisfiedAssumption()
        return result

    def finish(self) -> None:
        """After the run: every rank must stop after the same example."""
        got = self.exchange(str(self.k), {"h": "END", "o": "end", "e": "", "d": []})
        self.check_same(got, str(self.k))

    # -- store exchange ----------------------------------------------------------------
    def exchange(self, slot: str, payload: dict) -> dict[int, dict]:
        self.store.set(f"{slot}/{self.rank}", json.dumps(payload))
        keys = [f"{slot}/{r}" for r in self.members]
        vals = self.read(keys, f"example #{slot}")
        if slot.isdigit() and int(slot) > 0:
            # Every rank has written this slot, so all have read the previous
            # one: drop our key of it (long fuzzing runs would fill the store).
            self.store.delete_key(f"{int(slot) - 1}/{self.rank}")
        return {r: json.loads(v) for r, v in zip(self.members, vals, strict=True)}

    def read(self, keys: list[str], what: str) -> list[bytes]:
        """The values of ``keys`` once every one is set. A ``LEFT`` value (its
        rank left the test) fails this rank at once, naming that rank; a key
        still missing after the lockstep timeout fails it too."""
        try:
            self.store.wait(keys, self.timeout)
        except Exception:
            missing = [k for k in keys if not self.store.check([k])]
            raise LockstepDivergence(
                f"hypothesis lockstep: {self.item.nodeid}: {what} of {self.name} "
                f"({', '.join(missing)}) did not report within "
                f"{self.timeout.total_seconds():.0f}s (rank {self.rank} is waiting). "
                f"{self.replay_hint()}") from None
        vals = self.store.multi_get(keys)
        gone = [json.loads(v[len(LEFT):]) for v in vals if v.startswith(LEFT.encode())]
        if gone:
            how = "; ".join(f"rank {g['rank']} after {g['runs']} Hypothesis run(s): "
                            f"{g['how']}" for g in gone)
            raise LockstepDivergence(
                f"hypothesis lockstep: rank(s) {[g['rank'] for g in gone]} left "
                f"{self.item.nodeid} while rank {self.rank} waits for their {what} of "
                f"{self.name} (Hypothesis run #{self.index} of the test; {how}). Every "
                "rank must make the same Hypothesis runs in the same order: neither a "
                "run nor an assertion between runs may depend on the rank. "
                f"{self.replay_hint()}")
        return vals

    def check_same(self, got: dict[int, dict], slot: str) -> None:
        first = self.members[0]
        ref = got[first]
        bad = [r for r in self.members if got[r]["h"] != ref["h"]]
        if not bad:
            return
        r = bad[0]
        a, b = ref["d"], got[r]["d"]
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))

        def at(d: list[str], who: int) -> str:
            if got[who]["h"] == "END":
                return "(no further example: the run ended)"
            return d[k] if k < len(d) else "(no such draw)"

        raise LockstepDivergence(
            f"hypothesis lockstep: {self.item.nodeid}: ranks diverged at example "
            f"#{slot} of {self.name}; first differing rank is {r}.\n"
            f"  first differing draw (#{k + 1}): rank {first}: {at(a, first)}\n"
            f"                          rank {r}: {at(b, r)}\n"
            f"  rank {first} drew: {'; '.join(a) or '(nothing)'}\n"
            f"  rank {r} drew: {'; '.join(b) or '(nothing)'}\n"
            "Examples must not depend on the rank: draw from strategies only, never "
            "from rank-local state, and call the same @given functions in the same "
            f"order on every rank. {self.replay_hint()}")

    def failure_text(self, got: dict[int, dict], failed: list[int]) -> str:
        lines = [f"example failed on rank(s) {failed} of {list(self.members)}: "
                 f"{'; '.join(got[failed[0]]['d'])}"]
        same: dict[str, list[int]] = {}  # one block per distinct traceback
        for r in failed:
            same.setdefault(got[r]["e"].rstrip(), []).append(r)
        for text, rs in same.items():
            who = f"rank {rs[0]}" if len(rs) == 1 else f"ranks {span(rs)}, same error"
            lines.append(f"----- {who} -----\n{text}")
        lines.append(self.replay_hint())
        return "\n".join(lines)

    def replay_hint(self) -> str:
        import torch.distributed as dist

        config = self.item.config
        extra = [w for ws in config.hook.pytest_lockstep_replay_args(config=config) for w in ws]
        env = [w for w in extra if "=" in w and not w.startswith("-")]
        nproc = os.environ.get(RUN_NPROC_ENV) or str(dist.get_world_size())
        from hypothesis import settings

        cmd = [*env, "torchrun", f"--nproc_per_node={nproc}", "-m", "pytest",
               "-p", "launch.hypo.profiles", f"'{self.item.nodeid}'",
               f"--hypothesis-profile={settings._current_profile or 'default'}"]
        if self.seed is not None:
            cmd.append(f"--hypothesis-seed={self.seed}")
        cmd += [w for w in extra if w not in env]
        return "Replay: " + " ".join(cmd)


def _record_draws(v: Any, out: list[str]) -> None:
    """Record the repr of every ``data.draw`` of an ``st.data()`` argument."""
    if not is_data(v):
        return
    draw = v.draw

    def recording_draw(strategy: Any, label: Any = None) -> Any:
        value = draw(strategy, label)
        out.append(f"draw {len(out) + 1}: {value!r}"[:300])
        return value

    v.draw = recording_draw
