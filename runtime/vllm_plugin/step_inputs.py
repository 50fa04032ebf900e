"""The one rewrite of vLLM's step inputs: new tokens go to the token table's slots, lengths become cache lengths.

vLLM builds a step's inputs from TRUE positions (RoPE, stop checks and sampling stay untouched). After
that, and before any attention metadata is built, the runner calls :func:`place_new_tokens`, which for
every scheduled request reserves its new tokens in the :class:`~vtoken_runtime.cache.VTokenCache` (the
block ids come from the tail of the request's vLLM block-table row) and returns the slot of every new
token and the cache length of every request::

    vLLM row  [b0 b1 b2 b3 ...]        seq_len = cache_len + n   (cache_len: live tokens after compaction; n new)
    slot of new token i = row[(cache_len + i) // bs] * bs + (cache_len + i) % bs

The runner then writes these, in place, into vLLM's persistent buffers (CPU and GPU alike):

    slot_mapping      its numpy view, then the copy to the device (after vLLM's own computation)
    seq_lens          the device tensor the attention kernels read (non-blocking copy from pinned memory)
    optimistic_seq_lens_cpu   the host upper bound behind ``max_seq_len`` (FlashInfer treats it as exact)

Block-table rows need no rewrite: a request's cache blocks ARE the head of its vLLM row (compaction
frees tail blocks; the scheduler's block manager frees the same ones and the next scheduler output gives
the runner the truncated row), and vLLM commits the rows to the device at the start of every step. The causal alignment of a chunk is ``seq_len - query_len`` as before; the
cached prefix may be in any order (RoPE was applied before caching).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def place_new_tokens(cache: Any, pool: Any, req_ids: Sequence[str], num_scheduled: np.ndarray,
                     num_computed: np.ndarray, block_rows: np.ndarray, blocks_per_row: np.ndarray,
                     query_start_loc: np.ndarray, slot_mapping: np.ndarray,
                     on_new: Callable[[str], None], rows: Any = None, cached_prefix: bool = False) -> np.ndarray:
    """Reserve the step's new tokens; write their slots into ``slot_mapping`` (flat token order).

    ``num_scheduled [B]`` / ``num_computed [B]`` (true positions before the step), ``block_rows
    [B, max_blocks]`` and ``blocks_per_row [B]`` (vLLM's block table, host side), ``query_start_loc
    [B + 1]``. ``pool`` is the cache's :class:`ExternalPool` (fed the row's tail before each reserve);
    ``on_new(req_id)`` registers a request seen for the first time. Returns the cache lengths ``[B]``
    int32. A request whose token-table length differs from vLLM's computed count was reset behind our
    back (recompute after preemption) and starts again.

    ``rows``: the worker's :class:`~.rows.VllmRowCache` (requests with unequal row budgets, in pages). Their
    new tokens are reserved there (every row, fed from the same block-table row); their slots in
    ``slot_mapping`` are ``-1`` (vLLM's write skips them; the row path writes them) and their returned length
    is the step's query count (what vLLM's stock metadata needs; the row path does not read it).

    ``cached_prefix`` (prefix caching on): a request first seen at ``start > 0`` starts with ``start`` tokens
    from vLLM's prefix cache, its first ``start / block_size`` blocks. They enter the token table in place
    (position ``p`` at slot ``p % block_size`` of block ``p // block_size``; nothing is written) with zeroed
    statistics; the worker freezes them before any eviction (:mod:`.prefix`).
    """
    seq = np.zeros(len(req_ids), dtype=np.int32)
    for i, rid in enumerate(req_ids):
        n, start = int(num_scheduled[i]), int(num_computed[i])
        if rows is not None and rid in rows:
            if rows.logical_len(rid) == start:
                pool.feed(block_rows[i, rows.held_blocks(rid):int(blocks_per_row[i])])
                rows.reserve_fed(rid, n)
                slot_mapping[query_start_loc[i]:query_start_loc[i + 1]] = -1
                seq[i] = n
                continue
            rows.free(rid)  # reset behind our back: starts again in the token table
        known = cache.has_request(rid)
        if known and cache.logical_len(rid) != start:
            cache.free(rid)
            known = False
        if not known:
            bs = cache.block_size
            if start != 0 and (not cached_prefix or start % bs):
                raise RuntimeError(f"vtoken: request {rid} starts at position {start} without a token-table "
                                   "entry (not a prefix-cache hit of whole blocks; KV transfer is not supported)")
            on_new(rid)
            if start:  # prefix-cache hit: the shared blocks, in place
                pool.feed(block_rows[i, :start // bs], shared=True)
                hit = cache.reserve(rid, start)
                p = np.arange(start)
                if hit is None or not np.array_equal(hit, block_rows[i, p // bs].astype(np.int64) * bs + p % bs):
                    raise RuntimeError(f"vtoken: request {rid}: its {start} cached tokens did not land in place")
        pool.feed(block_rows[i, cache.held_blocks(rid):int(blocks_per_row[i])])
        slots = cache.reserve(rid, n)
        if slots is None:  # ExternalPool raises instead; kept for clarity
            raise RuntimeError(f"vtoken: no blocks for request {rid}")
        slot_mapping[query_start_loc[i]:query_start_loc[i + 1]] = slots
        seq[i] = cache.cache_len(rid)
    return seq


def true_positions(num_computed: np.ndarray, num_scheduled: np.ndarray) -> np.ndarray:
    """Flat true positions of the step's tokens (what vLLM computed on the device), from host data only."""
    n = np.asarray(num_scheduled, dtype=np.int64)
    starts = np.repeat(np.asarray(num_computed, dtype=np.int64) - np.cumsum(n) + n, n)
    return starts + np.arange(int(n.sum()), dtype=np.int64)
