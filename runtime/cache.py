"""VTokenCache: the thin coordinator the adapters share (through :mod:`vtoken_runtime.eviction`).

It owns no bookkeeping of its own: the token table (``token_table.py``) owns liveness and positions,
the slot store (``slot_stats.py``) the per-slot statistics, the pool the block ids, the copy engine
the moves. What the cache adds is the ORDER in which they may run (the fences):

    reserve(req, T) -> slots [T]          pool.allocate + table.reserve; None = out of blocks (caller preempts)
    write_kv_slots(layer, slots, k, v)    fences (I3), then writes K/V
    attention_metadata(reqs)              compact/ordered: reclaims requests with holes, fences (I3)
    ... attention, stats collection ...   scatter_stats / accumulate_stats / stats_update_handles (writes)
    live_view(req) -> policy -> apply_keep_mask(req, keep)       table.mark_dead
    reclaim()                              planner -> table.commit -> pool.free -> engine.submit (async)
    fence()                                waits for the copies, then applies deferred slot writes

Bookkeeping is always "post-plan": a committed plan is reflected immediately in block tables, cache
lengths and the free list, while tensors catch up at ``fence()``. Everything that *reads or writes*
tensors fences first, so nothing can observe a half-moved cache (I3), and ``reclaim`` fences the
previous plan before planning a new one (I4: plans never overlap). Small tensor side effects of pure
bookkeeping calls (initialising positions/stats of newly reserved slots, marking evicted slots dead)
are queued and applied in order at the fence, after the in-flight plan, so they never race with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._debug import InvariantError, debug_enabled
from .block_pool import BlockPool
from .cache_queries import CacheQueries
from .copy_engine import KV_LAYOUTS, CopyEngine, CopyPlan
from .copy_engine import kv_views as kv_views_of
from .paged_attention import paged_attention
from .planner import MODES, plan_batch, validate_plan
from .slot_stats import SlotStore
from .token_table import AttentionMetadata, TokenTable, normalize_pins, slot_index

GRANULARITIES = ("request", "head")
ReqId = Hashable
KVPair = tuple[torch.Tensor, torch.Tensor]


@dataclass
class ReclaimStats:
    """What one :meth:`VTokenCache.reclaim` did (moves and evictions count row-tokens)."""

    requests: int = 0
    tokens_moved: int = 0
    tokens_evicted: int = 0
    blocks_freed: int = 0
    bytes_moved: int = 0
    plan_seconds: float = 0.0


class VTokenCache(CacheQueries):
    """Paged KV cache with token-level eviction that frees whole blocks.

    K/V per layer: ``kv_caches`` in ``kv_layout`` (``generic``: ``[2, NB, bs, H_kv, D]`` or a (K, V) pair;
    ``vllm_cpu``: ``[NB, H_kv, bs, 2*D]``), allocated here when None. ``kv_views`` (optional) are the
    ``[NB, bs, H_kv, D]`` (K, V) views of each layer the attention reference reads (any strides: a
    probed vLLM layout; for a layer whose layout cannot be viewed per token, None (nothing may read it,
    :meth:`kv_pair`) or a pair of element-map readers that only :meth:`gather_kv_vectors` indexes); ``pool`` and ``copy_engine`` (a factory called like :class:`CopyEngine`) let an
    engine drive allocation and moves on its own tensors. Rows R = 1 (``"request"``) or
    ``num_layers * num_kv_heads`` (``"head"``; row r = layer * H_kv + head).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, block_size: int, num_blocks: int,
                 granularity: str = "request", mode: str = "compact", kv_layout: str = "generic",
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 stat_names: Sequence[str] = (), max_requests: int = 256, max_blocks_per_request: int | None = None,
                 kv_caches: Sequence[torch.Tensor | KVPair] | None = None, async_copy: bool = True,
                 debug: bool | None = None, copy_chunk_bytes: int = 2 << 20, copy_path: str | None = None,
                 kv_views: Sequence[tuple[Any, Any] | None] | None = None, pool: BlockPool | None = None,
                 copy_engine: Callable[..., CopyEngine] = CopyEngine) -> None:
        for what, val, allowed in (("granularity", granularity, GRANULARITIES), ("mode", mode, MODES),
                                   ("kv_layout", kv_layout, KV_LAYOUTS)):
            if val not in allowed:
                raise ValueError(f"unknown {what} {val!r}; expected one of {allowed}")
        for name, val in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_size", head_size),
                          ("block_size", block_size), ("num_blocks", num_blocks), ("max_requests", max_requests)):
            if int(val) <= 0:
                raise ValueError(f"{name} must be positive, got {val}")
        self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
        self.block_size, self.num_blocks = block_size, num_blocks
        self.granularity, self.mode, self.kv_layout = granularity, mode, kv_layout
        self.dtype, self.device = dtype, torch.device(device)
        self.debug = debug_enabled(debug)
        self.num_rows = num_layers * num_kv_heads if granularity == "head" else 1
        self.num_slots = num_blocks * block_size
        self.max_blocks_per_request = max_blocks_per_request or num_blocks
        if kv_caches is None:
            shape = ((num_blocks, num_kv_heads, block_size, 2 * head_size) if kv_layout == "vllm_cpu"
                     else (2, num_blocks, block_size, num_kv_heads, head_size))
            kv_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        if len(kv_caches) != num_layers:
            raise ValueError(f"kv_caches has {len(kv_caches)} layers, expected {num_layers}")
        self.kv_caches = list(kv_caches)
        views = list(kv_views) if kv_views is not None else [kv_views_of(t, kv_layout, head_size) for t in self.kv_caches]
        if len(views) != num_layers:
            raise ValueError(f"kv_views has {len(views)} layers, expected {num_layers}")
        self._kv: list[tuple[Any, Any] | None] = views
        self.pool = pool if pool is not None else BlockPool(num_blocks, debug=self.debug)
        self.table = TokenTable(self.num_rows, block_size, max_requests, self.max_blocks_per_request, self.device)
        self.store = SlotStore(num_layers, num_kv_heads, self.num_slots, self.num_rows, stat_names, self.device)
        self.engine = copy_engine(self.kv_caches, kv_layout, num_kv_heads, head_size, block_size, num_blocks,
                                  self.store, per_head=granularity == "head", async_copy=async_copy,
                                  chunk_bytes=copy_chunk_bytes, cpu_path=copy_path)
        # compact plans never overlap sources and destinations: the Triton runner moves them in one launch
        self.engine.planner_mode = "compact" if mode == "compact" else "ordered"
        # Persistent metadata outputs (static addresses; attention_metadata returns views of these).
        mr, dev = max_requests, self.device
        self._md_rows = torch.zeros(mr, dtype=torch.int64, device=dev)
        self._md_bt = torch.full((mr, self.max_blocks_per_request), -1, dtype=torch.int32, device=dev)
        self._md_lens = torch.zeros(mr, dtype=torch.int32, device=dev)
        self._md_logical = torch.zeros(mr, dtype=torch.int32, device=dev)
        # Deferred slot-store writes, applied in order at fence(): ("init", slots, pos) / ("kill", rows, slots)
        self._deferred: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self.tokens_moved_total = self.tokens_evicted_total = self.blocks_freed_total = self.preemptions = 0
        self.last_reclaim = ReclaimStats()
        # other owners of this pool's blocks (the HF adapter's per-row pages): the POOL check counts theirs too
        self._pool_holders: list[Callable[[], Iterable[int]]] = []

    # ================================================================ request lifecycle
    def add_request(self, req_id: ReqId, pinned_positions: Iterable[int] | np.ndarray | None = None) -> int | None:
        """Register a request. ``pinned_positions``: true positions never to be evicted (sinks, ...).
        Returns its mirror row, or None when all ``max_requests`` rows are taken."""
        st = self.table.add(req_id, normalize_pins(pinned_positions))
        return None if st is None else st.row

    def set_pins(self, req_id: ReqId, pinned_positions: Iterable[int] | np.ndarray) -> None:
        """Replace the pinned positions of a request: true positions never to be evicted from now on
        (positions not reached yet are pinned when they arrive). Every present pin must still be live in
        every row (ValueError otherwise; nothing changes)."""
        self.table.set_pins(req_id, normalize_pins(pinned_positions))

    def reserve(self, req_id: ReqId, num_new_tokens: int) -> np.ndarray | None:
        """Reserve slots for the next ``num_new_tokens`` tokens (true positions logical_len, ...).

        Returns physical slot ids ``[T]`` int64, the same in every row (new tokens take the same
        virtual slots in every row). Returns None, changing nothing, when the pool is out of blocks
        (the caller preempts). Bookkeeping only: never waits on copies.
        """
        need = self.table.blocks_needed(req_id, num_new_tokens)
        new = self.pool.allocate(need) if need else []
        if new is None:
            return None
        slots, pos = self.table.reserve(req_id, num_new_tokens, new)
        if slots.size:
            pos_t = self._upload(pos)[None, :].expand(self.num_rows, pos.size)
            self._deferred.append(("init", self._upload(slots), pos_t))
        self._check()
        return slots

    def free(self, req_id: ReqId) -> int:
        """Finish a request: return all its blocks (tail first). Returns the number of blocks freed.
        Freeing an unknown or already freed request raises ValueError."""
        st = self.table.remove(req_id)
        self.pool.free(st.blocks)
        self._check()
        return len(st.blocks)

    def release(self, req_id: ReqId) -> list[int]:
        """Hand a request's blocks to another owner of this pool (per-row pages, issue 38): the request leaves
        the token table and its blocks stay allocated (refcount 1), now the caller's to free. Fences first,
        so no copy still targets them."""
        self.fence()
        st = self.table.remove(req_id)
        return list(st.blocks)

    def add_pool_holder(self, held: Callable[[], Iterable[int]]) -> None:
        """Register another owner of this pool's blocks (``held()``: the ids it holds, one per reference), so
        the POOL invariant (:meth:`check_invariants`) counts them."""
        self._pool_holders.append(held)

    def preempt(self, req_id: ReqId) -> int:
        """Drop a request for recompute: frees everything; it may be added again under the same id."""
        self.preemptions += 1
        return self.free(req_id)

    def fork(self, src: ReqId, dst: ReqId, pinned_positions: Iterable[int] | None = None) -> np.ndarray | None:
        """Add ``dst`` as a copy of ``src`` (its tokens, evictions, K/V, stats and positions), e.g. one
        shared prefill for many policies. Returns ``dst``'s physical slots in use, or None (changing
        nothing) when rows or blocks run out."""
        n_blocks = self.held_blocks(src)
        if self.add_request(dst, pinned_positions) is None:
            return None
        new = self.pool.allocate(n_blocks) if n_blocks else []
        if new is None:
            self.table.remove(dst)
            return None
        s, d = self.table.fork(src, dst, new)
        self.fence()
        rows = np.repeat(np.arange(self.num_rows, dtype=np.int64), s.size)
        self.engine.submit(CopyPlan(rows, np.tile(s, self.num_rows), np.tile(d, self.num_rows)))
        self._check()
        return d

    def close(self) -> None:
        """Land in-flight copies (call before dropping the cache)."""
        self.fence()

    # ================================================================ K/V writes and reads
    def write_kv(self, layer: int, req_id: ReqId, k: torch.Tensor, v: torch.Tensor, offset: int = 0) -> None:
        """Write ``k, v [T, H_kv, D]`` for tokens ``offset .. offset+T-1`` of the last :meth:`reserve`
        (ValueError past the reserved slots, or after a keep mask / reclaim invalidated them)."""
        self.write_kv_slots(layer, self.table.pending_slots(req_id, offset, int(k.shape[0])), k, v)

    def write_kv_slots(self, layer: int, slots: np.ndarray | torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Batched raw write (vLLM's reshape_and_cache): ``k, v [T, H_kv, D]`` into physical ``slots [T]``.
        Fences first (the slots may be sources of an in-flight plan)."""
        self._check_layer(layer)
        exp = (self.num_kv_heads, self.head_size)
        if k.dim() != 3 or tuple(k.shape[1:]) != exp or k.shape != v.shape:
            raise ValueError(f"k/v must be [T, {exp[0]}, {exp[1]}], got {tuple(k.shape)} / {tuple(v.shape)}")
        s = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        if s.numel() != k.shape[0]:
            raise ValueError(f"{s.numel()} slots for {k.shape[0]} tokens")
        if s.numel() and (int(s.min()) < 0 or int(s.max()) >= self.num_slots):
            raise ValueError(f"slot ids must lie in [0, {self.num_slots})")
        self.fence()
        kc, vc = self.kv_pair(layer)
        kc[s // self.block_size, s % self.block_size] = k.to(self.dtype)
        vc[s // self.block_size, s % self.block_size] = v.to(self.dtype)

    # ================================================================ logical view and eviction
    def apply_keep_mask(self, req_id: ReqId, keep: np.ndarray | torch.Tensor) -> int:
        """Evict the tokens where ``keep [R, n_live]`` (order of :meth:`live_view`) is False.

        Every row must keep the same number of tokens and every present pinned position must be kept
        (ValueError otherwise; nothing changes). Returns the number of row-tokens evicted. The slots
        stay allocated until :meth:`reclaim`; they are marked dead (position -1) at the next fence.
        """
        km = keep.detach().cpu().numpy() if isinstance(keep, torch.Tensor) else np.asarray(keep)
        rows, slots = self.table.mark_dead(req_id, km)
        if rows.size:
            self.tokens_evicted_total += int(rows.size)
            self._deferred.append(("kill", self._upload(rows), self._upload(slots)))
            self._check()
        return int(rows.size)

    # ================================================================ reclamation
    def reclaim(self, req_ids: Iterable[ReqId] | None = None) -> ReclaimStats:
        """Plan and commit reclamation for ``req_ids`` (default: all) with evictions since their last
        reclaim; submit the copies (asynchronously) and free tail blocks. Fences the previous plan
        first, so plans never overlap (I4)."""
        self.fence()
        states = ([self.table.get(r) for r in req_ids] if req_ids is not None
                  else list(self.table.requests.values()))
        states = [st for st in states if st.evicted_since_reclaim > 0]
        t0 = time.perf_counter()
        plans = plan_batch(states, self.mode)
        stats = ReclaimStats(requests=len(states), plan_seconds=time.perf_counter() - t0)
        rows, srcs, dsts = [], [], []
        for st, plan in zip(states, plans, strict=True):
            if self.debug:
                validate_plan(st, plan, self.mode)
            if plan.num_moves:
                rows.append(plan.rows)
                srcs.append(st.phys(plan.src))  # pre-plan block list
                dsts.append(st.phys(plan.dst))
            stats.tokens_evicted += st.evicted_since_reclaim
            stats.tokens_moved += plan.num_moves
            stats.blocks_freed += plan.blocks_freed
            self.pool.free(self.table.commit(st, plan, self.mode, debug=self.debug))  # walks tail first
        if rows:
            cp = CopyPlan(np.concatenate(rows), np.concatenate(srcs), np.concatenate(dsts))
            stats.bytes_moved = cp.num_moves * self.engine.row_bytes()
            self.engine.submit(cp)
        self.tokens_moved_total += stats.tokens_moved
        self.blocks_freed_total += stats.blocks_freed
        self.last_reclaim = stats
        self._check()
        return stats

    def fence(self) -> None:
        """Wait for in-flight copies (I3), then apply deferred slot-store writes in order."""
        self.engine.fence()
        if self._deferred:
            ops, self._deferred = self._deferred, []
            for kind, a, b in ops:
                (self.store.init_slots if kind == "init" else self.store.kill_slots)(a, b)

    def _upload(self, a: np.ndarray) -> torch.Tensor:
        """Host indices to the cache's device without synchronising (CUDA: pinned, non-blocking; the
        caching host allocator keeps the staging memory alive until the copy ran)."""
        t = torch.from_numpy(np.ascontiguousarray(a))
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    @property
    def in_flight(self) -> bool:
        """True while a plan or deferred slot writes have not been fenced."""
        return self.engine.in_flight or bool(self._deferred)

    # ================================================================ attention
    def attention_metadata(self, req_ids: Sequence[ReqId], fence: bool = True,
                           reclaim_holes: bool = True) -> AttentionMetadata:
        """Block tables / lengths for a batch, as views of persistent buffers.

        compact/ordered: requests with holes are reclaimed first (exactness with unmodified kernels).
        ``fence=True`` waits for copies; ``fence=False`` raises ``RuntimeError("I3 violated ...")`` if
        anything is still in flight (for callers that promise to have fenced)."""
        states = [self.table.get(r) for r in req_ids]
        B = len(states)
        if B > self.table.max_requests:
            raise ValueError(f"batch of {B} exceeds max_requests={self.table.max_requests}")
        if self.mode != "naive" and reclaim_holes:
            dirty = [st.req_id for st in states if st.holes]
            if dirty:
                if not fence:
                    raise InvariantError("I3", f"requests {dirty[:4]} have unreclaimed holes")
                self.reclaim(dirty)
        if fence:
            self.fence()
        elif self.in_flight:
            raise InvariantError("I3", "attention metadata requested while a plan is in flight (call fence())")
        self.table.flush_mirror()
        rows = self._md_rows[:B]
        rows.copy_(self._upload(np.fromiter((st.row for st in states), dtype=np.int64, count=B)))
        torch.index_select(self.table.block_tables, 0, rows, out=self._md_bt[:B])
        torch.index_select(self.table.cache_lens, 0, rows, out=self._md_lens[:B])
        torch.index_select(self.table.logical_lens, 0, rows, out=self._md_logical[:B])
        return AttentionMetadata(list(req_ids), rows, self._md_bt[:B], self._md_lens[:B], self._md_logical[:B],
                                 needs_mask=any(st.holes for st in states))

    def attention(self, layer: int, query: torch.Tensor, md: AttentionMetadata, query_pos: torch.Tensor,
                  return_probs: bool = False, scale: float | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Reference paged attention of ``query [B, Q, H_q, D]`` (true ``query_pos [B, Q]``, -1 = pad)
        over this cache, masking by true key position (exact in every mode). Raises "I3 violated" if
        a plan is in flight."""
        if self.in_flight:
            raise InvariantError("I3", "attention over a cache with an unfenced plan or deferred writes")
        kc, vc = self.kv_pair(layer)
        return paged_attention(query, kc, vc, md.block_tables, md.cache_lens, query_pos,
                               key_positions=self.store.layer_positions(layer), scale=scale,
                               return_probs=return_probs)

    # ================================================================ statistics (the slot store's writers)
    def scatter_stats(self, name: str, layer: int, slots: torch.Tensor, values: torch.Tensor,
                      reduce: str = "set") -> None:
        """Write ``values [H_kv, M]`` into stat ``name`` of ``layer`` at physical ``slots [M]`` (distinct):
        overwrite (``"set"``), add (``"sum"``) or multiply (``"scale"``). Fences first."""
        self.fence()
        self.store.scatter(name, layer, slots, values, reduce)

    def stats_update_handles(self, layer: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """For a statistics kernel that updates the store in place: name -> ``[H_kv, num_slots]`` float32
        of ``layer`` (:meth:`SlotStore.update_handles`). Fences first. The views keep their addresses for the
        cache's life; a kernel that writes through them later fences again first (moves change contents)."""
        self.fence()
        return self.store.update_handles(layer, names)

    def accumulate_stats(self, name: str, layer: int, md: AttentionMetadata, values: torch.Tensor,
                         reduce: str = "sum") -> None:
        """Scatter ``values [B, H_kv, max_len]`` (indexed by virtual slot, e.g. ``probs.sum(2)`` of
        :func:`paged_attention`) into stat ``name`` of ``layer``: add (``"sum"``), overwrite (``"set"``)
        or multiply (``"scale"``)."""
        self.fence()
        b_idx, j_idx, slots = self.visible_slots(md, values.shape[-1])
        self.store.scatter(name, layer, slots, values[b_idx, :, j_idx].T, reduce)

    def visible_slots(self, md: AttentionMetadata, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(b_idx [M], j_idx [M], slots [M])``: the (request, virtual slot) pairs of a batch inside
        its cache lengths and their physical slots. The same for every layer and statistic of a step:
        computed once per metadata object."""
        hit = md.scatter_cache.get(width)
        if hit is None:
            slot, ok = slot_index(md.block_tables, md.cache_lens, width, self.block_size)
            b_idx, j_idx = torch.nonzero(ok, as_tuple=True)
            hit = md.scatter_cache[width] = (b_idx, j_idx, slot[b_idx, j_idx])
        return hit
