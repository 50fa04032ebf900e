"""Give the worker's freed heap back to the OS: glibc ``malloc_trim(0)`` at most every ``interval_s`` seconds,
at a step where a request finished.

Why (measured, docs/vllm.md "Soak"): a vLLM CPU worker's resident memory climbs with the mix of shapes it
serves, plugin or not. Torch's CPU allocator takes activations from glibc; glibc's dynamic mmap threshold
rises to the largest chunk freed so far, after which large activations of every new size come from the heap
and leave free holes that ``free`` never returns (only the top of the heap is trimmed). On SmolLM2, float32,
eager, 8 prompts of 256-768 tokens a round, vanilla vLLM grew 2,125 -> 2,389 MB over 15 rounds, and one
``malloc_trim(0)`` gave back 60-90 MB in 3-5 ms (it hands back every free page inside the heap with ``madvise``,
not only the top). Trimming is not a fix of a leak: nothing is held that is still referenced; it keeps RSS at
the working set.

Not glibc (musl, macOS): a no-op. ``VTOKEN_MALLOC_TRIM_S`` sets the interval; ``0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from collections.abc import Callable

DEFAULT_INTERVAL_S = 10.0
ENV = "VTOKEN_MALLOC_TRIM_S"


def _glibc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` or None (another libc, or it cannot be loaded)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it: AttributeError elsewhere)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def interval_from_env(default: float = DEFAULT_INTERVAL_S) -> float:
    """``VTOKEN_MALLOC_TRIM_S`` as seconds (>= 0); ValueError naming the variable for anything else."""
    raw = os.environ.get(ENV)
    if raw is None or raw.strip() == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not v >= 0:  # not a number, NaN or negative
        raise ValueError(f"vtoken: {ENV}={raw!r}: expected seconds (a number >= 0; 0 turns trimming off)")
    return v


class HeapTrimmer:
    """``maybe_trim(finished)`` trims when ``finished`` and ``interval_s`` has passed since the last trim.

    ``trims`` and ``seconds`` count what it did (the runner's ``vtoken_counters``)."""

    def __init__(self, interval_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[int], int] | None | bool = True) -> None:
        self.interval_s = interval_from_env() if interval_s is None else float(interval_s)
        if self.interval_s < 0:
            raise ValueError(f"vtoken: heap trim interval {self.interval_s} s; expected >= 0")
        self._clock = clock
        self._trim = _glibc_trim() if trim is True else (trim or None)
        self._last = clock()
        self.trims = 0
        self.seconds = 0.0

    @property
    def enabled(self) -> bool:
        return self._trim is not None and self.interval_s > 0

    def maybe_trim(self, finished: bool) -> bool:
        """Trim now if a request finished and the interval has passed; True when it trimmed."""
        if not finished or not self.enabled:
            return False
        now = self._clock()
        if now - self._last < self.interval_s:
            return False
        t0 = time.perf_counter()
        self._trim(0)  # type: ignore[misc]
        self.seconds += time.perf_counter() - t0
        self.trims += 1
        self._last = now
        return True
