"""Token table: per request, which true position sits in which virtual slot of which row.

Rows: R = 1 at ``"request"`` granularity; R = num_layers * num_kv_heads at ``"head"`` granularity
(row r = layer * num_kv_heads + head). All rows of a request share ONE block list (so one block
table and one cache length, decision 4) while each row keeps its own tokens.

    virtual slot j  ->  physical slot  blocks[j // bs] * bs + j % bs

    request "a", bs = 4, blocks = [5, 2, 9], used (cache length) = 10, R = 2
    vslot         0  1  2  3 | 4  5  6  7 | 8  9  .  .
    block              5     |     2      |     9
    pos[0]       [0  1  2  3 | 4  5  6  7 | 8  9 -1 -1]
    live[0]      [1  0  1  1 | 0  1  1  1 | 1  1  0  0]      row 0 evicted positions 1, 4
    pos[1]       [0  1  2  3 | 4  5  6  7 | 8  9 -1 -1]
    live[1]      [1  1  1  0 | 1  1  0  1 | 1  1  0  0]      row 1 evicted positions 3, 6

    live count per row is equal (8): I2 within a request holds by construction (one cell per slot),
    across requests because blocks are exclusively owned (refcount 1, checked against the pool).

Everything here is numpy bookkeeping. The only tensors are the *device mirror*: fixed-capacity int32
tables allocated once and written in place (CUDA-graph safe; their ``data_ptr()`` never changes):

    block_tables  int32 [max_requests, max_blocks_per_request]   (-1 past the held blocks)
    cache_lens    int32 [max_requests]                            used virtual slots (live + holes)
    logical_lens  int32 [max_requests]                            true sequence length (positions)

Each request owns one mirror row for its lifetime (``RequestState.row``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
import torch

from ._debug import check

ReqId = Hashable


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class RequestState:
    """Bookkeeping of one request. Arrays are ``[R, cap]`` with ``cap >= len(blocks) * block_size``
    (grown geometrically; slots past ``used`` are empty: position -1, not live)."""

    req_id: ReqId
    row: int
    num_rows: int
    block_size: int
    pinned: np.ndarray  # [P] int64 sorted unique true positions that must never be evicted
    blocks: list[int] = field(default_factory=list)
    used: int = 0  # virtual slots in use = cache length (live + holes)
    logical_len: int = 0  # next true position (never decreases: decision 6)
    num_live: int = 0  # live tokens per row (equal in every row)
    pos: np.ndarray = field(default_factory=lambda: np.zeros((1, 0), np.int64))  # [R, cap]
    live: np.ndarray = field(default_factory=lambda: np.zeros((1, 0), bool))  # [R, cap]
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # vslots of last reserve
    evicted_since_reclaim: int = 0  # row-tokens marked dead since the last reclaim of this request
    holes: bool = False  # a dead token lies inside [0, used)
    tokens_moved: int = 0  # row-token moves done for this request, all reclaims
    # Naive-Evict shadow: the blocks Naive-Evict would hold with the same decisions, as true
    # position ranges [start, start + count) (appends are in position order, so blocks are ranges).
    naive_starts: list[int] = field(default_factory=list)
    naive_counts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pos = np.full((self.num_rows, 0), -1, dtype=np.int64)
        self.live = np.zeros((self.num_rows, 0), dtype=bool)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_size

    def phys(self, vslots: np.ndarray) -> np.ndarray:
        """Physical slot ids (int64, same shape) of virtual slots ``vslots``."""
        b = np.asarray(self.blocks, dtype=np.int64)
        v = np.asarray(vslots, dtype=np.int64)
        return b[v // self.block_size] * self.block_size + v % self.block_size

    def grow(self, new_cap: int) -> None:
        """Make the arrays hold at least ``new_cap`` slots (geometric growth: amortized O(1) per token)."""
        if new_cap > self.pos.shape[1]:
            extra = max(new_cap, 2 * self.pos.shape[1]) - self.pos.shape[1]
            self.pos = np.concatenate([self.pos, np.full((self.num_rows, extra), -1, np.int64)], axis=1)
            self.live = np.concatenate([self.live, np.zeros((self.num_rows, extra), bool)], axis=1)

    # ---- Naive-Evict shadow --------------------------------------------------------------------
    def naive_append(self, start: int, count: int) -> None:
        """Record ``count`` tokens appended at positions ``start..``: fill the open tail block, then
        open new ones (per block, not per token)."""
        bs = self.block_size
        if self.naive_counts and self.naive_counts[-1] < bs:
            take = min(bs - self.naive_counts[-1], count)
            self.naive_counts[-1] += take
            start += take
            count -= take
        while count > 0:
            take = min(bs, count)
            self.naive_starts.append(start)
            self.naive_counts.append(take)
            start += take
            count -= take

    def naive_drop_dead(self) -> None:
        """Naive rule: a block returns only when every token ever placed in it is dead."""
        if not self.naive_starts:
            return
        starts = np.asarray(self.naive_starts, dtype=np.int64)
        any_live = np.zeros(self.logical_len, dtype=np.int32)  # per true position: live in some row
        any_live[self.pos[:, : self.used][self.live[:, : self.used]]] = 1
        alive = np.add.reduceat(any_live, starts) > 0  # ranges are sorted and contiguous
        self.naive_starts = starts[alive].tolist()
        self.naive_counts = np.asarray(self.naive_counts, dtype=np.int64)[alive].tolist()


class TokenTable:
    """All requests' :class:`RequestState` plus the fixed-capacity device mirror."""

    def __init__(
        self,
        num_rows: int,
        block_size: int,
        max_requests: int,
        max_blocks_per_request: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_rows = num_rows
        self.block_size = block_size
        self.max_requests = max_requests
        self.max_blocks_per_request = max_blocks_per_request
        self.requests: dict[ReqId, RequestState] = {}
        self._free_rows: list[int] = list(range(max_requests - 1, -1, -1))
        # Device mirror: allocated once, updated in place, never reallocated.
        self.block_tables = torch.full((max_requests, max_blocks_per_request), -1, dtype=torch.int32,
                                       device=device)
        self.cache_lens = torch.zeros(max_requests, dtype=torch.int32, device=device)
        self.logical_lens = torch.zeros(max_requests, dtype=torch.int32, device=device)

    # ---------------------------------------------------------------- lifecycle
    def get(self, req_id: ReqId) -> RequestState:
        try:
            return self.requests[req_id]
        except KeyError:
            raise ValueError(f"unknown request {req_id!r} (never added, already freed or preempted)") from None

    def add(self, req_id: ReqId, pinned: np.ndarray) -> RequestState | None:
        if req_id in self.requests:
            raise ValueError(f"request {req_id!r} already exists")
        if not self._free_rows:
            return None
        st = RequestState(req_id=req_id, row=self._free_rows.pop(), num_rows=self.num_rows,
                          block_size=self.block_size, pinned=pinned)
        self.requests[req_id] = st
        self.sync_mirror(st)
        return st

    def remove(self, req_id: ReqId) -> RequestState:
        st = self.get(req_id)
        del self.requests[req_id]
        self.block_tables[st.row].fill_(-1)
        self.cache_lens[st.row] = 0
        self.logical_lens[st.row] = 0
        self._free_rows.append(st.row)
        return st

    def sync_mirror(self, st: RequestState) -> None:
        """Write ``st``'s block table and lengths into its mirror row (in place)."""
        nb = len(st.blocks)
        row = self.block_tables[st.row]
        if nb:
            row[:nb].copy_(torch.as_tensor(np.asarray(st.blocks, dtype=np.int32)))
        row[nb:].fill_(-1)
        self.cache_lens[st.row] = st.used
        self.logical_lens[st.row] = st.logical_len

    # ---------------------------------------------------------------- logical view
    @staticmethod
    def live_view(st: RequestState) -> tuple[np.ndarray, np.ndarray]:
        """``(positions [R, n_live], vslots [R, n_live])``, each row ascending by true position."""
        u = st.used
        key = np.where(st.live[:, :u], st.pos[:, :u], np.iinfo(np.int64).max)
        order = np.argsort(key, axis=1, kind="stable")[:, : st.num_live]
        return np.take_along_axis(key, order, axis=1), order.astype(np.int64)

    # ---------------------------------------------------------------- invariants
    def check_request(self, st: RequestState) -> None:
        """Per-request invariants (I2, PINS, shape/length consistency). O(R * cap)."""
        bs = self.block_size
        check(st.pos.shape == st.live.shape and st.pos.shape[0] == self.num_rows
              and st.pos.shape[1] >= st.capacity, "I2",
              f"request {st.req_id!r}: table shape {st.pos.shape} too small for (R, {st.capacity})")
        check(st.used <= st.capacity, "I2", f"request {st.req_id!r}: used {st.used} > capacity {st.capacity}")
        check(len(st.blocks) == cdiv(st.used, bs) or (st.used == 0 and not st.blocks), "POOL",
              f"request {st.req_id!r}: holds {len(st.blocks)} blocks for {st.used} used slots")
        check(not st.live[:, st.used:].any(), "I2", f"request {st.req_id!r}: live token past cache length")
        counts = st.live.sum(axis=1)
        check(bool((counts == st.num_live).all()), "I2",
              f"request {st.req_id!r}: live counts per row {counts.tolist()} != {st.num_live}")
        lp = np.where(st.live, st.pos, -1)
        srt = np.sort(lp, axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        check(not dup.any(), "I2", f"request {st.req_id!r}: a true position occupies two slots of one row")
        check(bool((lp < st.logical_len).all()), "I2", f"request {st.req_id!r}: position beyond logical length")
        check(len(set(st.blocks)) == len(st.blocks), "I2", f"request {st.req_id!r}: block listed twice")
        if st.pinned.size:
            present = st.pinned[st.pinned < st.logical_len]
            if present.size:
                for r in range(self.num_rows):  # per row, not per token
                    ok = np.isin(present, st.pos[r][st.live[r]])
                    check(bool(ok.all()), "PINS",
                          f"request {st.req_id!r} row {r}: pinned positions {present[~ok].tolist()} evicted")
