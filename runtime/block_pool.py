"""Block pool: a fixed number of KV blocks handed out as integer ids (bookkeeping only, no tensors).

    pool (num_blocks = 8)
    ids        0   1   2   3   4   5   6   7
    refcount  [1] [1] [0] [2] [0] [1] [0] [0]
    free queue  -> 2 4 6 7 ->           (allocate pops the left end, free appends at the right)

Allocation is all-or-nothing and returns ``None`` when the pool cannot satisfy it: the caller
(the scheduler) preempts. A request frees its blocks tail first (``free(blocks)`` walks the list in
reverse), so the blocks that held the most recent tokens re-enter the queue first. When another
allocator chose the blocks (vLLM's, for the cache inside vLLM), :meth:`BlockPool.take` takes those
exact free blocks. The free queue is an insertion-ordered set: pop, append and taking a named block
are O(1) each.

POOL invariant (checked by :meth:`BlockPool.check` in debug mode):
    free + held == total; a block is on the free queue iff its refcount is 0.
Freeing a block whose refcount is already 0 is caller misuse (double free) -> ``ValueError``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from ._debug import InvariantError, check, debug_enabled


class BlockPool:
    """Free list plus reference counts over ``num_blocks`` block ids ``0..num_blocks-1``."""

    def __init__(self, num_blocks: int, debug: bool | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self.debug = debug_enabled(debug)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))
        self._ref = np.zeros(self.num_blocks, dtype=np.int32)

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block_id: int) -> int:
        self._validate_ids([block_id])
        return int(self._ref[block_id])

    # ------------------------------------------------------------------ mutation
    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks (refcount 0 -> 1). ``None`` if fewer than ``n`` are free (nothing taken)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            return None
        out = [self._free.popitem(last=False)[0] for _ in range(n)]
        self._ref[out] += 1
        if self.debug:
            self.check()
        return out

    def incref(self, blocks: Iterable[int]) -> None:
        """Share already-allocated blocks (e.g. a fork); each needs a matching :meth:`free`."""
        ids = list(blocks)
        self._validate_ids(ids)
        if ids and (self._ref[ids] <= 0).any():
            raise ValueError(f"incref of a free block: {[b for b in ids if self._ref[b] <= 0]}")
        np.add.at(self._ref, ids, 1)

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block, walking ``blocks`` tail first; refcount 0 -> free queue.

        Raises ``ValueError`` on a double free (refcount already 0) before changing anything.
        """
        ids = list(blocks)
        if not ids:
            return
        self._validate_ids(ids)
        counts = np.bincount(np.asarray(ids, dtype=np.int64), minlength=self.num_blocks)
        bad = np.nonzero(counts > self._ref)[0]
        if bad.size:
            raise ValueError(f"double free: block(s) {bad.tolist()} freed more often than allocated")
        for b in reversed(ids):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
        if self.debug:
            self.check()

    def take(self, blocks: Sequence[int]) -> None:
        """Take these free blocks (refcount 0 -> 1), chosen by another allocator (vLLM's, for the cache inside
        vLLM). O(1) per block. A block that is not free means the two allocators disagree: ``InvariantError``
        (POOL), raised before anything is taken."""
        ids = [int(b) for b in blocks]
        self._validate_ids(ids)
        if len(set(ids)) != len(ids) or any(b not in self._free for b in ids):
            held = sorted({b for b in ids if b not in self._free})
            raise InvariantError("POOL", f"block(s) {held or ids} are not free here (still held, or named twice): "
                                         "the external allocator and this pool disagree")
        for b in ids:
            del self._free[b]
        self._ref[ids] += 1
        if self.debug:
            self.check()

    # ------------------------------------------------------------------ invariants
    def check(self, held: Iterable[int] | None = None) -> None:
        """POOL invariant. With ``held`` (every block id the owners believe they hold, one entry per
        reference) also cross-checks owners against refcounts: a mismatch is a leak or a double owner."""
        free = np.fromiter(self._free, dtype=np.int64, count=len(self._free))
        check(bool((self._ref >= 0).all()), "POOL", "negative refcount")
        on_queue = np.zeros(self.num_blocks, dtype=bool)
        on_queue[free] = True
        check(bool(((self._ref == 0) == on_queue).all()), "POOL",
              "free queue and refcounts disagree (a block is free and referenced, or neither)")
        check(free.size + int((self._ref > 0).sum()) == self.num_blocks, "POOL", "free + held != total")
        if held is not None:
            h = np.fromiter(held, dtype=np.int64)
            owners = np.bincount(h, minlength=self.num_blocks) if h.size else np.zeros(self.num_blocks, np.int64)
            diff = np.nonzero(owners != self._ref)[0]
            check(diff.size == 0, "POOL",
                  f"owners and refcounts disagree for block(s) {diff[:8].tolist()} (leak or double owner)")

    def _validate_ids(self, ids: Sequence[int]) -> None:
        for b in ids:
            if not (0 <= int(b) < self.num_blocks):
                raise ValueError(f"block id {b} out of range [0, {self.num_blocks})")
