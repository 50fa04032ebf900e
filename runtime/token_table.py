"""Token table: per request, which true position sits in which virtual slot of which row.

Rows: R = 1 at ``"request"`` granularity; R = num_layers * num_kv_heads at ``"head"`` granularity
(row r = layer * num_kv_heads + head). All rows of a request share ONE block list (so one block
table and one cache length, docs/decisions.md decision 4) while each row keeps its own tokens.

    virtual slot j  ->  physical slot  blocks[j // bs] * bs + j % bs

    request "a", bs = 4, blocks = [5, 2, 9], cache_len = 10, R = 2
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
    cache_lens    int32 [max_requests]                            cache_len: virtual slots in use (live + holes)
    logical_lens  int32 [max_requests]                            true sequence length (positions)

Each request owns one mirror row for its lifetime (``RequestState.row``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ._debug import check

ReqId = Hashable


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def slot_index(block_tables: torch.Tensor, cache_lens: torch.Tensor, width: int, block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """THE virtual -> physical slot map of a batch (every kernel reference and collector uses this one).

    ``block_tables [B, max_blocks]``, ``cache_lens [B]`` -> ``(slots [B, width] int64, in_range [B, width]
    bool)`` with ``slots[b, j] = block_tables[b, j // bs] * bs + j % bs`` for ``j < cache_lens[b]`` and 0
    (a valid index, masked by ``in_range``) past it."""
    dev = block_tables.device
    j = torch.arange(width, device=dev)
    in_range = j[None, :] < cache_lens.to(dev, torch.int64)[:, None]
    bt = block_tables.to(torch.int64)
    blk = bt[:, (j // block_size).clamp(max=max(bt.shape[1] - 1, 0))] if bt.shape[1] else \
        torch.zeros(bt.shape[0], width, dtype=torch.int64, device=dev)
    slots = blk.clamp(min=0) * block_size + j % block_size
    return torch.where(in_range, slots, torch.zeros_like(slots)), in_range


@dataclass
class RequestState:
    """Bookkeeping of one request. Arrays are ``[R, cap]`` with ``cap >= len(blocks) * block_size``
    (grown geometrically; slots past ``cache_len`` are empty: position -1, not live)."""

    req_id: ReqId
    row: int
    num_rows: int
    block_size: int
    pinned: np.ndarray  # [P] int64 sorted unique true positions that must never be evicted
    blocks: list[int] = field(default_factory=list)
    cache_len: int = 0  # virtual slots in use (live + holes); the kernels' seq_len
    logical_len: int = 0  # next true position (never decreases: decision 6)
    num_live: int = 0  # live tokens per row (equal in every row)
    pos: np.ndarray = field(default_factory=lambda: np.zeros((1, 0), np.int64))  # [R, cap]
    live: np.ndarray = field(default_factory=lambda: np.zeros((1, 0), bool))  # [R, cap]
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # vslots of last reserve
    evicted_since_reclaim: int = 0  # row-tokens marked dead since the last reclaim of this request
    holes: bool = False  # a dead token lies inside [0, cache_len)
    tokens_moved: int = 0  # row-token moves done for this request, all reclaims
    # Naive-Evict shadow: the blocks Naive-Evict would hold with the same decisions, as true
    # position ranges [start, start + count) (appends are in position order, so blocks are ranges).
    naive_starts: list[int] = field(default_factory=list)
    naive_counts: list[int] = field(default_factory=list)
    # bumped by every change of pos / live / cache_len / num_live (all in this module): live_view's memo key
    version: int = 0
    view_memo: tuple[int, np.ndarray, np.ndarray] | None = field(default=None, repr=False)

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
            self.version += 1
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
        any_live[self.pos[:, : self.cache_len][self.live[:, : self.cache_len]]] = 1
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
        # Device mirror: allocated once, updated in place, never reallocated. Written through a host
        # twin (numpy views; pinned on CUDA) and uploaded by flush_mirror() with non-blocking copies, so
        # bookkeeping never synchronises with the device. On CPU the twin IS the mirror.
        dev = torch.device(device)
        self._on_device = dev.type != "cpu"
        pin = self._on_device and torch.cuda.is_available()
        shapes = {"block_tables": ((max_requests, max_blocks_per_request), -1), "cache_lens": ((max_requests,), 0),
                  "logical_lens": ((max_requests,), 0)}
        self._host: dict[str, torch.Tensor] = {}
        for name, (shape, fill) in shapes.items():
            host = torch.full(shape, fill, dtype=torch.int32, pin_memory=pin)
            self._host[name] = host
            setattr(self, name, host.to(dev) if self._on_device else host)
        self._bt_np, self._lens_np, self._logical_np = (self._host[n].numpy() for n in shapes)
        self._dirty: set[int] = set()

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
        self._write_row(st.row, (), 0, 0)
        self._free_rows.append(st.row)
        return st

    def sync_mirror(self, st: RequestState) -> None:
        """Write ``st``'s block table and lengths into its mirror row (host twin; see :meth:`flush_mirror`)."""
        self._write_row(st.row, st.blocks, st.cache_len, st.logical_len)

    def _write_row(self, row: int, blocks: Any, cache_len: int, logical: int) -> None:
        nb = len(blocks)
        self._bt_np[row, :nb] = blocks
        self._bt_np[row, nb:] = -1
        self._lens_np[row] = cache_len
        self._logical_np[row] = logical
        if self._on_device:
            self._dirty.add(row)

    def flush_mirror(self) -> None:
        """Upload the rows written since the last flush (CUDA: non-blocking copies from pinned memory
        of the row range; nothing to do on CPU). Every reader of the device mirror calls this first.
        The host twin is written again only after the step's sampling has synchronised the stream."""
        if not self._dirty:
            return
        a, b = min(self._dirty), max(self._dirty) + 1
        self._dirty.clear()
        for name, host in self._host.items():
            getattr(self, name)[a:b].copy_(host[a:b], non_blocking=True)

    # ---------------------------------------------------------------- mutations (the only writers)
    def blocks_needed(self, req_id: ReqId, num_new_tokens: int) -> int:
        """Blocks ``reserve(req_id, num_new_tokens, ...)`` must be given (ValueError past the row's capacity)."""
        st = self.get(req_id)
        n = int(num_new_tokens)
        if n < 0:
            raise ValueError(f"request {req_id!r}: cannot reserve a negative number of tokens ({n})")
        need = max(cdiv(st.cache_len + n, self.block_size) - len(st.blocks), 0)
        if len(st.blocks) + need > self.max_blocks_per_request:
            raise ValueError(f"request {req_id!r}: {st.cache_len + n} slots exceed max_blocks_per_request="
                             f"{self.max_blocks_per_request} x block_size={self.block_size}")
        return need

    def reserve(self, req_id: ReqId, num_new_tokens: int, new_blocks: list[int]
                ) -> tuple[np.ndarray, np.ndarray]:
        """Append ``num_new_tokens`` live tokens (true positions ``logical_len, ...``) in the next virtual
        slots of every row, taking ``new_blocks`` (exactly :meth:`blocks_needed` of them).
        Returns ``(physical slots [T], true positions [T])``."""
        st = self.get(req_id)
        n = int(num_new_tokens)
        if len(new_blocks) != self.blocks_needed(req_id, n):
            raise ValueError(f"request {req_id!r}: reserve of {n} tokens needs "
                             f"{self.blocks_needed(req_id, n)} new blocks, got {len(new_blocks)}")
        if new_blocks:
            st.blocks.extend(int(b) for b in new_blocks)
            st.grow(st.capacity)
        v = np.arange(st.cache_len, st.cache_len + n, dtype=np.int64)
        p = np.arange(st.logical_len, st.logical_len + n, dtype=np.int64)
        st.version += 1
        st.pos[:, v] = p
        st.live[:, v] = True
        st.naive_append(st.logical_len, n)
        st.cache_len += n
        st.logical_len += n
        st.num_live += n
        st.pending = v
        self.sync_mirror(st)
        return st.phys(v), p

    def pending_slots(self, req_id: ReqId, offset: int, count: int) -> np.ndarray:
        """Physical slots of tokens ``offset .. offset+count-1`` of the last :meth:`reserve`."""
        st = self.get(req_id)
        if offset < 0 or offset + count > st.pending.size:
            raise ValueError(
                f"request {req_id!r}: writing tokens [{offset}, {offset + count}) past the {st.pending.size} slots "
                "reserved by its last reserve() (apply_keep_mask/reclaim invalidate pending reservations)")
        return st.phys(st.pending[offset:offset + count])

    def set_pins(self, req_id: ReqId, pins: np.ndarray) -> None:
        """Replace the pinned positions (sorted unique); every present pin must still be live in every row."""
        st = self.get(req_id)
        present = pins[pins < st.logical_len]
        for r in range(self.num_rows):
            gone = present[~np.isin(present, st.pos[r][st.live[r]])]
            if gone.size:
                raise ValueError(f"request {req_id!r}: cannot pin already evicted positions {gone[:8].tolist()}")
        st.pinned = pins

    def mark_dead(self, req_id: ReqId, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Evict where ``keep [R, n_live]`` (order of :meth:`live_view`) is False. Misuse (dtype, shape,
        unequal counts per row, an evicted pin) raises ValueError and changes nothing. Returns the
        evicted ``(rows [M], physical slots [M])``; their slots stay allocated until :meth:`commit`."""
        st = self.get(req_id)
        km = np.asarray(keep)
        if km.dtype != np.bool_:
            raise ValueError(f"request {req_id!r}: keep mask must be bool, got {km.dtype}")
        if km.ndim == 1 and self.num_rows == 1:
            km = km[None, :]
        if km.shape != (self.num_rows, st.num_live):
            raise ValueError(f"request {req_id!r}: keep mask shape {km.shape} != (R, n_live) = "
                             f"{(self.num_rows, st.num_live)}")
        kept = km.sum(axis=1)
        if kept.size and not (kept == kept[0]).all():
            raise ValueError(f"request {req_id!r}: every row must keep the same number of tokens, got "
                             f"{sorted(set(kept.tolist()))} (one block table per request: docs/decisions.md, decision 4)")
        pos, vs = self.live_view(st)
        r, c = np.nonzero(~km)
        if r.size == 0:
            return r.astype(np.int64), r.astype(np.int64)
        if st.pinned.size:
            bad = np.isin(pos[r, c], st.pinned)
            if bad.any():
                raise ValueError(f"request {req_id!r}: keep mask evicts pinned position(s) "
                                 f"{np.unique(pos[r, c][bad])[:8].tolist()}")
        dead = vs[r, c]
        st.version += 1
        st.live[r, dead] = False
        st.num_live = int(kept[0])
        st.evicted_since_reclaim += int(r.size)
        st.holes = True
        st.pending = np.zeros(0, np.int64)
        return r.astype(np.int64), st.phys(dead)

    def commit(self, st: RequestState, plan: Any, mode: str, debug: bool = False) -> list[int]:
        """Apply a reclamation plan (``planner.RequestPlan``) to ``st`` (post-plan view) and return the
        blocks it frees (block-list order). The copies that make the tensors agree are the caller's."""
        bs = self.block_size
        before = np.sort(np.where(st.live, st.pos, -1), axis=1) if debug else None
        old_blocks = len(st.blocks)
        st.version += 1
        if mode == "naive":
            keep = plan.keep_blocks
            kept_ids = np.nonzero(keep)[0]
            drop_ids = np.nonzero(~keep)[0]
            in_drop = np.minimum(bs, st.cache_len - drop_ids * bs)
            cols = (kept_ids[:, None] * bs + np.arange(bs)).reshape(-1)
            cap = st.pos.shape[1]
            st.pos = np.concatenate([st.pos[:, cols], np.full((self.num_rows, cap - cols.size), -1, np.int64)], 1)
            st.live = np.concatenate([st.live[:, cols], np.zeros((self.num_rows, cap - cols.size), bool)], 1)
            freed = [st.blocks[i] for i in drop_ids]
            st.blocks = [st.blocks[i] for i in kept_ids]
            st.cache_len -= int(in_drop.sum())
            st.holes = bool((~st.live[:, : st.cache_len]).any())
        else:
            n = st.num_live
            st.pos[plan.rows, plan.dst] = st.pos[plan.rows, plan.src]  # RHS gathered first: overlap-safe
            st.live[:, :n] = True
            st.live[:, n:] = False
            st.pos[:, n:] = -1
            k = cdiv(n, bs)
            freed = st.blocks[k:]
            st.blocks = st.blocks[:k]
            st.cache_len = n
            st.holes = False
        st.tokens_moved += plan.num_moves
        st.evicted_since_reclaim = 0
        st.pending = np.zeros(0, np.int64)
        st.naive_drop_dead()
        self.sync_mirror(st)
        if before is not None:
            after = np.sort(np.where(st.live, st.pos, -1), axis=1)
            b, a = before[:, before.shape[1] - st.num_live:], after[:, after.shape[1] - st.num_live:]
            check(bool((a == b).all()), "I1", f"request {st.req_id!r}: live positions changed by a plan")
            check(len(st.blocks) <= old_blocks, "I4", f"request {st.req_id!r}: a plan grew the block list")
        return list(freed)

    def fork(self, src: ReqId, dst: ReqId, new_blocks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Make ``dst`` (added, empty) a copy of ``src``'s layout, evictions included, in ``new_blocks``
        (``len(src.blocks)`` of them). Returns ``(src slots [M], dst slots [M])``: the physical slots in use
        whose K/V, stats and positions the caller copies (every row)."""
        s, d = self.get(src), self.get(dst)
        if d.cache_len or d.logical_len:
            raise ValueError(f"fork target {dst!r} must be empty")
        if len(new_blocks) != len(s.blocks):
            raise ValueError(f"fork of {src!r} needs {len(s.blocks)} blocks, got {len(new_blocks)}")
        d.blocks = [int(b) for b in new_blocks]
        d.version += 1
        d.pos, d.live = s.pos.copy(), s.live.copy()
        d.cache_len, d.logical_len, d.num_live, d.holes = s.cache_len, s.logical_len, s.num_live, s.holes
        d.evicted_since_reclaim = s.evicted_since_reclaim
        d.naive_starts, d.naive_counts = list(s.naive_starts), list(s.naive_counts)
        self.sync_mirror(d)
        v = np.arange(s.cache_len, dtype=np.int64)
        return s.phys(v), d.phys(v)

    # ---------------------------------------------------------------- logical view
    @staticmethod
    def live_view(st: RequestState) -> tuple[np.ndarray, np.ndarray]:
        """``(positions [R, n_live], vslots [R, n_live])``, each row ascending by true position.

        Live true positions are unique per row and every row holds ``n_live`` of them (I2), so when the
        position range is not much wider than the cache (``logical_len <= 4 * cache_len``: a dense
        ``[R, logical_len]`` scratch stays small) the rows are ordered by scattering each live slot to its
        position and reading the scratch back row-major (no sort, ~2.5x faster at 90 rows x 800 slots);
        otherwise by a stable argsort. Same result either way (tested).

        Memoised per table version (an eviction step reads it for the statistics, the pins and the keep
        mask): the arrays are read-only, shared by every caller until the table changes."""
        memo = st.view_memo
        if memo is not None and memo[0] == st.version:
            return memo[1], memo[2]
        pos, vs = TokenTable._live_view(st)
        pos.flags.writeable = False
        vs.flags.writeable = False
        st.view_memo = (st.version, pos, vs)
        return pos, vs

    @staticmethod
    def _live_view(st: RequestState) -> tuple[np.ndarray, np.ndarray]:
        u = st.cache_len
        R, L, n = st.live.shape[0], st.logical_len, st.num_live
        if 0 < L <= 4 * max(u, 1):
            lv = st.live[:, :u]
            rr, vv = np.nonzero(lv)
            if rr.size == R * n:  # (a broken invariant falls through to the sort, which debug checks catch)
                scratch = np.full(R * L, -1, np.int64)
                scratch[rr * L + st.pos[:, :u][lv]] = vv
                cols = np.flatnonzero(scratch >= 0)
                if cols.size == R * n:
                    return (cols % L).reshape(R, n), scratch[cols].reshape(R, n)
        return TokenTable.live_view_sorted(st)

    @staticmethod
    def live_view_sorted(st: RequestState) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`live_view` by a stable argsort of the live positions (the general path)."""
        u = st.cache_len
        key = np.where(st.live[:, :u], st.pos[:, :u], np.iinfo(np.int64).max)
        order = np.argsort(key, axis=1, kind="stable")[:, : st.num_live]
        return np.take_along_axis(key, order, axis=1), order.astype(np.int64)

    # ---------------------------------------------------------------- invariants
    def check_request(self, st: RequestState, mode: str | None = None) -> None:
        """Per-request invariants (I2, PINS, shape/length consistency, the device mirror, and with
        ``mode`` its block rule: naive holds the naive rule's blocks, compact/ordered ``ceil(live/bs)``
        once reclaimed). O(R * cap)."""
        bs = self.block_size
        check(st.pos.shape == st.live.shape and st.pos.shape[0] == self.num_rows
              and st.pos.shape[1] >= st.capacity, "I2",
              f"request {st.req_id!r}: table shape {st.pos.shape} too small for (R, {st.capacity})")
        check(st.cache_len <= st.capacity, "I2", f"request {st.req_id!r}: cache_len {st.cache_len} > capacity {st.capacity}")
        check(len(st.blocks) == cdiv(st.cache_len, bs) or (st.cache_len == 0 and not st.blocks), "POOL",
              f"request {st.req_id!r}: holds {len(st.blocks)} blocks for cache_len {st.cache_len}")
        check(not st.live[:, st.cache_len:].any(), "I2", f"request {st.req_id!r}: live token past cache length")
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
        if mode == "naive":
            check(len(st.blocks) == len(st.naive_starts), "I4",
                  f"request {st.req_id!r}: naive mode holds {len(st.blocks)} blocks, naive rule says "
                  f"{len(st.naive_starts)}")
        elif mode is not None and not st.holes:
            check(st.cache_len == st.num_live and len(st.blocks) == cdiv(st.num_live, bs), "I4",
                  f"request {st.req_id!r}: {len(st.blocks)} blocks / cache length {st.cache_len} for "
                  f"{st.num_live} live tokens without holes")
        nb = len(st.blocks)
        self.flush_mirror()
        mirror = self.block_tables[st.row, :nb].cpu().numpy()
        check(bool((mirror == np.asarray(st.blocks, dtype=np.int32)).all())
              and int(self.cache_lens[st.row]) == st.cache_len, "I3",
              f"request {st.req_id!r}: device mirror disagrees with the token table")


@dataclass
class AttentionMetadata:
    """Views of persistent buffers (static ``data_ptr()``), valid until the next metadata call.

    block_tables [B, max_blocks_per_request] int32 (-1 past held blocks), cache_lens [B] int32,
    logical_lens [B] int32 (true sequence lengths: positions, RoPE), rows [B] int64 (mirror rows).
    ``needs_mask``: dead slots lie inside some cache length (naive mode): the kernel must mask slots
    whose true position is < 0 (``VTokenCache.key_positions(layer)``).
    """

    req_ids: list[ReqId]
    rows: torch.Tensor
    block_tables: torch.Tensor
    cache_lens: torch.Tensor
    logical_lens: torch.Tensor
    needs_mask: bool
    scatter_cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def normalize_pins(pinned_positions: Iterable[int] | np.ndarray | None) -> np.ndarray:
    """Sorted unique int64 true positions (ValueError for a negative one)."""
    pins = np.unique(np.asarray([] if pinned_positions is None else list(np.asarray(pinned_positions).ravel()),
                                dtype=np.int64))
    if pins.size and pins[0] < 0:
        raise ValueError(f"pinned positions must be >= 0, got {pins[:4].tolist()}")
    return pins
