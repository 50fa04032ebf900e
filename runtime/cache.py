"""VTokenCache: the facade the adapters (HF transformers, vLLM) share.

It ties together the block pool (ids), the token table (per-request, per-row liveness and positions),
the slot store (per-slot stats and true positions), the planner (liveness -> moves) and the copy
engine (moves K/V + stats + positions in place, asynchronously).

Per engine step (see docs/architecture.md):

    reserve(req, T) -> slots [T]          bookkeeping only; None = out of blocks (caller preempts)
    write_kv(layer, req, k, v)            fences (I3), then writes K/V of the reserved tokens
    attention_metadata(reqs)              compact/ordered: reclaims requests with holes, fences (I3)
    ... attention, stats collection ...   stats_tensor(name) / accumulate_stats(...)
    live_view(req) -> policy -> apply_keep_mask(req, keep)
    reclaim()                              plans, commits bookkeeping, frees tail blocks, submits copies
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
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ._debug import InvariantError, check, debug_enabled
from .block_pool import BlockPool
from .copy_engine import KV_LAYOUTS, CopyEngine, CopyPlan
from .paged_attention import paged_attention
from .planner import MODES, RequestPlan, plan_batch, validate_plan
from .slot_stats import SlotStore
from .token_table import RequestState, TokenTable, cdiv

GRANULARITIES = ("request", "head")
ReqId = Hashable


@dataclass
class ReclaimStats:
    """What one :meth:`VTokenCache.reclaim` did (moves and evictions count row-tokens)."""

    requests: int = 0
    tokens_moved: int = 0
    tokens_evicted: int = 0
    blocks_freed: int = 0
    bytes_moved: int = 0
    plan_seconds: float = 0.0


@dataclass
class AttentionMetadata:
    """Views of persistent buffers (static ``data_ptr()``), valid until the next metadata call.

    block_tables [B, max_blocks_per_request] int32 (-1 past held blocks), cache_lens [B] int32,
    logical_lens [B] int32 (true sequence lengths: positions, RoPE), rows [B] int64 (mirror rows).
    ``needs_mask``: dead slots lie inside some cache length (naive mode): the kernel must mask slots
    whose true position is < 0 (``VTokenCache.key_positions(layer)``) or use ``slot_valid``.
    """

    req_ids: list[ReqId]
    rows: torch.Tensor
    block_tables: torch.Tensor
    cache_lens: torch.Tensor
    logical_lens: torch.Tensor
    needs_mask: bool
    scatter_cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class VTokenCache:
    """Paged KV cache with token-level eviction that frees whole blocks.

    Shapes: K/V per layer ``[num_blocks, block_size, H_kv, D]`` (generic; one ``[2, ...]`` tensor or a
    (K, V) pair) or ``[num_blocks, H_kv, block_size, 2*D]`` (vllm_cpu). Rows R = 1 (``"request"``) or
    ``num_layers * num_kv_heads`` (``"head"``; row r = layer * H_kv + head).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        num_blocks: int,
        granularity: str = "request",
        mode: str = "compact",
        kv_layout: str = "generic",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        stat_names: Sequence[str] = (),
        max_requests: int = 256,
        max_blocks_per_request: int | None = None,
        kv_caches: list[torch.Tensor] | list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        async_copy: bool = True,
        debug: bool | None = None,
        copy_chunk_bytes: int = 2 << 20,
    ) -> None:
        if granularity not in GRANULARITIES:
            raise ValueError(f"unknown granularity {granularity!r}; expected one of {GRANULARITIES}")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"unknown kv_layout {kv_layout!r}; expected one of {KV_LAYOUTS}")
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
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        for t in self.kv_caches:
            if kv_layout == "vllm_cpu":
                assert isinstance(t, torch.Tensor)
                self._k.append(t[..., :head_size].permute(0, 2, 1, 3))  # [NB, bs, H, D] view
                self._v.append(t[..., head_size:].permute(0, 2, 1, 3))
            else:
                k, v = t if isinstance(t, tuple) else (t[0], t[1])
                self._k.append(k)
                self._v.append(v)

        self.pool = BlockPool(num_blocks, debug=self.debug)
        self.table = TokenTable(self.num_rows, block_size, max_requests, self.max_blocks_per_request, self.device)
        self.store = SlotStore(num_layers, num_kv_heads, self.num_slots, self.num_rows, stat_names, self.device)
        self.engine = CopyEngine(self.kv_caches, kv_layout, num_kv_heads, head_size, block_size, num_blocks,
                                 self.store, per_head=granularity == "head", async_copy=async_copy,
                                 chunk_bytes=copy_chunk_bytes)
        # Persistent metadata outputs (static addresses; attention_metadata returns views of these).
        self._md_rows = torch.zeros(max_requests, dtype=torch.int64, device=self.device)
        self._md_bt = torch.full((max_requests, self.max_blocks_per_request), -1, dtype=torch.int32,
                                 device=self.device)
        self._md_lens = torch.zeros(max_requests, dtype=torch.int32, device=self.device)
        self._md_logical = torch.zeros(max_requests, dtype=torch.int32, device=self.device)
        # Deferred slot-store writes, applied in order at fence(): ("init", slots, pos) / ("kill", rows, slots)
        self._deferred: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self.tokens_moved_total = 0
        self.tokens_evicted_total = 0
        self.blocks_freed_total = 0
        self.preemptions = 0
        self.last_reclaim = ReclaimStats()

    # ================================================================ request lifecycle
    def add_request(self, req_id: ReqId, pinned_positions: Iterable[int] | np.ndarray | None = None) -> int | None:
        """Register a request. ``pinned_positions``: true positions never to be evicted (sinks, ...).
        Returns its mirror row, or None when all ``max_requests`` rows are taken."""
        pins = np.unique(np.asarray([] if pinned_positions is None else list(np.asarray(pinned_positions).ravel()),
                                    dtype=np.int64))
        if pins.size and pins[0] < 0:
            raise ValueError(f"pinned positions must be >= 0, got {pins[:4].tolist()}")
        st = self.table.add(req_id, pins)
        return None if st is None else st.row

    def set_pins(self, req_id: ReqId, pinned_positions: Iterable[int] | np.ndarray) -> None:
        """Replace the pinned positions of a request (all currently present pins must be live)."""
        st = self.table.get(req_id)
        pins = np.unique(np.asarray(list(np.asarray(pinned_positions).ravel()), dtype=np.int64))
        present = pins[pins < st.logical_len]
        for r in range(self.num_rows):
            gone = present[~np.isin(present, st.pos[r][st.live[r]])]
            if gone.size:
                raise ValueError(f"request {req_id!r}: cannot pin already evicted positions {gone[:8].tolist()}")
        st.pinned = pins

    def reserve(self, req_id: ReqId, num_new_tokens: int) -> np.ndarray | None:
        """Reserve slots for the next ``num_new_tokens`` tokens (true positions logical_len, ...).

        Returns physical slot ids ``[T]`` int64. New tokens take the same virtual slots in every row,
        so the slots are the same for every row (layer, KV head). Returns None, changing nothing, when
        the pool is out of blocks (the caller preempts). Bookkeeping only: never waits on copies.
        """
        st = self.table.get(req_id)
        n = int(num_new_tokens)
        if n < 0:
            raise ValueError(f"request {req_id!r}: cannot reserve a negative number of tokens ({n})")
        bs = self.block_size
        need = cdiv(st.used + n, bs) - len(st.blocks)
        if len(st.blocks) + need > self.max_blocks_per_request:
            raise ValueError(f"request {req_id!r}: {st.used + n} slots exceed max_blocks_per_request="
                             f"{self.max_blocks_per_request} x block_size={bs}")
        if need > 0:
            new = self.pool.allocate(need)
            if new is None:
                return None
            st.blocks.extend(new)
            st.grow(st.capacity)
        v = np.arange(st.used, st.used + n, dtype=np.int64)
        p = np.arange(st.logical_len, st.logical_len + n, dtype=np.int64)
        st.pos[:, v] = p
        st.live[:, v] = True
        st.naive_append(st.logical_len, n)
        st.used += n
        st.logical_len += n
        st.num_live += n
        st.pending = v
        slots = st.phys(v)
        if n:
            pos_t = torch.as_tensor(p, device=self.device)[None, :].expand(self.num_rows, n)
            self._deferred.append(("init", torch.as_tensor(slots, device=self.device), pos_t))
        self.table.sync_mirror(st)
        if self.debug:
            self.check_invariants()
        return slots

    def free(self, req_id: ReqId) -> int:
        """Finish a request: return all its blocks (tail first). Returns the number of blocks freed.
        Freeing an unknown or already freed request raises ValueError."""
        st = self.table.remove(req_id)
        self.pool.free(st.blocks)
        if self.debug:
            self.check_invariants()
        return len(st.blocks)

    def preempt(self, req_id: ReqId) -> int:
        """Drop a request for recompute: frees everything; it may be added again under the same id."""
        self.preemptions += 1
        return self.free(req_id)

    def close(self) -> None:
        """Land in-flight copies (call before dropping the cache)."""
        self.fence()

    # ================================================================ K/V writes and reads
    def key_cache(self, layer: int) -> torch.Tensor:
        """``[num_blocks, block_size, H_kv, D]`` view of layer ``layer``'s keys (any strides)."""
        return self._k[layer]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def key_positions(self, layer: int) -> torch.Tensor:
        """``[H_kv or 1, num_slots]`` int64 true position per physical slot (-1 = empty/evicted)."""
        return self.store.layer_positions(layer)

    def write_kv(self, layer: int, req_id: ReqId, k: torch.Tensor, v: torch.Tensor, offset: int = 0) -> None:
        """Write ``k, v [T, H_kv, D]`` for tokens ``offset .. offset+T-1`` of the last :meth:`reserve`.

        Writing past the reserved slots, or after a keep mask / reclaim invalidated them, is a
        ValueError. Fences first (the slots may be sources of an in-flight plan)."""
        st = self.table.get(req_id)
        T = int(k.shape[0])
        if offset < 0 or offset + T > st.pending.size:
            raise ValueError(
                f"request {req_id!r}: writing tokens [{offset}, {offset + T}) past the {st.pending.size} slots "
                "reserved by its last reserve() (apply_keep_mask/reclaim invalidate pending reservations)")
        self.write_kv_slots(layer, st.phys(st.pending[offset:offset + T]), k, v)

    def write_kv_slots(self, layer: int, slots: np.ndarray | torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Batched raw write (vLLM's reshape_and_cache): ``k, v [T, H_kv, D]`` into physical ``slots [T]``."""
        self._check_layer(layer)
        exp = (self.num_kv_heads, self.head_size)
        if k.dim() != 3 or tuple(k.shape[1:]) != exp or k.shape != v.shape:
            raise ValueError(f"k/v must be [T, {exp[0]}, {exp[1]}], got {tuple(k.shape)} / {tuple(v.shape)}")
        s = torch.as_tensor(np.asarray(slots) if not isinstance(slots, torch.Tensor) else slots,
                            dtype=torch.int64, device=self.device)
        if s.numel() != k.shape[0]:
            raise ValueError(f"{s.numel()} slots for {k.shape[0]} tokens")
        if s.numel() and (int(s.min()) < 0 or int(s.max()) >= self.num_slots):
            raise ValueError(f"slot ids must lie in [0, {self.num_slots})")
        self.fence()
        blk, off = s // self.block_size, s % self.block_size
        self._k[layer][blk, off] = k.to(self.dtype)
        self._v[layer][blk, off] = v.to(self.dtype)

    def gather_kv(self, layer: int, req_id: ReqId) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Live K/V of a request in logical order: ``(positions [H_kv or 1, n], k [H_kv, n, D], v [H_kv, n, D])``."""
        self._check_layer(layer)
        st = self.table.get(req_id)
        self.fence()
        pos, vs = self.table.live_view(st)
        phys = st.phys(vs)  # [R, n]
        H = self.num_kv_heads
        if self.num_rows == 1:
            s = torch.as_tensor(phys[0], device=self.device)
            b, o = s // self.block_size, s % self.block_size
            k = self._k[layer][b, o].permute(1, 0, 2)
            v = self._v[layer][b, o].permute(1, 0, 2)
            return torch.as_tensor(pos, device=self.device), k, v
        s = torch.as_tensor(phys[layer * H:(layer + 1) * H], device=self.device)  # [H, n]
        b, o = s // self.block_size, s % self.block_size
        h = torch.arange(H, device=self.device)[:, None].expand_as(s)
        return (torch.as_tensor(pos[layer * H:(layer + 1) * H], device=self.device),
                self._k[layer][b, o, h], self._v[layer][b, o, h])

    # ================================================================ logical view and eviction
    def live_view(self, req_id: ReqId) -> tuple[np.ndarray, np.ndarray]:
        """``(positions [R, n_live] int64 ascending per row, vslots [R, n_live] int64)``: what policies see."""
        return self.table.live_view(self.table.get(req_id))

    def apply_keep_mask(self, req_id: ReqId, keep: np.ndarray | torch.Tensor) -> int:
        """Evict the tokens where ``keep [R, n_live]`` (order of :meth:`live_view`) is False.

        Every row must keep the same number of tokens and every present pinned position must be kept
        (ValueError otherwise; nothing changes). Returns the number of row-tokens evicted. The slots
        stay allocated until :meth:`reclaim`; they are marked dead (position -1) at the next fence.
        """
        st = self.table.get(req_id)
        km = keep.detach().cpu().numpy() if isinstance(keep, torch.Tensor) else np.asarray(keep)
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
                             f"{sorted(set(kept.tolist()))} (one block table per request, decision 4)")
        pos, vs = self.table.live_view(st)
        r, c = np.nonzero(~km)
        if r.size == 0:
            return 0
        if st.pinned.size:
            bad = np.isin(pos[r, c], st.pinned)
            if bad.any():
                raise ValueError(f"request {req_id!r}: keep mask evicts pinned position(s) "
                                 f"{np.unique(pos[r, c][bad])[:8].tolist()}")
        dead = vs[r, c]
        st.live[r, dead] = False
        st.num_live = int(kept[0])
        st.evicted_since_reclaim += int(r.size)
        st.holes = True
        st.pending = np.zeros(0, np.int64)
        self.tokens_evicted_total += int(r.size)
        self._deferred.append(("kill", torch.as_tensor(r, device=self.device),
                               torch.as_tensor(st.phys(dead), device=self.device)))
        if self.debug:
            self.check_invariants()
        return int(r.size)

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
        rows, srcs, dsts = [], [], []
        for st, plan in zip(states, plans, strict=True):
            if plan.num_moves:
                rows.append(plan.rows)
                srcs.append(st.phys(plan.src))  # pre-plan block list
                dsts.append(st.phys(plan.dst))
        plan_s = time.perf_counter() - t0
        stats = ReclaimStats(requests=len(states), plan_seconds=plan_s)
        for st, plan in zip(states, plans, strict=True):
            if self.debug:
                validate_plan(st, plan, self.mode)
            stats.tokens_evicted += st.evicted_since_reclaim
            stats.tokens_moved += plan.num_moves
            stats.blocks_freed += plan.blocks_freed
            self._commit(st, plan)
        if rows:
            cp = CopyPlan(np.concatenate(rows), np.concatenate(srcs), np.concatenate(dsts))
            stats.bytes_moved = cp.num_moves * self.engine.row_bytes()
            self.engine.submit(cp)
        self.tokens_moved_total += stats.tokens_moved
        self.blocks_freed_total += stats.blocks_freed
        self.last_reclaim = stats
        if self.debug:
            self.check_invariants()
        return stats

    def _commit(self, st: RequestState, plan: RequestPlan) -> None:
        """Apply a plan to the bookkeeping (post-plan view) and return freed blocks to the pool."""
        bs = self.block_size
        before = np.sort(np.where(st.live, st.pos, -1), axis=1) if self.debug else None
        old_blocks = len(st.blocks)
        if self.mode == "naive":
            keep = plan.keep_blocks
            kept_ids = np.nonzero(keep)[0]
            drop_ids = np.nonzero(~keep)[0]
            used_in = np.minimum(bs, st.used - drop_ids * bs)
            cols = (kept_ids[:, None] * bs + np.arange(bs)).reshape(-1)
            cap = st.pos.shape[1]
            st.pos = np.concatenate([st.pos[:, cols], np.full((self.num_rows, cap - cols.size), -1, np.int64)], 1)
            st.live = np.concatenate([st.live[:, cols], np.zeros((self.num_rows, cap - cols.size), bool)], 1)
            freed = [st.blocks[i] for i in drop_ids]
            st.blocks = [st.blocks[i] for i in kept_ids]
            st.used -= int(used_in.sum())
            st.holes = bool((~st.live[:, : st.used]).any())
        else:
            n = st.num_live
            st.pos[plan.rows, plan.dst] = st.pos[plan.rows, plan.src]  # RHS gathered first: overlap-safe
            st.live[:, :n] = True
            st.live[:, n:] = False
            st.pos[:, n:] = -1
            k = cdiv(n, bs)
            freed = st.blocks[k:]
            st.blocks = st.blocks[:k]
            st.used = n
            st.holes = False
        self.pool.free(freed)  # walks tail first
        st.tokens_moved += plan.num_moves
        st.evicted_since_reclaim = 0
        st.pending = np.zeros(0, np.int64)
        st.naive_drop_dead()
        self.table.sync_mirror(st)
        if before is not None:
            after = np.sort(np.where(st.live, st.pos, -1), axis=1)
            b, a = before[:, before.shape[1] - st.num_live:], after[:, after.shape[1] - st.num_live:]
            check(bool((a == b).all()), "I1", f"request {st.req_id!r}: live positions changed by a plan")
            check(len(st.blocks) <= old_blocks, "I4", f"request {st.req_id!r}: a plan grew the block list")

    def fence(self) -> None:
        """Wait for in-flight copies (I3), then apply deferred slot-store writes in order."""
        self.engine.fence()
        if self._deferred:
            ops, self._deferred = self._deferred, []
            for kind, a, b in ops:
                if kind == "init":
                    self.store.init_slots(a, b)
                else:
                    self.store.kill_slots(a, b)

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
        rows = self._md_rows[:B]
        rows.copy_(torch.as_tensor([st.row for st in states], dtype=torch.int64))
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
        return paged_attention(query, self._k[layer], self._v[layer], md.block_tables, md.cache_lens, query_pos,
                               key_positions=self.store.layer_positions(layer), scale=scale,
                               return_probs=return_probs)

    # ================================================================ statistics
    def stats_tensor(self, name: str) -> torch.Tensor:
        """In-place store ``[L, H_kv, num_slots]`` float32 for stat ``name`` (fences first)."""
        self.fence()
        return self.store.tensor(name)

    def gather_stats(self, req_id: ReqId, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Per-slot stats of a request's live tokens in logical order: name -> ``[L, H_kv, n_live]``.
        At head granularity row (l, h) follows that row's own :meth:`live_view` order."""
        st = self.table.get(req_id)
        self.fence()
        _, vs = self.table.live_view(st)
        phys = torch.as_tensor(st.phys(vs), device=self.device)  # [R, n]
        L, H = self.num_layers, self.num_kv_heads
        out = {}
        for name in (self.store.stat_names if names is None else names):
            t = self.store.tensor(name)
            if self.num_rows == 1:
                out[name] = t[:, :, phys[0]]
            else:
                out[name] = torch.gather(t, 2, phys.view(L, H, -1))
        return out

    def accumulate_stats(self, name: str, layer: int, md: AttentionMetadata, values: torch.Tensor,
                         reduce: str = "sum") -> None:
        """Scatter ``values [B, H_kv, max_len]`` (indexed by virtual slot, e.g. ``probs.sum(2)`` of
        :func:`paged_attention`) into stat ``name`` of ``layer``: add (``"sum"``) or overwrite (``"set"``)."""
        if reduce not in ("sum", "set"):
            raise ValueError(f"reduce must be 'sum' or 'set', got {reduce!r}")
        self.fence()
        t = self.store.tensor(name)[layer]  # [H, S]
        B, H, Lm = values.shape
        b_idx, j_idx, flat = self._scatter_index(md, Lm, H)
        vals = values[b_idx, :, j_idx].T.reshape(-1).to(torch.float32)  # [H, M] -> [H*M]
        if reduce == "sum":
            t.view(-1).index_add_(0, flat, vals)
        else:
            t.view(-1).index_copy_(0, flat, vals)

    def _scatter_index(self, md: AttentionMetadata, Lm: int, H: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(b_idx [M], j_idx [M], flat [H*M])``: visible (request, virtual slot) pairs of a batch and
        their flat ``[H, num_slots]`` store indices. Identical for every layer and statistic of a step,
        so it is computed once per metadata object."""
        hit = md.scatter_cache.get(Lm)
        if hit is not None:
            return hit
        j = torch.arange(Lm, device=self.device)
        lens = md.cache_lens.to(torch.int64)
        ok = j[None, :] < lens[:, None]  # [B, Lm]
        bt = md.block_tables.to(torch.int64)
        blk = bt[:, (j // self.block_size).clamp(max=bt.shape[1] - 1)]
        slot = blk * self.block_size + j % self.block_size  # [B, Lm]
        b_idx, j_idx = torch.nonzero(ok, as_tuple=True)
        s = slot[b_idx, j_idx]  # [M]
        flat = (torch.arange(H, device=self.device)[:, None] * self.num_slots + s[None, :]).reshape(-1)
        md.scatter_cache[Lm] = (b_idx, j_idx, flat)
        return b_idx, j_idx, flat

    # ================================================================ reporting
    def held_blocks(self, req_id: ReqId) -> int:
        return len(self.table.get(req_id).blocks)

    def live_tokens(self, req_id: ReqId) -> int:
        """Live tokens per row (equal in every row)."""
        return self.table.get(req_id).num_live

    def logical_len(self, req_id: ReqId) -> int:
        """True sequence length (positions handed out; never decreases)."""
        return self.table.get(req_id).logical_len

    def cache_len(self, req_id: ReqId) -> int:
        """Virtual slots in use (live + holes); == live_tokens after a compact/ordered reclaim."""
        return self.table.get(req_id).used

    def naive_held_blocks(self, req_id: ReqId) -> int:
        """Blocks Naive-Evict would hold with the same decisions (shadow figure in every mode)."""
        return len(self.table.get(req_id).naive_starts)

    def tokens_moved(self, req_id: ReqId) -> int:
        return self.table.get(req_id).tokens_moved

    def evicted_since_reclaim(self, req_id: ReqId) -> int:
        return self.table.get(req_id).evicted_since_reclaim

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def request_ids(self) -> list[ReqId]:
        return list(self.table.requests)

    # ================================================================ invariants
    def check_invariants(self) -> None:
        """Full bookkeeping check (POOL, I2, PINS, mode-specific block counts, mirror). O(tokens)."""
        held = [b for st in self.table.requests.values() for b in st.blocks]
        self.pool.check(held=held)
        bs = self.block_size
        for st in self.table.requests.values():
            self.table.check_request(st)
            if self.mode == "naive":
                check(len(st.blocks) == len(st.naive_starts), "I4",
                      f"request {st.req_id!r}: naive mode holds {len(st.blocks)} blocks, naive rule says "
                      f"{len(st.naive_starts)}")
            elif not st.holes:
                check(st.used == st.num_live and len(st.blocks) == cdiv(st.num_live, bs), "I4",
                      f"request {st.req_id!r}: {len(st.blocks)} blocks / cache length {st.used} for "
                      f"{st.num_live} live tokens without holes")
            nb = len(st.blocks)
            mirror = self.table.block_tables[st.row, :nb].cpu().numpy()
            check(bool((mirror == np.asarray(st.blocks, dtype=np.int32)).all())
                  and int(self.table.cache_lens[st.row]) == st.used, "I3",
                  f"request {st.req_id!r}: device mirror disagrees with the token table")

    def _check_layer(self, layer: int) -> None:
        if not (0 <= layer < self.num_layers):
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
