"""Row cache: the K/V of requests whose (layer, KV head) rows keep unequal numbers of tokens, in one-head
pages of the *same memory* the uniform cache uses (docs/decisions.md decision 8, issue 38).

    kv_all  [L, 2, NB, bs, H_kv, D]   one allocation; layer l's uniform cache is the view kv_all[l]
    page slot g -> (layer, block, offset, head) = PageTable.page_slot_address(g)
                -> K = kv_all[layer, 0, block, offset, head]   V = kv_all[layer, 1, ...]

A request moves here from the uniform cache when its policy's first eviction gives its rows unequal
counts (:meth:`RowCache.adopt`): it keeps its own blocks (their memory now holds pages), the rows are laid
out compactly and the blocks not needed go back to the shared :class:`BlockPool`. From then on it appends
one token per row per step (:meth:`reserve`, :meth:`write_kv`) and attends with :meth:`attention`: per KV
head, a paged attention over that head's own page list and length (the same math as
:func:`~vtoken_runtime.paged_attention.paged_attention`, one sequence per (request, KV head)).

Bookkeeping is the :class:`~vtoken_runtime.page_table.PageTable`'s; this module only moves tensors.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from .block_pool import BlockPool
from .page_table import PageTable, RowPlan, cdiv

ReqId = Hashable


class RowStore(ABC):
    """Row requests' bookkeeping over a shared block ``pool``: the :class:`PageTable` (the only writer of the
    rows) plus the pool's frees and allocations. Where the K/V live is a subclass's: :meth:`_move` copies page
    slots (the HF session's :class:`RowCache` over ``kv_all``; vLLM's buffer in
    ``vllm_plugin.rows.VllmRowCache``)."""

    def __init__(self, pool: BlockPool, num_layers: int, num_kv_heads: int, block_size: int, head_size: int,
                 max_requests: int, debug: bool | None = None, release: str = "emptiest") -> None:
        self.pool = pool
        self.num_layers, self.num_kv_heads, self.block_size, self.head_size = (num_layers, num_kv_heads, block_size,
                                                                                head_size)
        self.table = PageTable(num_layers, num_kv_heads, block_size, max_requests, debug=debug, release=release)

    @abstractmethod
    def _move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy the K/V of page slots ``src`` to ``dst`` (all sources read before any write)."""

    # ---------------------------------------------------------------- requests
    def __contains__(self, req_id: object) -> bool:
        return req_id in self.table.requests

    def adopt(self, req_id: ReqId, pinned: np.ndarray, positions: Sequence[np.ndarray], src_slots: Sequence[np.ndarray],
              blocks: list[int], logical_len: int, hold: int = 0) -> int:
        """Take over a request whose row ``r`` keeps ``positions[r]`` (ascending), now stored at page slots
        ``src_slots[r]`` of ``blocks`` (the request's own, handed over by the uniform cache). Lays the rows out,
        moves the K/V (gather first: sources and destinations share blocks) and frees the blocks not needed.
        Returns the blocks freed. ValueError (nothing changes, the blocks stay the caller's) on bad input.
        ``hold``: blocks to keep at least (``PageTable.adopt``)."""
        if self.table.add(req_id, pinned) is None:
            raise ValueError(f"row cache full ({self.table.max_requests} requests); cannot adopt {req_id!r}")
        try:
            dst, surplus = self.table.adopt(req_id, positions, blocks, logical_len, src_slots, hold=hold)
        except ValueError:
            self.table.remove(req_id)
            raise
        self._move(np.concatenate([np.asarray(s, np.int64) for s in src_slots]), np.concatenate(dst))
        self.pool.free(surplus)
        return len(surplus)

    def blocks_for(self, keep: np.ndarray | Sequence[np.ndarray]) -> int:
        """Blocks the rows of a keep mask need once laid out in pages: ``[R, n]``, or one bool array per row
        (rows of unequal lengths, a request already in pages)."""
        pages = sum(cdiv(int(np.count_nonzero(k)), self.block_size) for k in keep)
        return cdiv(pages, self.table.pages_per_block)

    def adopt_uniform(self, req_id: ReqId, pinned: np.ndarray, positions: np.ndarray, physical: np.ndarray,
                      keep: np.ndarray, blocks: list[int], logical_len: int, hold: int = 0) -> int:
        """The handoff from a uniform token table: row ``r`` keeps ``positions[r][keep[r]]``, now at uniform
        slots ``physical[r][keep[r]]`` (``block * bs + offset`` of the request's own ``blocks``, in its list
        order); ``hold``: blocks to keep at least (the count tensor-parallel ranks agreed on). Returns the
        blocks freed (back in the pool). ValueError, nothing changed, for a mask of another shape than
        ``positions`` (``[R, n_live]``), one that drops a pin, or a full table."""
        keep = np.asarray(keep, dtype=bool)
        if keep.shape != np.shape(positions):
            raise ValueError(f"keep mask shape {keep.shape} != (R, n_live) = {np.shape(positions)}")
        bs = self.block_size
        kept = [p[k] for p, k in zip(positions, keep, strict=True)]
        src = [self.table.row_page_slots(ph[k] // bs, ph[k] % bs, np.full(int(k.sum()), r))
               for r, (ph, k) in enumerate(zip(physical, keep, strict=True))]
        return self.adopt(req_id, pinned, kept, src, blocks, logical_len, hold=hold)

    def fork(self, src: ReqId, dst: ReqId) -> bool:
        """Add ``dst`` as a copy of ``src`` (rows, positions, K/V) in newly allocated blocks; False (nothing
        changes) when the pool or the request slots run out."""
        s = self.table.get(src)
        if self.table.add(dst, s.pinned.copy()) is None:
            return False
        new = self.pool.allocate(len(s.blocks))
        if new is None:
            self.table.remove(dst)
            return False
        a, b = self.table.fork(src, dst, new)
        self._move(a, b)
        return True

    def free(self, req_id: ReqId) -> int:
        """Return all the request's blocks to the pool; returns how many."""
        blocks = self.table.remove(req_id)
        self.pool.free(blocks)
        return len(blocks)

    def reserve(self, req_id: ReqId, n: int) -> np.ndarray | None:
        """Page slots ``[R, n]`` for the next ``n`` tokens of every row; None (nothing changes) when the pool is
        out of blocks."""
        need = self.table.blocks_needed(req_id, n)
        new = self.pool.allocate(need) if need else []
        if new is None:
            return None
        return self.table.reserve(req_id, n, new)[0]

    def evict(self, req_id: ReqId, keep: Sequence[np.ndarray], hold: int = 0) -> RowPlan:
        """Evict per row (``keep[r]`` bool over row ``r``'s tokens, slot order), compact, repack pages out of
        the emptiest blocks, free emptied blocks (keeping at least ``hold``). Returns the plan it applied."""
        plan = self.table.evict(req_id, keep, hold=hold)
        self._move(plan.src, plan.dst)
        self.pool.free(plan.freed)
        return plan

    # the driver's RowAccess (decode re-eviction of position-class rows: eviction.streams_rows)
    def row_view(self, req_id: ReqId) -> tuple[list[np.ndarray], np.ndarray, int]:
        """``(positions of every row (copies), pinned positions, logical length)``."""
        st = self.table.get(req_id)
        return [p.copy() for p in st.pos], np.asarray(st.pinned, dtype=np.int64).copy(), int(st.logical_len)

    def row_evict(self, req_id: ReqId, keep: list[np.ndarray]) -> int:
        """:meth:`evict`; returns the row-tokens evicted."""
        return int(self.evict(req_id, keep).tokens_evicted)

    # ---------------------------------------------------------------- reporting
    def held_blocks(self, req_id: ReqId) -> int:
        return self.table.held_blocks(req_id)

    def blocks(self, req_id: ReqId) -> dict[str, int]:
        """Held blocks and what other designs would hold for the same rows: ``vtoken`` (held), ``ideal``
        (per layer ``ceil(sum_h ceil(n / bs) / H)``, the largest layer: issue 38's bound), ``ideal_pages`` (one
        page space for every layer: what the page table holds by R4), ``max_row`` (one shared block list),
        ``naive`` (a block returns only when no row keeps a token of it), ``full`` (no eviction), ``moved``
        (token moves so far, the handoff's included) and ``rows_live_min`` / ``rows_live_max``."""
        st = self.table.get(req_id)
        ideal = self.table.ideal_blocks(req_id)
        bs, n = self.block_size, st.lengths
        live_pos = np.concatenate(st.pos) if st.pos else np.zeros(0, np.int64)
        return {"full": -(-st.logical_len // bs), "naive": int(np.unique(live_pos // bs).size),
                "vtoken": len(st.blocks), "ideal": ideal["per_layer"], "ideal_pages": ideal["pages"],
                "max_row": ideal["max_row"], "moved": st.tokens_moved, "rows_live_min": int(n.min()),
                "rows_live_max": int(n.max())}

    def held_block_ids(self) -> list[int]:
        """Every block the row requests hold (one entry per reference: the pool check's ``held``)."""
        return [b for st in self.table.requests.values() for b in st.blocks]

    def logical_len(self, req_id: ReqId) -> int:
        return self.table.get(req_id).logical_len

    def check_invariants(self) -> None:
        self.table.check_all()


class RowCache(RowStore):
    """Row requests over ``kv_all [L, 2, NB, bs, H_kv, D]`` and the shared block ``pool`` (the HF session)."""

    def __init__(self, kv_all: torch.Tensor, pool: BlockPool, max_requests: int, debug: bool | None = None,
                 release: str = "emptiest") -> None:
        if kv_all.dim() != 6 or kv_all.shape[1] != 2:
            raise ValueError(f"kv_all must be [L, 2, NB, bs, H_kv, D], got {list(kv_all.shape)}")
        L, _, nb, bs, H, D = kv_all.shape
        if nb != pool.num_blocks:
            raise ValueError(f"kv_all has {nb} blocks, the pool {pool.num_blocks}")
        super().__init__(pool, L, H, bs, D, max_requests, debug=debug, release=release)
        self.kv_all = kv_all

    # ---------------------------------------------------------------- tensors
    def _index(self, g: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Page slots -> index tensors ``(layer, block, offset, head)`` into ``kv_all[:, k_or_v]``."""
        g = torch.as_tensor(g, dtype=torch.int64, device=self.kv_all.device)
        bs, H = self.block_size, self.num_kv_heads
        P = self.num_layers * H
        p, o = g // bs, g % bs
        return (p % P) // H, p // P, o, p % H

    def _move(self, src: np.ndarray, dst: np.ndarray) -> None:
        if not src.size:
            return
        s, d = self._index(src), self._index(dst)
        for kv in (0, 1):
            vals = self.kv_all[s[0], kv, s[1], s[2], s[3]]  # advanced indexing: a copy, so overlap is safe
            self.kv_all[d[0], kv, d[1], d[2], d[3]] = vals

    def write_kv(self, layer: int, slots: np.ndarray, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k, v [T, H_kv, D]`` of layer ``layer`` into page slots ``slots [H_kv, T]`` (row ``layer * H + h``'s
        slots of the step's new tokens)."""
        H = self.num_kv_heads
        if slots.shape != (H, k.shape[0]) or k.shape != v.shape:
            raise ValueError(f"slots {slots.shape} / k {tuple(k.shape)} do not match [H_kv, T] / [T, H_kv, D]")
        i = self._index(slots.T.reshape(-1))
        dt = self.kv_all.dtype
        self.kv_all[i[0], 0, i[1], i[2], i[3]] = k.reshape(-1, k.shape[-1]).to(dt)
        self.kv_all[i[0], 1, i[1], i[2], i[3]] = v.reshape(-1, v.shape[-1]).to(dt)

    def attention(self, layer: int, query: torch.Tensor, req_ids: Sequence[ReqId], query_lens: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
        """``query [B, Q, H_q, D]`` (request b's new tokens are its first ``query_lens[b]`` rows, the last
        tokens of every row) -> ``out [B, Q, H_q, D]``. KV head h of request b attends over its own
        ``n[b, h]`` tokens; query i sees keys ``j <= n[b, h] - query_lens[b] + i`` (rows are ordered by
        position, so this is causality by true position). Padding query rows give zeros."""
        B, Q, Hq, D = query.shape
        H, bs = self.num_kv_heads, self.block_size
        G = Hq // H
        dev = self.kv_all.device
        pt, lens = self.table.batch_tables(req_ids, slice(layer * H, (layer + 1) * H))  # [B, H, W], [B, H]
        Lmax = max(int(lens.max(initial=0)), 1)
        j = np.arange(Lmax)
        pages = pt[:, :, np.minimum(j // bs, pt.shape[2] - 1)]  # [B, H, Lmax]
        in_range = j[None, None, :] < lens[:, :, None]
        g = np.where(in_range, pages.clip(min=0) * bs + j % bs, 0)
        li, bi, oi, hi = self._index(g)
        k = self.kv_all[li, 0, bi, oi, hi].to(torch.float32)  # [B, H, Lmax, D]
        v = self.kv_all[li, 1, bi, oi, hi].to(torch.float32)
        scale = 1.0 / math.sqrt(D) if scale is None else scale
        qf = query.to(torch.float32).view(B, Q, H, G, D).permute(0, 2, 3, 1, 4).reshape(B, H, G * Q, D)
        scores = torch.matmul(qf, k.transpose(-1, -2)).view(B, H, G, Q, Lmax) * scale
        ql = torch.as_tensor(query_lens, dtype=torch.int64, device=dev)
        lt = torch.as_tensor(lens, device=dev)
        i = torch.arange(Q, device=dev)
        limit = (lt - ql[:, None])[:, :, None] + i[None, None, :]  # [B, H, Q]
        jt = torch.arange(Lmax, device=dev)
        valid = (jt[None, None, None, :] <= limit[..., None]) & torch.as_tensor(in_range, device=dev)[:, :, None, :]
        valid = valid & (i[None, :] < ql[:, None])[:, None, :, None]  # padding queries see nothing
        scores = scores.masked_fill(~valid[:, :, None], float("-inf"))
        probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
        out = torch.matmul(probs.view(B, H, G * Q, Lmax), v).view(B, H, G, Q, D)
        return out.permute(0, 3, 1, 2, 4).reshape(B, Q, Hq, D).to(query.dtype)
