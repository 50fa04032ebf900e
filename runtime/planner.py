"""Reclamation planner: liveness -> a move plan that makes eviction free whole blocks.

Pure numpy, vectorized over all rows and virtual slots of a request (the Python loop is over requests
only, never over tokens). The planner works in *virtual* slots; the cache turns them into physical
slots with the request's pre-plan block list and hands them to the copy engine.

compact (default): fill holes below the new length n = live with the live tokens above it
---------------------------------------------------------------------------------------------
    bs = 4, live n = 6                          x = evicted, letters = live tokens
    before   [a x b x] [x c x d] [e x f .]      3 blocks, cache_len 11
    vslot     0 1 2 3   4 5 6 7   8 9 10
    holes below n=6: {1, 3, 4}          live at >= 6: {d@7, e@8, f@10}    (paired in order)
    after    [a d b e] [f c . .]  (free)      2 blocks = ceil(6/4); moves = 3 <= evicted = 6

    #moves = #holes below n = #live tokens at or above n <= #dead tokens.  Holes and sources are
    paired row by row straight from ``np.nonzero`` (row-major order keeps rows aligned because each
    row has as many holes below n as live tokens above n). dst set (< n) and src set (>= n) are
    disjoint, so the copy engine may execute the moves in any order or chunking.

ordered: slide survivors down, preserving slot order (ALiBi / sliding-window kernels)
---------------------------------------------------------------------------------------------
    before   [a x b x] [x c x d] [e x f .]
    after    [a b c d] [e f . .]  (free)      moves = 5 (every survivor whose slot changes)
    Survivor k (k-th live slot s_k of its row) goes to d_k = k <= s_k. If slot x is written by
    move j and read by move i (d_j = s_i = x) then s_i = d_j <= s_j, so i <= j: a slot is always read
    no later than it is written. Executing each row's moves in ascending order (chunks in order,
    gather-before-scatter inside a chunk) is therefore safe even though src and dst sets overlap.

naive (the Naive-Evict baseline): no moves
---------------------------------------------------------------------------------------------
    before   [a x b x] [x x x x] [e x f .]
    after    [a x b x] [e x f .]              the all-dead block is dropped from the block table;
    a block returns to the pool only when every token ever placed in it is dead (in every row). The
    dead slots that remain are masked at attention time (their position is -1 in the slot store).
    New tokens append after the last slot in use (at cache_len).

How exactness ("an evicted token is never attended again") and I4 are guaranteed
---------------------------------------------------------------------------------------------
* ``apply_keep_mask`` marks dead in the table *and* queues "position := -1" for those slots, so even
  before any reclaim a dead slot is invalid for a position-aware attention (the reference kernel).
* Unmodified paged kernels cannot mask; so in compact/ordered mode ``VTokenCache.attention_metadata``
  reclaims every request that still has holes inside [0, cache_len) before handing out block tables and
  cache lengths. After a compact/ordered plan [0, n) is exactly the live set: no hole is visible.
* I4, never overlapping: ``reclaim`` fences the previous plan before planning, so at most one plan is
  in flight, and every tensor write (K/V writes, slot initialisation, stats access, attention
  metadata) fences first. Bookkeeping is updated at commit ("post-plan" view); tensors catch up at
  the fence, before anything can read them (I3).
* I4, useful: a plan is committed only for requests with dead tokens since their last reclaim, and
  (checked in debug mode by :func:`validate_plan`) it either strictly reduces the held blocks or fills
  holes below the new cache length that exact attention over unmodified kernels requires; its
  sources lie in the request's held blocks and its destinations below the new cache length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._debug import check
from .token_table import RequestState, cdiv

MODES = ("compact", "ordered", "naive")


@dataclass
class RequestPlan:
    """Moves for one request, in virtual slots. ``rows/src/dst`` are ``[M]`` int64."""

    req_id: object
    rows: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    new_cache_len: int
    keep_blocks: np.ndarray  # [nb] bool: which of the pre-plan blocks survive (a prefix unless naive)
    old_num_blocks: int

    @property
    def num_moves(self) -> int:
        return int(self.src.size)

    @property
    def blocks_freed(self) -> int:
        return int(self.old_num_blocks - self.keep_blocks.sum())


def plan_compact(live: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``live`` [R, U] bool with ``n`` live per row -> (rows, src, dst) [M]: holes < n <- live >= n."""
    hr, hc = np.nonzero(~live[:, :n])
    sr, sc = np.nonzero(live[:, n:])
    check(hr.size == sr.size and bool((hr == sr).all()), "I1",
          f"compact plan: {hr.size} holes below n={n} but {sr.size} live tokens above it")
    return hr.astype(np.int64), (sc + n).astype(np.int64), hc.astype(np.int64)


def plan_ordered(live: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``live`` [R, U] -> (rows, src, dst) [M]: k-th survivor of a row moves to slot k (if it differs)."""
    r, c = np.nonzero(live)
    check(c.size == live.shape[0] * n, "I1", f"ordered plan: {c.size} live cells != R * n = {live.shape[0] * n}")
    d = np.tile(np.arange(n, dtype=np.int64), live.shape[0])
    m = c != d
    return r[m].astype(np.int64), c[m].astype(np.int64), d[m]


def plan_naive(live: np.ndarray, cache_len: int, block_size: int) -> np.ndarray:
    """``live`` [R, nb * bs] -> keep [nb] bool: a block survives while any of its tokens is live."""
    nb = cdiv(cache_len, block_size)
    return live[:, : nb * block_size].reshape(live.shape[0], nb, block_size).any(axis=(0, 2))


def plan_request(st: RequestState, mode: str) -> RequestPlan:
    """Plan one request (vectorized over its rows and slots)."""
    bs, n, u = st.block_size, st.num_live, st.cache_len
    nb = len(st.blocks)
    live = st.live[:, :u]
    empty = np.zeros(0, np.int64)
    if mode == "naive":
        return RequestPlan(st.req_id, empty, empty, empty, -1, plan_naive(st.live, u, bs), nb)
    if mode == "compact":
        rows, src, dst = plan_compact(live, n)
    elif mode == "ordered":
        rows, src, dst = plan_ordered(live, n)
    else:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    keep = np.zeros(nb, dtype=bool)
    keep[: cdiv(n, bs)] = True
    return RequestPlan(st.req_id, rows, src, dst, n, keep, nb)


def plan_batch(states: list[RequestState], mode: str) -> list[RequestPlan]:
    """Plan every request in ``states`` (a loop over requests; each request is one vectorized pass)."""
    return [plan_request(st, mode) for st in states]


def validate_plan(st: RequestState, plan: RequestPlan, mode: str) -> None:
    """Debug-mode I1/I4 checks of a plan against the *pre-plan* table (raises InvariantError)."""
    u, n = st.cache_len, st.num_live
    if mode == "naive":
        check(plan.num_moves == 0, "I4", "naive plan moves tokens")
        return
    check(bool((plan.src < u).all()) and bool((plan.src >= 0).all()), "I4",
          f"request {st.req_id!r}: plan reads outside the held slots [0, {u})")
    check(bool((plan.dst < n).all()), "I4", f"request {st.req_id!r}: plan writes at/after new length {n}")
    check(bool(st.live[plan.rows, plan.src].all()), "I1", f"request {st.req_id!r}: plan moves a dead token")
    if mode == "compact":
        check(not st.live[plan.rows, plan.dst].any(), "I1",
              f"request {st.req_id!r}: compact plan overwrites a live token")
    pairs = plan.rows * max(u, 1) + plan.dst
    check(np.unique(pairs).size == pairs.size, "I2", f"request {st.req_id!r}: two moves target one slot")
    holes_below = int((~st.live[:, :n]).sum())
    check(plan.blocks_freed > 0 or holes_below > 0 or u > n, "I4",
          f"request {st.req_id!r}: plan neither frees a block nor fills a hole nor shrinks the cache")
