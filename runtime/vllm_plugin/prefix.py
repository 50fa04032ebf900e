"""Prefix caching under eviction: the one rule both sides apply (no vLLM import).

vLLM offers a request's full blocks to its prefix cache (``cache_blocks``: the block's hash is its token
prefix, so any later request with that prefix reuses the block). Under eviction a block may be offered only
if its K/V is what a request without eviction would have computed and will stay so:

* its tokens were computed before the request's first eviction (full context), and none of them is ever
  evicted or moved.

So the scheduler offers a block only once the worker has had its chance to evict in it (one step after it was
computed: the block's tokens were *computed before* the oldest step whose output has not arrived; with
asynchronous scheduling or pipeline parallelism the scheduler counts the tokens of the steps in flight in
``num_computed_tokens`` and leaves them out here) and only below the request's
first evicted position (``intact``, reported with every :class:`~.report.Truncation`); and the worker freezes
what may have been offered before it evicts (pins it). Both use :func:`frozen_tokens` on the same two
numbers::

    position:  0          F                computed     true length
               |==========|-----------------|------------|
               frozen     evictable          this step's tokens (evictable: not offered yet)
               (cached, shared or offerable: pinned, so never evicted and never moved)

The budget is unchanged (it counts the frozen tokens as it counts every pin). So a repeated prompt that is
prefilled in one step keeps what its first run kept: that run kept everything below its first evicted
position at its first eviction, the repeat starts with (at most) that prefix frozen, and its other tokens'
statistics come from the same queries (a query attends only to earlier keys), as long as the policy's query
windows lie after the cache hit.

    F = floor(min(computed before the step, first evicted position) / block_size) x block_size

A cache hit makes ``computed before the first step`` the hit length, so the shared blocks are frozen from
the request's first step. Compaction never moves a token below the first evicted position (every mode keeps
the head in place), so frozen blocks are never a source or a destination.
"""

from __future__ import annotations

import numpy as np

NEVER = 1 << 62  # "no position evicted yet"


def frozen_tokens(computed: int, first_evicted: int, block_size: int) -> int:
    """Tokens of the frozen prefix (a whole number of blocks): what the scheduler may have offered to the
    prefix cache before a step that starts with ``computed`` tokens, the request's first evicted position
    being ``first_evicted`` (:data:`NEVER` if none)."""
    if computed < 0 or block_size < 1:
        raise ValueError(f"frozen_tokens: computed={computed}, block_size={block_size}")
    return min(int(computed), int(first_evicted)) // block_size * block_size


def first_evicted(positions: np.ndarray) -> int:
    """The first position missing from a request's live positions ``[R, n]`` (one row per (layer, KV head),
    ascending per row, as ``live_view`` gives them): the smallest ``p`` absent from some row. A row with none
    missing before ``n`` holds exactly ``0 .. n - 1`` and misses ``n``."""
    pos = np.asarray(positions).reshape(-1, np.shape(positions)[-1])
    if pos.shape[1] == 0:
        return 0
    bad = pos != np.arange(pos.shape[1])
    return int(np.where(bad.any(1), bad.argmax(1), pos.shape[1]).min())


def frozen_in_place(positions: np.ndarray, phys: np.ndarray, blocks: np.ndarray, frozen: int,
                    block_size: int) -> bool:
    """Debug check: every row holds positions ``0 .. frozen - 1`` first (``positions`` / ``phys [R, n]``,
    ascending), each at its own slot of the request's first blocks (``p % block_size`` of ``blocks[p //
    block_size]``): the frozen prefix was neither evicted nor moved."""
    if frozen == 0:
        return True
    p = np.arange(frozen)
    want = np.asarray(blocks, dtype=np.int64)[p // block_size] * block_size + p % block_size
    return (positions.shape[-1] >= frozen and bool((positions[..., :frozen] == p).all())
            and bool((phys[..., :frozen] == want).all()))
