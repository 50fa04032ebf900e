"""Debug switch and invariant errors.

Expensive consistency checks (full pool scans, per-row uniqueness, plan validation) run only when
``VTOKEN_DEBUG=1`` is set in the environment or a component is built with ``debug=True``.

Error convention used across the runtime:
  * out of capacity (no free blocks)      -> the call returns ``None`` (the scheduler preempts)
  * caller misuse (unknown request, ...)  -> ``ValueError`` with a message naming the request
  * a broken invariant (a bug in here)    -> ``InvariantError`` (a ``RuntimeError``) whose message
                                            starts with the invariant's name, e.g. "I2 violated: ..."
"""

from __future__ import annotations

import os

INVARIANTS = {
    "I1": "token conservation: every live token's K/V bytes and stats survive moves",
    "I2": "unique mapping: no two live tokens share a slot (per row)",
    "I3": "pre-attention visibility: every move lands before the next attention",
    "I4": "a committed plan strictly reduces held blocks or fills holes, and never overlaps an in-flight plan",
    "POOL": "pool conservation: free + held == total, no leaked or double-freed block",
    "PINS": "pinned tokens are never evicted",
}


class InvariantError(RuntimeError):
    """A vToken invariant does not hold. Always a bug in the runtime, never caller misuse."""

    def __init__(self, invariant: str, detail: str) -> None:
        self.invariant = invariant
        super().__init__(f"{invariant} violated: {detail} [{INVARIANTS.get(invariant, '')}]")


def debug_enabled(flag: bool | None = None) -> bool:
    """``flag`` wins when given; otherwise ``VTOKEN_DEBUG`` in {1, true, yes, on} turns checks on."""
    if flag is not None:
        return bool(flag)
    return os.environ.get("VTOKEN_DEBUG", "0").strip().lower() in ("1", "true", "yes", "on")


def check(cond: bool, invariant: str, detail: str) -> None:
    """Raise :class:`InvariantError` for ``invariant`` unless ``cond``."""
    if not cond:
        raise InvariantError(invariant, detail)
