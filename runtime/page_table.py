"""Page table: per (layer, KV head) row its own pages and length, for rows that keep unequal numbers of
tokens (``allocation=`` other than ``vt.Uniform()``; docs/decisions.md decision 8, issue 38).

A block of the :class:`~vtoken_runtime.block_pool.BlockPool` (the ids the uniform token table hands out)
is ``P = num_layers * num_kv_heads`` *one-head pages* of ``block_size`` positions each. Page ids are
global (one page space for every layer): page ``p`` is layer ``l``, KV head ``h`` of block ``b`` with

    p = b * P + l * H + h          page slot  g = p * bs + o   (o: offset inside the page)

so page slot ``g`` is exactly the memory of cache element ``[layer l][block b, offset o, head h]``, the
slot the uniform table would call ``b * bs + o`` in row ``(l, h)``. Any row may use any page of its
request's blocks (PyramidKV and DuoAttention move tokens *between* layers: only a page space shared by
all layers turns that into freed blocks, decision 8's measurement).

    request "a", L = 2, H = 2 (P = 4), bs = 4, blocks [7, 3]       pages of block 7: 28..31, of block 3: 12..15
    row 0 (l0 h0)  pages [12, 13]  n = 6   positions [0 2 3 5 | 8 9 . .]
    row 1 (l0 h1)  pages [14]      n = 3   positions [1 8 9 .]
    row 2 (l1 h0)  pages [15, 28]  n = 5   (pages are taken lowest id first)
    row 3 (l1 h1)  pages [29]      n = 2
    free pages [30, 31]            6 pages in use -> 2 blocks = ceil(6 / P)

Invariants (checked by :meth:`PageTable.check_request`; ``VTOKEN_DEBUG=1`` after every mutation):

* R1 (I1) a row's tokens are *compact and ordered*: slot ``j`` of the row holds its ``j``-th live position
  (ascending, unique, ``< logical_len``); evict and adopt never change a kept token's position.
* R2 (I2) row ``r`` holds exactly ``ceil(n_r / bs)`` pages; every page of the request's blocks is in
  exactly one row or in the request's free list; blocks are owned by one request.
* R3 (I3) there is no persistent device mirror yet: every step's page tables are built from this table
  (:meth:`PageTable.batch_tables`), so nothing can go stale (issue 39 needs graph-stable buffers).
* R4 (I4) the request holds ``max(ceil(sum_r ceil(n_r / bs) / P), hold)`` blocks after *every* mutation:
  reserve fills free pages before it takes a block, evict repacks pages out of the emptiest blocks (and
  resets ``hold``). ``hold`` is 0 unless the owner asks to keep spare blocks (``adopt(hold=)``,
  ``reserve(spare=True)``: tensor-parallel ranks hold the same blocks, vLLM's list, for rows of different
  lengths).
* PINS every present pinned position is live in every row.

Bookkeeping only (numpy); moves are returned as page-slot pairs the cache applies (gather first, so
sources and destinations may overlap). Misuse raises ValueError and changes nothing; a broken invariant
raises :class:`~vtoken_runtime._debug.InvariantError`.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ._debug import check, debug_enabled

ReqId = Hashable


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def design_bounds(lengths: np.ndarray, block_size: int) -> dict[str, int]:
    """Blocks a request whose rows hold ``lengths [L, H]`` tokens needs under each memory design: ``pages`` (one
    page space for every layer: what R4 holds), ``per_layer`` (a page pool per layer: per layer
    ``ceil(sum_h ceil(n / bs) / H)``, the largest layer; issue 38's ideal) and ``max_row`` (one block list
    shared by the rows: the longest row)."""
    n = np.asarray(lengths, dtype=np.int64)
    pages = -(-n // block_size)
    return {"pages": cdiv(int(pages.sum()), max(pages.size, 1)),
            "per_layer": int(max((cdiv(int(x), n.shape[1]) for x in pages.sum(axis=1)), default=0)),
            "max_row": cdiv(int(n.max(initial=0)), block_size)}


@dataclass
class RowRequest:
    """One request's rows. ``pos[r]``: live positions of row ``r`` in slot order (ascending);
    ``pages[r]``: its pages, ``len == ceil(len(pos[r]) / bs)``; ``free``: a min-heap of free pages."""

    req_id: ReqId
    pinned: np.ndarray
    num_rows: int
    blocks: list[int] = field(default_factory=list)
    free: list[int] = field(default_factory=list)
    pages: list[list[int]] = field(default_factory=list)
    pos: list[np.ndarray] = field(default_factory=list)
    logical_len: int = 0
    tokens_moved: int = 0
    pages_moved: int = 0
    hold: int = 0  # blocks the owner asked it to keep even with free pages (tensor-parallel ranks agree on one count)

    def __post_init__(self) -> None:
        self.pages = [[] for _ in range(self.num_rows)]
        self.pos = [np.zeros(0, np.int64) for _ in range(self.num_rows)]

    @property
    def lengths(self) -> np.ndarray:
        """Live tokens per row ``[R]``."""
        return np.fromiter((p.size for p in self.pos), np.int64, self.num_rows)

    @property
    def pages_used(self) -> int:
        return sum(len(p) for p in self.pages)


@dataclass
class RowPlan:
    """What :meth:`PageTable.evict` (or ``adopt``) decided: copy page slot ``src[i]`` to ``dst[i]`` (all
    sources read before any write), then the request no longer holds ``freed`` (the caller frees them)."""

    src: np.ndarray
    dst: np.ndarray
    freed: list[int]
    tokens_evicted: int = 0
    pages_moved: int = 0

    @property
    def num_moves(self) -> int:
        return int(self.src.size)


class PageTable:
    """All row requests of one cache: rows ``R = num_layers * num_kv_heads`` (row ``r = layer * H + head``)."""

    def __init__(self, num_layers: int, num_kv_heads: int, block_size: int, max_requests: int,
                 debug: bool | None = None, release: str = "emptiest") -> None:
        """``release``: which blocks an eviction empties. ``"emptiest"`` (the HF session) frees the blocks with
        the fewest used pages, so the fewest pages move; ``"tail"`` frees the last blocks of the request's
        block list, so an owner that can only shorten a request's list (vLLM's, through the plugin's
        truncation; decision 8) sees a truncation. Both hold R4: the same number of blocks remains."""
        if release not in ("emptiest", "tail"):
            raise ValueError(f"release must be 'emptiest' or 'tail', got {release!r}")
        self.release = release
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("block_size", block_size),
                        ("max_requests", max_requests)):
            if int(v) <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        self.num_layers, self.num_kv_heads, self.block_size = num_layers, num_kv_heads, block_size
        self.num_rows = self.pages_per_block = num_layers * num_kv_heads
        self.max_requests = max_requests
        self.debug = debug_enabled(debug)
        self.requests: dict[ReqId, RowRequest] = {}

    # ---------------------------------------------------------------- addresses
    def page_slot_address(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Page slots ``g`` (any shape) -> ``(layer, block, offset, head)`` of the cache element they are."""
        g = np.asarray(g, dtype=np.int64)
        p, o = g // self.block_size, g % self.block_size
        P, H = self.pages_per_block, self.num_kv_heads
        return (p % P) // H, p // P, o, p % H

    def row_page_slots(self, block: np.ndarray, offset: np.ndarray, row: np.ndarray) -> np.ndarray:
        """The page slot of uniform slot ``block * bs + offset`` in row ``row`` (the inverse of
        :meth:`page_slot_address` for a row's own layer and head)."""
        return (np.asarray(block, np.int64) * self.pages_per_block + np.asarray(row, np.int64)) * self.block_size \
            + np.asarray(offset, np.int64)

    def slots(self, st: RowRequest, r: int, idx: np.ndarray | None = None) -> np.ndarray:
        """Page slots of row ``r``'s tokens ``idx`` (default: all, slot order)."""
        j = np.arange(st.pos[r].size, dtype=np.int64) if idx is None else np.asarray(idx, np.int64)
        pg = np.asarray(st.pages[r], dtype=np.int64)
        return pg[j // self.block_size] * self.block_size + j % self.block_size if j.size else j

    # ---------------------------------------------------------------- lifecycle
    def get(self, req_id: ReqId) -> RowRequest:
        try:
            return self.requests[req_id]
        except KeyError:
            raise ValueError(f"unknown row request {req_id!r} (never adopted or already freed)") from None

    def add(self, req_id: ReqId, pinned: np.ndarray) -> RowRequest | None:
        """A new empty request; None when ``max_requests`` are held."""
        if req_id in self.requests:
            raise ValueError(f"row request {req_id!r} already exists")
        if len(self.requests) >= self.max_requests:
            return None
        st = RowRequest(req_id, np.asarray(pinned, np.int64), self.num_rows)
        self.requests[req_id] = st
        return st

    def remove(self, req_id: ReqId) -> list[int]:
        """Forget a request; returns its blocks (the caller frees them)."""
        st = self.get(req_id)
        del self.requests[req_id]
        return list(st.blocks)

    # ---------------------------------------------------------------- mutations (the only writers)
    def adopt(self, req_id: ReqId, positions: Sequence[np.ndarray], blocks: list[int], logical_len: int,
              src: Sequence[np.ndarray] | None = None, hold: int = 0) -> tuple[list[np.ndarray], list[int]]:
        """Lay out an empty request's rows: row ``r`` holds ``positions[r]`` (ascending, unique), in pages of
        the first ``max(ceil(pages / P), hold)`` of ``blocks`` (the request now owns those; ``hold``: blocks to
        keep even if free, e.g. the count tensor-parallel ranks agreed on). Returns ``(page slots per row, the
        blocks not needed)``; ValueError (nothing changes) for bad positions, missing pins or too few blocks.
        ``src`` (the page slots the tokens come from) counts the moves in ``tokens_moved``."""
        st = self.get(req_id)
        if st.blocks or st.logical_len:
            raise ValueError(f"row request {req_id!r} must be empty to adopt a layout")
        if len(positions) != self.num_rows:
            raise ValueError(f"adopt needs {self.num_rows} rows of positions, got {len(positions)}")
        pos = [np.asarray(p, dtype=np.int64) for p in positions]
        for r, p in enumerate(pos):
            if p.ndim != 1 or (p.size and (p[0] < 0 or p[-1] >= logical_len or (np.diff(p) <= 0).any())):
                raise ValueError(f"row {r}: positions must be ascending, unique and in [0, {logical_len})")
        self._check_pins(st, pos, logical_len)
        need = sum(cdiv(p.size, self.block_size) for p in pos)
        k = max(cdiv(need, self.pages_per_block), int(hold))
        if k > len(blocks) or len(set(blocks)) != len(blocks):
            raise ValueError(f"row request {req_id!r}: {need} pages (hold {hold}) need {k} distinct blocks, got "
                             f"{len(blocks)}")
        st.blocks = [int(b) for b in blocks[:k]]
        st.hold = int(hold)
        st.free = self._pages_of(st.blocks)
        st.logical_len = int(logical_len)
        out = []
        for r, p in enumerate(pos):
            st.pages[r] = [heapq.heappop(st.free) for _ in range(cdiv(p.size, self.block_size))]
            st.pos[r] = p.copy()
            out.append(self.slots(st, r))
            if src is not None:
                st.tokens_moved += int((np.asarray(src[r], np.int64) != out[-1]).sum())
        self._debug_check(st)
        return out, [int(b) for b in blocks[k:]]

    def pages_needed(self, req_id: ReqId, n: int) -> int:
        """New pages ``reserve(req_id, n)`` fills (every row appends ``n`` tokens)."""
        st = self.get(req_id)
        if n < 0:
            raise ValueError(f"row request {req_id!r}: cannot reserve a negative number of tokens ({n})")
        return int(sum(cdiv(p.size + n, self.block_size) - len(pg) for p, pg in zip(st.pos, st.pages, strict=True)))

    def blocks_needed(self, req_id: ReqId, n: int) -> int:
        """Blocks :meth:`reserve` must be given: free pages of the request's blocks are used first."""
        return cdiv(max(0, self.pages_needed(req_id, n) - len(self.get(req_id).free)), self.pages_per_block)

    def reserve(self, req_id: ReqId, n: int, new_blocks: list[int], spare: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Append ``n`` tokens (true positions ``logical_len ..``) to every row, taking ``new_blocks``
        (exactly :meth:`blocks_needed`; with ``spare``, at least that many, the rest held as free pages:
        ``hold``). Returns ``(page slots [R, n], positions [n])``."""
        st = self.get(req_id)
        need = self.blocks_needed(req_id, n)
        if len(new_blocks) < need or (len(new_blocks) > need and not spare):
            raise ValueError(f"row request {req_id!r}: reserving {n} tokens needs {need} new blocks, got "
                             f"{len(new_blocks)}")
        if len(new_blocks) > need:
            st.hold = len(st.blocks) + len(new_blocks)
        for b in new_blocks:
            st.blocks.append(int(b))
            for p in self._pages_of([int(b)]):
                heapq.heappush(st.free, p)
        newpos = np.arange(st.logical_len, st.logical_len + n, dtype=np.int64)
        slots = np.empty((self.num_rows, n), np.int64)
        for r in range(self.num_rows):
            old = st.pos[r].size
            for _ in range(cdiv(old + n, self.block_size) - len(st.pages[r])):
                st.pages[r].append(heapq.heappop(st.free))
            st.pos[r] = np.concatenate([st.pos[r], newpos])
            slots[r] = self.slots(st, r, np.arange(old, old + n))
        st.logical_len += n
        self._debug_check(st)
        return slots, newpos

    def evict(self, req_id: ReqId, keep: Sequence[np.ndarray], hold: int = 0) -> RowPlan:
        """Keep, in row ``r``, its tokens where ``keep[r]`` (bool ``[n_r]``, slot order) is True: compact every
        row to the front of its pages, return its emptied tail pages to the free list, then move the pages of
        the emptiest blocks into free pages of the fullest until the request holds ``max(ceil(pages / P),
        hold)`` blocks (R4; ``hold``: the count tensor-parallel ranks agreed on). Misuse (shape, dtype, an
        evicted pin) raises ValueError and changes nothing."""
        st = self.get(req_id)
        if len(keep) != self.num_rows:
            raise ValueError(f"row request {req_id!r}: keep needs {self.num_rows} rows, got {len(keep)}")
        km = [np.asarray(k) for k in keep]
        for r, k in enumerate(km):
            if k.dtype != np.bool_ or k.shape != st.pos[r].shape:
                raise ValueError(f"row request {req_id!r} row {r}: keep must be bool [{st.pos[r].size}], got "
                                 f"{k.dtype} {list(k.shape)}")
        kept_pos = [p[k] for p, k in zip(st.pos, km, strict=True)]
        self._check_pins(st, kept_pos, st.logical_len)
        if hold < 0:
            raise ValueError(f"row request {req_id!r}: hold must be >= 0, got {hold}")
        st.hold = int(hold)  # an eviction frees down to what the rows need (or to what the ranks agreed)
        bs = self.block_size
        src = [self.slots(st, r, np.flatnonzero(k)) for r, k in enumerate(km)]  # old page slots of kept tokens
        evicted = int(sum(k.size - int(k.sum()) for k in km))
        for r, p in enumerate(kept_pos):  # 1. compaction: tail pages go back to the free list
            keep_pages = cdiv(p.size, bs)
            for pg in st.pages[r][keep_pages:]:
                heapq.heappush(st.free, pg)
            st.pages[r] = st.pages[r][:keep_pages]
            st.pos[r] = p
        remap, freed = self._repack(st)  # 2. empty whole blocks
        src_all, dst_all = [], []
        for r in range(self.num_rows):
            st.pages[r] = [remap.get(pg, pg) for pg in st.pages[r]]
            d = self.slots(st, r)
            moved = d != src[r]
            src_all.append(src[r][moved])
            dst_all.append(d[moved])
        plan = RowPlan(np.concatenate(src_all) if src_all else np.zeros(0, np.int64),
                       np.concatenate(dst_all) if dst_all else np.zeros(0, np.int64), freed, evicted, len(remap))
        st.tokens_moved += plan.num_moves
        st.pages_moved += len(remap)
        self._debug_check(st)
        return plan

    def fork(self, src: ReqId, dst: ReqId, new_blocks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Make ``dst`` (added, empty) a copy of ``src``'s rows in ``new_blocks`` (``len(src.blocks)`` of them,
        block ``i`` of ``src`` becoming ``new_blocks[i]``). Returns ``(src page slots [M], dst page slots [M])``
        of every token of every row, for the caller's K/V copy."""
        s, d = self.get(src), self.get(dst)
        if d.blocks or d.logical_len:
            raise ValueError(f"fork target {dst!r} must be empty")
        if len(new_blocks) != len(s.blocks) or len(set(new_blocks)) != len(new_blocks):
            raise ValueError(f"fork of {src!r} needs {len(s.blocks)} distinct blocks, got {len(new_blocks)}")
        P = self.pages_per_block
        to = {b: int(n) for b, n in zip(s.blocks, new_blocks, strict=True)}
        d.hold = s.hold  # the copy holds what the source holds

        def page(pg: int) -> int:
            return to[pg // P] * P + pg % P

        d.blocks = [int(b) for b in new_blocks]
        d.free = [page(pg) for pg in s.free]
        heapq.heapify(d.free)
        d.pages = [[page(pg) for pg in row] for row in s.pages]
        d.pos = [p.copy() for p in s.pos]
        d.logical_len = s.logical_len
        a = np.concatenate([self.slots(s, r) for r in range(self.num_rows)])
        b = np.concatenate([self.slots(d, r) for r in range(self.num_rows)])
        self._debug_check(d)
        return a, b

    def _repack(self, st: RowRequest) -> tuple[dict[int, int], list[int]]:
        """Move used pages out of the blocks to free into free pages of the blocks kept; returns
        ``({old page: new page}, freed blocks)``. ``release="emptiest"`` keeps the blocks with the most used
        pages (ties: earlier in the block list), so the fewest pages move; ``"tail"`` keeps the list's first
        ``max(ceil(pages / P), hold)`` blocks."""
        P = self.pages_per_block
        k = max(cdiv(st.pages_used, P), st.hold)  # R4: ``hold`` (agreed by tensor-parallel ranks) stays held
        if len(st.blocks) <= k:
            return {}, []
        used = np.zeros(len(st.blocks), np.int64)
        index = {b: i for i, b in enumerate(st.blocks)}
        for pg in (pg for row in st.pages for pg in row):
            used[index[pg // P]] += 1
        if self.release == "tail":  # keep the list's head: the owner truncates
            keep_idx, drop_idx = list(range(k)), list(range(k, len(st.blocks)))
        else:
            order = np.argsort(-used, kind="stable")
            keep_idx, drop_idx = sorted(order[:k].tolist()), order[k:].tolist()
        kept_blocks = [st.blocks[i] for i in keep_idx]
        dropped_list = [st.blocks[i] for i in sorted(drop_idx)]
        dropped = set(dropped_list)
        free_kept = sorted(pg for pg in st.free if pg // P not in dropped)
        moving = sorted(pg for row in st.pages for pg in row if pg // P in dropped)
        remap = dict(zip(moving, free_kept[: len(moving)], strict=True))
        taken = set(remap.values())
        st.free = [pg for pg in free_kept if pg not in taken]
        heapq.heapify(st.free)
        st.blocks = kept_blocks
        return remap, dropped_list

    def _pages_of(self, blocks: list[int]) -> list[int]:
        P = self.pages_per_block
        out = [b * P + i for b in blocks for i in range(P)]
        heapq.heapify(out)
        return out

    def _check_pins(self, st: RowRequest, pos: Sequence[np.ndarray], logical_len: int) -> None:
        present = st.pinned[st.pinned < logical_len]
        if not present.size:
            return
        for r, p in enumerate(pos):
            gone = present[~np.isin(present, p)]
            if gone.size:
                raise ValueError(f"row request {st.req_id!r} row {r}: pinned position(s) {gone[:8].tolist()} "
                                 "would be evicted")

    # ---------------------------------------------------------------- views
    def batch_tables(self, req_ids: Sequence[ReqId], rows: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(page tables [B, R', max_pages] int64 (-1 past a row's pages), lengths [B, R'] int64)`` of a batch,
        rows ``rows`` (default all; a layer is ``slice(l * H, (l + 1) * H)``)."""
        sts = [self.get(r) for r in req_ids]
        sel = range(self.num_rows)[rows or slice(None)]
        width = max((len(st.pages[r]) for st in sts for r in sel), default=0)
        pt = np.full((len(sts), len(sel), max(width, 1)), -1, np.int64)
        lens = np.zeros((len(sts), len(sel)), np.int64)
        for b, st in enumerate(sts):
            for i, r in enumerate(sel):
                pt[b, i, : len(st.pages[r])] = st.pages[r]
                lens[b, i] = st.pos[r].size
        return pt, lens

    def held_blocks(self, req_id: ReqId) -> int:
        return len(self.get(req_id).blocks)

    def ideal_blocks(self, req_id: ReqId) -> dict[str, int]:
        """Blocks other designs would hold for the same rows (:func:`design_bounds`)."""
        lengths = self.get(req_id).lengths.reshape(self.num_layers, self.num_kv_heads)
        return design_bounds(lengths, self.block_size)

    # ---------------------------------------------------------------- invariants
    def _debug_check(self, st: RowRequest) -> None:
        if self.debug:
            self.check_request(st)

    def check_request(self, st: RowRequest) -> None:
        """R1, R2, R4 and PINS for one request (O(pages + tokens))."""
        bs, P = self.block_size, self.pages_per_block
        for r in range(self.num_rows):
            p = st.pos[r]
            check(p.ndim == 1 and bool((np.diff(p) > 0).all()) and (not p.size or (p[0] >= 0 and p[-1] < st.logical_len)),
                  "I1", f"row request {st.req_id!r} row {r}: positions not ascending/unique/in range")
            check(len(st.pages[r]) == cdiv(p.size, bs), "I2",
                  f"row request {st.req_id!r} row {r}: {len(st.pages[r])} pages for {p.size} tokens")
        owned = set(st.blocks)
        check(len(owned) == len(st.blocks), "I2", f"row request {st.req_id!r}: a block listed twice")
        all_pages = [pg for row in st.pages for pg in row] + list(st.free)
        check(len(all_pages) == len(set(all_pages)) == len(st.blocks) * P, "I2",
              f"row request {st.req_id!r}: pages of its blocks are not each in one row or the free list")
        check(all(pg // P in owned for pg in all_pages), "I2", f"row request {st.req_id!r}: page outside its blocks")
        check(len(st.blocks) == max(cdiv(st.pages_used, P), st.hold), "I4",
              f"row request {st.req_id!r}: holds {len(st.blocks)} blocks for {st.pages_used} pages (P = {P}, hold "
              f"{st.hold})")
        self._check_pins_invariant(st)

    def _check_pins_invariant(self, st: RowRequest) -> None:
        try:
            self._check_pins(st, st.pos, st.logical_len)
        except ValueError as e:
            check(False, "PINS", str(e))

    def check_all(self, pool_used: set[int] | None = None) -> None:
        """Every request, plus exclusive ownership of blocks across requests (and, given the pool's used ids
        that belong to this table, that they are exactly the blocks held)."""
        seen: set[int] = set()
        for st in self.requests.values():
            self.check_request(st)
            check(not (seen & set(st.blocks)), "I2", f"row request {st.req_id!r} shares a block")
            seen |= set(st.blocks)
        if pool_used is not None:
            check(seen == pool_used, "POOL", f"table holds {sorted(seen)[:8]}, pool says {sorted(pool_used)[:8]}")
