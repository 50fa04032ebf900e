"""Read-only queries of a :class:`~vtoken_runtime.cache.VTokenCache` (mixed into it): views of the K/V
caches, the logical view of a request, its statistics, reporting figures and the invariant check.
Nothing here changes bookkeeping; reads of tensors fence first (I3)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .slot_stats import SlotStore
    from .token_table import TokenTable

ReqId = Hashable


class CacheQueries:
    """Queries over the cache's table, store and K/V views (attributes set by ``VTokenCache``)."""

    table: TokenTable
    store: SlotStore
    pool: BlockPool
    _kv: list[tuple[Any, Any] | None]  # views; element-map readers or None: a layout without views (amx)
    _pool_holders: list[Callable[[], Iterable[int]]]  # other owners of the pool's blocks (add_pool_holder)
    num_layers: int
    num_kv_heads: int
    head_size: int
    num_rows: int
    block_size: int
    mode: str
    debug: bool
    device: torch.device

    def fence(self) -> None:  # provided by VTokenCache
        raise NotImplementedError

    def kv_pair(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K, V)``: ``[num_blocks, block_size, H_kv, D]`` views of layer ``layer`` (any strides). ValueError
        when the engine's layout cannot be viewed per token (vLLM's CPU ``amx`` layout interleaves pairs of
        dims / tokens): moves still work there, and so do the reads of :meth:`gather_kv_vectors` when the
        engine gave element-map readers (``vllm_plugin.cpu_layout.MappedKV``), but no strided view exists."""
        pair = self._kv[layer]
        if pair is None or not isinstance(pair[0], torch.Tensor):
            raise ValueError("vtoken: this KV cache's layout cannot be read per token (vLLM's CPU amx layout); "
                             "reading cached keys / values through views needs an affine layout (the vec ISA)")
        return pair

    def _kv_reader(self, layer: int) -> Any:
        """What :meth:`gather_kv_vectors` indexes as ``x[blk, off]`` / ``x[blk, off, h]``: the views, or the
        element-map readers of a layout without views (ValueError when neither exists)."""
        pair = self._kv[layer]
        return pair if pair is not None else self.kv_pair(layer)

    def key_cache(self, layer: int) -> torch.Tensor:
        """``[num_blocks, block_size, H_kv, D]`` view of layer ``layer``'s keys (any strides)."""
        return self.kv_pair(layer)[0]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.kv_pair(layer)[1]

    def key_positions(self, layer: int) -> torch.Tensor:
        """``[H_kv or 1, num_slots]`` int64 true position per physical slot (-1 = empty/evicted)."""
        return self.store.layer_positions(layer)

    def gather_kv(self, layer: int, req_id: ReqId) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Live K/V of a request in logical order: ``(positions [H_kv or 1, n], k [H_kv, n, D], v [H_kv, n, D])``."""
        self._check_layer(layer)
        pos, phys = self.live_slots(req_id)
        H, bs = self.num_kv_heads, self.block_size
        kc, vc = self.kv_pair(layer)
        if self.num_rows == 1:
            s = torch.as_tensor(phys[0], device=self.device)
            return (torch.as_tensor(pos, device=self.device), kc[s // bs, s % bs].permute(1, 0, 2),
                    vc[s // bs, s % bs].permute(1, 0, 2))
        s = torch.as_tensor(phys[layer * H:(layer + 1) * H], device=self.device)  # [H, n]
        h = torch.arange(H, device=self.device)[:, None].expand_as(s)
        return (torch.as_tensor(pos[layer * H:(layer + 1) * H], device=self.device),
                kc[s // bs, s % bs, h], vc[s // bs, s % bs, h])

    def gather_kv_vectors(self, req_ids: Sequence[ReqId], names: Sequence[str] = ("key", "value"),
                          layers: tuple[int, int] | None = None, width: int | None = None,
                          slots: Sequence[np.ndarray] | None = None) -> dict[str, torch.Tensor]:
        """Cached keys / values of requests' live tokens in :meth:`live_view` order, read through the token
        table from the K/V views: ``name -> [B, l1 - l0, H_kv, N, D]`` float32 (``N = width`` or the longest
        live count; padding is 0). ``names`` among ``"key"``, ``"value"``; ``layers = (l0, l1)``; ``slots``:
        the requests' physical slots ``[R, n]`` when the caller already has them (:meth:`live_slots`).
        Row ``(l, h)`` of a head-granularity request uses that row's own slots. One index op per layer and
        tensor for the whole batch."""
        l0, l1 = layers if layers is not None else (0, self.num_layers)
        phys = list(slots) if slots is not None else [self.live_slots(r)[1] for r in req_ids]
        if slots is not None:
            self.fence()
        ns = [int(p.shape[1]) for p in phys]
        B, H = len(phys), self.num_kv_heads
        N = width if width is not None else max(ns, default=0)
        dev, bs = self.device, self.block_size
        D = self.head_size
        which = [i for i, n in enumerate(("key", "value")) if n in names]
        out = {("key", "value")[i]: torch.zeros((B, l1 - l0, H, N, D), dtype=torch.float32, device=dev)
               for i in which}
        if not out or not sum(ns):
            return out
        b_idx = torch.as_tensor(np.repeat(np.arange(B), ns), device=dev)
        j_idx = torch.as_tensor(np.concatenate([np.arange(n) for n in ns]), device=dev)
        if self.num_rows == 1:
            s = torch.as_tensor(np.concatenate([p[0] for p in phys]), device=dev)  # [M]
            blk, off = s // bs, s % bs
            for layer in range(l0, l1):
                for i in which:
                    src = self._kv_reader(layer)[i][blk, off]  # [M, H, D]
                    out[("key", "value")[i]][:, layer - l0][b_idx, :, j_idx] = src.to(torch.float32)
            return out
        h_idx = torch.arange(H, device=dev)[:, None]
        for layer in range(l0, l1):
            s = torch.as_tensor(np.concatenate([p[layer * H:(layer + 1) * H] for p in phys], axis=1),
                                device=dev)  # [H, M]
            blk, off = s // bs, s % bs
            for i in which:
                src = self._kv_reader(layer)[i][blk, off, h_idx.expand_as(s)]  # [H, M, D]
                out[("key", "value")[i]][:, layer - l0][b_idx, :, j_idx] = src.transpose(0, 1).to(torch.float32)
        return out

    def live_view(self, req_id: ReqId) -> tuple[np.ndarray, np.ndarray]:
        """``(positions [R, n_live] int64 ascending per row, vslots [R, n_live] int64)``: what policies see
        (the caller's copies of the table's memoised view)."""
        pos, vs = self.table.live_view(self.table.get(req_id))
        return pos.copy(), vs.copy()

    def live_slots(self, req_id: ReqId) -> tuple[np.ndarray, np.ndarray]:
        """``(positions [R, n_live], physical slots [R, n_live])`` in :meth:`live_view` order (fences)."""
        st = self.table.get(req_id)
        self.fence()
        pos, vs = self.table.live_view(st)
        return pos.copy(), st.phys(vs)

    def stats_tensor(self, name: str) -> torch.Tensor:
        """Stat ``name`` of every slot, ``[L, H_kv, num_slots]`` float32 (fences first). For reading: writes
        go through the cache's writers (``scatter_stats``, ``accumulate_stats``, ``stats_update_handles``),
        which fence and keep the slot store the only owner of its tensors."""
        self.fence()
        return self.store.tensor(name)

    def gather_stats(self, req_id: ReqId, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Per-slot stats of a request's live tokens in logical order: name -> ``[L, H_kv, n_live]``.
        At head granularity row (l, h) follows that row's own :meth:`live_view` order."""
        _, phys = self.live_slots(req_id)
        names = self.store.stat_names if names is None else names
        return self.store.gather(names, torch.as_tensor(phys, device=self.device))

    def gather_stats_batch(self, names: Sequence[str], slots: Sequence[np.ndarray], width: int,
                           layers: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """Per-slot stats of a batch's live tokens in one gather per statistic, on the cache's device:
        ``slots`` the requests' physical slots ``[R, n_b]`` (:meth:`live_slots`, whose order the result
        follows) -> name -> ``[B, l1 - l0, H_kv, width]`` float32, 0 past each request's ``n_b``. The slot
        ids reach the device in one transfer. Fences first."""
        l0, l1 = layers if layers is not None else (0, self.num_layers)
        B, R = len(slots), self.num_rows
        idx = np.zeros((B, R, width), dtype=np.int64)
        ns = np.zeros(B, dtype=np.int64)
        for b, p in enumerate(slots):
            ns[b] = p.shape[1]
            idx[b, :, :ns[b]] = p
        self.fence()
        idx_t = torch.from_numpy(idx).to(self.device, non_blocking=True)
        valid = torch.arange(width, device=self.device)[None, :] < torch.from_numpy(ns).to(self.device)[:, None]
        return self.store.gather_batch(names, idx_t, valid, (l0, l1))

    def has_request(self, req_id: ReqId) -> bool:
        return req_id in self.table.requests

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
        return self.table.get(req_id).cache_len

    def naive_held_blocks(self, req_id: ReqId) -> int:
        """Blocks Naive-Evict would hold with the same decisions (shadow figure in every mode)."""
        return len(self.table.get(req_id).naive_starts)

    def naive_cache_len(self, req_id: ReqId) -> int:
        """Cache length under the naive rule: slots of the naive layout (full blocks + open tail)."""
        st = self.table.get(req_id)
        return (len(st.naive_counts) - 1) * self.block_size + int(st.naive_counts[-1]) if st.naive_counts else 0

    def tokens_moved(self, req_id: ReqId) -> int:
        return self.table.get(req_id).tokens_moved

    def evicted_since_reclaim(self, req_id: ReqId) -> int:
        return self.table.get(req_id).evicted_since_reclaim

    def pinned_positions(self, req_id: ReqId) -> np.ndarray:
        """Sorted unique pinned true positions of a request."""
        return self.table.get(req_id).pinned

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def request_ids(self) -> list[ReqId]:
        return list(self.table.requests)

    def check_invariants(self) -> None:
        """Full bookkeeping check (POOL, I2, I3 mirror, PINS, mode-specific block counts). O(tokens)."""
        others = [b for held in self._pool_holders for b in held()]
        self.pool.check(held=[b for st in self.table.requests.values() for b in st.blocks] + others)
        for st in self.table.requests.values():
            self.table.check_request(st, self.mode)

    def _check(self) -> None:
        if self.debug:
            self.check_invariants()

    def _check_layer(self, layer: int) -> None:
        if not (0 <= layer < self.num_layers):
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
