"""Requests with unequal row budgets inside vLLM's workers (issue 39): one-head pages of vLLM's own buffer (CPU; GPU
with the Triton attention backend over an HND cache: ``backend="triton"``, see :class:`VllmRowCache`).

A request whose policy gives its (layer, KV head) rows unequal counts (``allocation=``: AdaKV, PyramidKV,
DuoAttention) leaves the uniform token table at its first eviction, as in the HF session: the driver's handoff
(:meth:`VllmRowCache.adopt`) lays its kept tokens out in one-head pages of the blocks it already holds, and the
blocks its rows no longer need are the *tail* of its vLLM block list (``PageTable(release="tail")``), so vLLM's
block manager frees them with the truncation it already applies::

    vLLM block list of the request   [b0 b1 b2 b3 b4 b5]        before: uniform, 6 blocks
    after the handoff                [b0 b1 b2]  (b3 b4 b5 freed by the scheduler, tail first)
    page p of block b, layer l, KV head h = (l * NB + b) * H + h     (row_attention.all_layer_pages)

The page space is every layer's cache at once (vLLM's CPU worker allocates the layers as consecutive views of
one buffer), so rows of different layers share blocks: PyramidKV and DuoAttention free memory too.

**The scheduler's accounting.** vLLM's block manager holds ``cdiv(c, bs)`` blocks for a request it believes has
``c`` cached tokens and allocates one more when ``c + new`` crosses a block. A row request appends one token to
every row per decode step; it needs a new block only when some row needs a page and the request has no free
page left (``PageTable.blocks_needed``, 0 or 1: a block has one page per row). After every step the worker
reports (:meth:`VllmRowCache.scheduler_len`)::

    c = min(true length, held x bs - (0 if the next token needs a block else 1))

so the manager keeps exactly the blocks the page table holds and allocates exactly when it needs one
(``min`` with the true length: a request that still holds all its blocks is allocated as vLLM would, and
its rows, each no longer than the true length, fit in those blocks). The report is a
:class:`~.report.Truncation` like any eviction's; the block list stays the manager's (one owner).

**Attention.** A step with any row request runs every request of the batch through the row path, layer by
layer (:class:`RowStep`): vLLM's own cache-write op and ``cpu_attention_with_kv_cache`` with one sequence per
(request, KV head) (:mod:`.row_attention`); a uniform request is rows of equal length on its blocks' pages,
which equals vLLM's stock call (tests/vllm/test_row_attention.py). A step without row requests keeps the
stock call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vtoken_runtime.block_pool import BlockPool
from vtoken_runtime.row_cache import ReqId, RowStore
from vtoken_runtime.token_table import cdiv

from . import row_attention as ra


@dataclass
class RowStep:
    """One engine step through the row path: per layer, the batch's rows (every request of the batch)."""

    pages: ra.Pages
    batches: list[ra.RowBatch]  # [L]
    isa: str
    backend: str = "cpu"  # "cpu": vLLM's CPU kernels; "triton": the GPU Triton backend's (``hnd_layer_pages``)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """The step's new ``key`` / ``value`` ``[T, H, D]`` of ``layer`` into their rows' pages."""
        if self.backend == "triton":
            ra.triton_write_rows(key, value, self.pages, self.batches[layer])
        else:
            ra.write_rows(key, value, self.pages, self.batches[layer], isa=self.isa)

    def attend(self, layer: int, query: torch.Tensor, output: torch.Tensor, scale: float) -> None:
        """``query [T, H_q, D]`` (the step's actual tokens) -> ``output[:T]`` (``[T, H_q * D]`` or
        ``[T, H_q, D]``), every query head over its row."""
        t_n, hq, d = query.shape
        if self.backend == "triton":
            out = ra.triton_row_attention(query, self.pages, self.batches[layer], scale)
        else:
            out = ra.row_attention(query, self.pages, self.batches[layer], scale, isa=self.isa)
        output[:t_n].view(t_n, hq, d).copy_(out)


class VllmRowCache(RowStore):
    """Row requests in vLLM's KV buffer (``kv_caches``: the layers' ``[NB, H, bs, 2D]`` views of one
    allocation), over the worker's :class:`~.worker.ExternalPool` (fed from vLLM's block lists).

    ``backend="cpu"`` (vLLM's CPU worker): pages :func:`~.row_attention.all_layer_pages`, K/V inside a page in
    the ISA's layout (``kmap`` / ``vmap``, probed), vLLM's CPU write and attention ops. ``backend="triton"``
    (the GPU worker with vLLM's Triton attention backend and the HND layout, LBHNC): pages
    :func:`~.row_attention.hnd_layer_pages`, plain ``D`` elements per token-head (no maps), vLLM's
    ``triton_reshape_and_cache_flash`` and ``unified_attention``. The bookkeeping is the same."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], kmap: np.ndarray | None, vmap: np.ndarray | None,
                 pool: BlockPool, max_requests: int, debug: bool | None = None, backend: str = "cpu") -> None:
        if backend not in ("cpu", "triton"):
            raise ValueError(f"vtoken: row backend {backend!r}; expected 'cpu' or 'triton'")
        if backend == "cpu" and (kmap is None or vmap is None):
            raise ValueError("vtoken: the CPU row backend needs the probed key/value maps of the cache layout")
        # ValueError unless one buffer in layer order (and, for Triton, HND-contiguous)
        pages = ra.hnd_layer_pages(kv_caches) if backend == "triton" else ra.all_layer_pages(kv_caches)
        nb, h, bs, d2 = kv_caches[0].shape
        if nb != pool.num_blocks:
            raise ValueError(f"vtoken: the KV cache has {nb} blocks, the pool {pool.num_blocks}")
        super().__init__(pool, len(kv_caches), h, bs, d2 // 2, max_requests, debug=debug, release="tail")
        self.kv_caches = list(kv_caches)
        self.pages = pages
        self.num_blocks = nb
        self.kmap, self.vmap = kmap, vmap
        self.backend = backend
        self.device = kv_caches[0].device

    def _move(self, src: np.ndarray, dst: np.ndarray) -> None:
        if self.backend == "triton":
            ra.move_hnd_tokens(self.pages, src, dst, self.num_layers, self.num_kv_heads, self.num_blocks)
        else:
            ra.move_tokens(self.kv_caches, src, dst, self.kmap, self.vmap)

    def reserve_fed(self, req_id: ReqId, n: int) -> np.ndarray:
        """Page slots ``[R, n]`` for the next ``n`` tokens of every row, taking *every* block the pool was fed
        (vLLM's new blocks for this request: what this rank's rows need, or one more that another
        tensor-parallel rank needs, held as free pages). RuntimeError when vLLM gave fewer than needed (the
        scheduler's accounting out of sync)."""
        need = self.table.blocks_needed(req_id, n)
        fed = self.pool.pending()
        if fed < need:
            raise RuntimeError(f"vtoken: the scheduler gave row request {req_id!r} {fed} new block(s), its rows need "
                               f"{need} (the cache length reported is out of sync)")
        return self.table.reserve(req_id, n, self.pool.allocate(fed) or [], spare=True)[0]

    def scheduler_len(self, req_id: ReqId, need: int | None = None) -> int:
        """The cache length to report to the scheduler's block manager (module doc): it then holds exactly
        this request's blocks and allocates the next one exactly when the next token needs it (``need``: the
        blocks the next token needs, agreed over tensor-parallel ranks; default this table's)."""
        st = self.table.get(req_id)
        need = self.table.blocks_needed(req_id, 1) if need is None else need
        if need > 1:
            raise RuntimeError(f"vtoken: row request {req_id!r} needs {need} blocks for one token (a block has a "
                               "page for every row)")
        return max(0, min(st.logical_len, len(st.blocks) * self.block_size - (0 if need else 1)))

    def positions(self, req_id: ReqId) -> list[np.ndarray]:
        """Live true positions of every row (copies)."""
        return [p.copy() for p in self.table.get(req_id).pos]

    def step(self, req_ids: Sequence[str], query_lens: np.ndarray, cache_lens: np.ndarray, block_rows: np.ndarray,
             isa: str) -> RowStep:
        """Every layer's :class:`RowBatch` for a step whose batch is ``req_ids`` (in batch order; row requests
        and uniform ones): ``query_lens [B]`` new tokens, ``cache_lens [B]`` uniform requests' cache lengths
        including them (ignored for row requests, whose rows were reserved), ``block_rows [B, W]`` vLLM's block
        table (host)."""
        L, H, bs, nb = self.num_layers, self.num_kv_heads, self.block_size, self.num_blocks
        b_n = len(req_ids)
        is_row = np.fromiter((r in self.table.requests for r in req_ids), bool, b_n)
        row_i, uni_i = np.flatnonzero(is_row), np.flatnonzero(~is_row)
        lens = np.zeros((b_n, L, H), np.int64)
        parts: list[tuple[np.ndarray, np.ndarray]] = []
        if row_i.size:
            pt, ln = self.table.batch_tables([req_ids[i] for i in row_i])  # [Br, R, W1]
            parts.append((row_i, ra.vllm_pages(pt, L, H, nb).reshape(row_i.size, L, H, -1)))
            lens[row_i] = ln.reshape(-1, L, H)
        if uni_i.size:
            cl = np.asarray(cache_lens, np.int64)[uni_i]
            w2 = max(1, int(cdiv(int(cl.max(initial=0)), bs)))
            blk = np.asarray(block_rows[uni_i, :w2], np.int64)
            blk = np.where(np.arange(w2)[None, :] < -(-cl[:, None] // bs), blk, -1)  # [Bu, W2]
            pg = (np.arange(L)[None, :, None, None] * nb + blk[:, None, None, :]) * H + np.arange(H)[None, None, :, None]
            parts.append((uni_i, np.where(blk[:, None, None, :] >= 0, pg, -1)))
            lens[uni_i] = cl[:, None, None]
        width = max(p.shape[-1] for _, p in parts)
        pages = np.full((b_n, L, H, width), -1, np.int64)
        for idx, p in parts:
            pages[idx, :, :, : p.shape[-1]] = p
        q = np.asarray(query_lens, np.int64)[:b_n]
        batches = [ra.build_row_batch(q, lens[:, layer], pages[:, layer].reshape(b_n * H, width), bs)
                   for layer in range(L)]
        if self.device.type != "cpu":  # once per step, not once per layer call
            batches = [b.to(self.device) for b in batches]
        return RowStep(self.pages, batches, isa, self.backend)


class RowAccess:
    """The driver's :class:`~vtoken_runtime.eviction.RowAccess` over the worker's row cache: the decode
    re-eviction of position-class rows (DuoAttention's streaming heads, ``eviction.streams_rows``).
    Tensor-parallel ranks hold one vLLM list for rows of different lengths, so they agree on the blocks kept
    (the largest need over the ranks), as the handoff does; the freed tail reaches the scheduler with the
    step's report (:meth:`VllmRowCache.scheduler_len`), like the handoff's."""

    def __init__(self, rows: VllmRowCache, collective: object | None) -> None:
        self.rows, self.collective = rows, collective

    def row_view(self, req_id: ReqId) -> tuple[list[np.ndarray], np.ndarray, int]:
        return self.rows.row_view(req_id)

    def row_evict(self, req_id: ReqId, keep: list[np.ndarray]) -> int:
        col = self.collective
        hold = col.max([self.rows.blocks_for(keep)])[0] if col is not None else 0  # type: ignore[attr-defined]
        return int(self.rows.evict(req_id, keep, hold=hold).tokens_evicted)


__all__ = ["RowAccess", "RowStep", "VllmRowCache"]
