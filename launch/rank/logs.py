"""What a rank's log says: the last lines of a log, and how far a rank got.

The parent quotes these when a world it launched dies or hangs.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["rank_story", "tail"]


def tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of ``path``, without Python traceback frames
    and warnings (torchrun's own tracebacks are long and say little)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    keep = [ln for ln in text if not ln.startswith(("  File ", "    ", "  cpu = "))
            and "Warning:" not in ln]
    return "\n".join(keep[-lines:]) or "(empty)"


_NOISE = ("/_pytest/", "/pluggy/", "<frozen ", "/launch/")


def rank_story(path: Path, stderr: list[Path]) -> str:
    """How far a rank got, from its log: its last ``launch:`` line, and the
    last stack dump's header and innermost frames outside pytest (faulthandler
    writes them on a crash, an abort or torchrun's SIGTERM)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        text = []
    out = [ln for ln in text if ln.startswith("launch: ")][-1:]
    heads = [i for i, ln in enumerate(text) if "(most recent call first)" in ln]
    if heads:
        i = heads[0] if len(heads) == 1 else next(
            (h for h in heads if text[h].startswith("Current thread")), heads[-1])
        fatal = [ln for ln in text[:i] if ln.startswith(("Fatal Python error", "====="))]
        out += fatal[-1:] + [text[i]]
        frames = []
        for ln in text[i + 1:]:
            if not ln.startswith("  File "):
                break
            if not any(n in ln for n in _NOISE):
                frames.append(ln)
        out += frames[:6]
    for err in stderr:
        last = tail(err, 6)
        if last != "(empty)":
            out.append(f"stderr ({err}):\n{last}")
    return "\n".join(out) or "(empty log: the rank never got to pytest's configure)"
