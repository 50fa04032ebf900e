"""Debug switch and invariant errors.

Expensive consistency checks (full pool scans, per-row uniqueness, plan validation) run only when
``VTOKEN_DEBUG=1`` is set in the environment or a component is built with ``debug=True``.

Error convention used across the runtime:
  * out of capacity (no free blocks)      -> the call returns ``None`` (the scheduler preempts)
  * caller misuse (unknown request, ...)  -> ``ValueError`` with a message naming the request
  * a broken invariant (a bug in here)    -> ``InvariantError`` (a ``RuntimeError``) whose message
                                            starts with the invariant's name, e.g. "I2 violated: ..."

:func:`runtime_fault` tells these runtime faults (and device errors) from errors of user code: the eviction
driver isolates the second kind per request and lets the first propagate.
"""

from __future__ import annotations

import os

import torch

INVARIANTS = {
    "I1": "token conservation: every live token's K/V bytes and stats survive moves",
    "I2": "unique mapping: no two live tokens share a slot (per row)",
    "I3": "pre-attention visibility: every move lands before the next attention",
    "I4": "a committed plan strictly reduces held blocks or fills holes, and never overlaps an in-flight plan",
    "POOL": "pool conservation: free + held == total, no leaked or double-freed block",
    "PINS": "pinned tokens are never evicted",
    "ROWS": "vLLM's block list of a request in per-row pages is exactly the blocks its page table holds",
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


# messages of device errors torch raises as a plain RuntimeError (older builds, CUDA libraries, Triton launches)
_DEVICE_ERROR_MARKS = ("CUDA error", "CUDA out of memory", "device-side assert", "CUBLAS_STATUS", "CUDNN_STATUS",
                       "cuDNN error", "HIP error", "NCCL error", "Triton Error [CUDA]")


def runtime_fault(e: BaseException) -> BaseException | None:
    """The error no policy code causes and no fallback repairs, found in ``e`` or the errors it was raised
    from (a policy wrapper re-raises what the policy hit ``from`` it), or None: a broken invariant
    (:class:`InvariantError`), out of memory (host or device), a device error (``torch.AcceleratorError``, or
    a ``RuntimeError`` carrying a CUDA / HIP / NCCL error). After one the state of the cache or the device
    cannot be trusted, so the caller re-raises it instead of failing one request."""
    accel = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, (InvariantError, MemoryError, torch.OutOfMemoryError)) or \
                (accel is not None and isinstance(cur, accel)) or \
                (isinstance(cur, RuntimeError) and any(m in str(cur) for m in _DEVICE_ERROR_MARKS)):
            return cur
        cur = cur.__cause__ if cur.__cause__ is not None else cur.__context__
    return None


def reraise_runtime_fault(e: BaseException) -> None:
    """Re-raise :func:`runtime_fault` of ``e`` if there is one (``e`` itself as it is; one it wraps as itself,
    without the policy's wrapper); return otherwise, leaving ``e`` to the caller's per-request fallback."""
    fault = runtime_fault(e)
    if fault is e:
        raise e
    if fault is not None:
        raise fault from None
