"""The error ``fully_shard`` raises for bad input or an option it does not have."""

from __future__ import annotations

__all__ = ["FSDPError"]


class FSDPError(ValueError):
    """Bad input to ``fully_shard`` or an ``FSDPModule`` method: what was
    expected, what was given, and the fix. Raised on every rank alike, before
    any collective (the checks read only what every rank has)."""
