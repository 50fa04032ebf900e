"""The query window store: each request's latest queries per layer, summarised at eviction time.

The query statistics of the catalog (``query_mean``, ``query_mean_future``, ``query_cov_future``;
``vtoken_sdk.stats.QUERY_STATS``) summarise the post-RoPE queries of the last ``W = min(obs_window,
seq_len)`` query tokens of a request (positions ``[seq_len - W, seq_len)``, prompt or generated). The
adapters' attention hooks are the only writers (HF: ``vtoken_attention``; vLLM: the attention-impl
wrapper), the eviction driver the only reader::

    plan(req_ids, tok_index, query_pos) -> WriteIndex   once per step, before the forward: which rows of the
                                                        step's flat queries go to which (request row, slot)
    write(layer, query, index)                          in every layer: ONE index_put of the step's queries
    summaries(req_ids, names, seq_lens, W, F, layers)   at eviction: [B, L, H, ...] float32 per name

Storage: one pooled ring buffer ``[L, rows, window, H_q, D]`` in the model's dtype (the query's own
values: upcasting bf16 to float32 later is exact), plus the true position of each slot (host, numpy).
A query at position ``p`` lives in slot ``p % window``: positions arrive in order, so the last
``window`` positions always occupy distinct slots. Rows are handed out on a request's first recorded
step and returned by :meth:`remove` (request finished, preempted, or recomputed); the pool grows by
doubling and is released when no request holds a row.

Memory per request: ``L * window * H_q * D * itemsize`` bytes (SmolLM2-135M, bf16, window 32:
30 * 32 * 9 * 64 * 2 = 1.1 MB) plus ``window`` int64 positions; ``window`` is the largest ``obs_window``
of the policies that read query statistics. The pool holds ``2^k >= `` the peak number of recorded
requests (on vLLM this memory is allocated after the KV cache, outside its profiled budget).

Summaries (``a`` the attention scaling, ``R(p)`` the model's rotation, :mod:`.rope`): with ``q`` the
recorded post-RoPE queries of the window and ``q_pre = R(p)^-1 q`` (the pre-RoPE queries, exact up to the
rounding of the stored post-RoPE values),

    query_mean          (1 / (G W)) sum_g sum_q q[h G + g, q]                       [B, L, H, D]
    query_mean_future   Rbar mu_g,            mu_g = (1 / W) sum_q q_pre[h G + g, q]  [B, L, H, G, D]
    query_cov_future    Rbar S_g Rbar^T,      S_g = (1 / W) sum_q (q_pre - mu_g)(q_pre - mu_g)^T
                                                                                   [B, L, H, G, D, D]

``Rbar = (1 / F) sum_{p = seq_len}^{seq_len + F - 1} R(p)``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vtoken_sdk.stats import QUERY_STATS

from .rope import RotaryTables

ReqId = Hashable
FUTURE_STATS = ("query_mean_future", "query_cov_future")


@dataclass
class WriteIndex:
    """Where one step's queries go: ``src [M]`` rows of the step's flat query tensor, ``rows [M]`` / ``slots
    [M]`` the destination in the ring buffer (device tensors, computed once per step)."""

    src: torch.Tensor
    rows: torch.Tensor
    slots: torch.Tensor


class QueryWindows:
    """Per-request ring buffers of the last ``window`` queries of every layer (see module doc).

    ``rope``: the model's rotary tables (needed for ``query_mean_future`` / ``query_cov_future`` only;
    None refuses them)."""

    def __init__(self, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int, window: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 rope: RotaryTables | None = None) -> None:
        if window < 1:
            raise ValueError(f"query window must be >= 1, got {window}")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads do not split into {num_kv_heads} KV heads")
        self.num_layers, self.num_q_heads, self.num_kv_heads = num_layers, num_q_heads, num_kv_heads
        self.group_size = num_q_heads // num_kv_heads
        self.head_dim, self.window, self.dtype = head_dim, int(window), dtype
        self.device = torch.device(device)
        self.rope = rope
        self._rows: dict[ReqId, int] = {}
        self._free: list[int] = []
        self._cap = 0
        self._buf: torch.Tensor | None = None  # [L, cap, window, H_q, D]
        self._pos = np.zeros((0, self.window), dtype=np.int64)  # true position per slot, -1 = empty
        self.seconds = 0.0

    # ------------------------------------------------------------------ rows
    @property
    def bytes_per_request(self) -> int:
        return self.num_layers * self.window * self.num_q_heads * self.head_dim * self.dtype.itemsize

    @property
    def capacity(self) -> int:
        return self._cap

    @property
    def request_ids(self) -> list[ReqId]:
        """Requests holding a row."""
        return list(self._rows)

    def has(self, req_id: ReqId) -> bool:
        return req_id in self._rows

    def _row(self, req_id: ReqId) -> int:
        row = self._rows.get(req_id)
        if row is not None:
            return row
        if not self._free:
            self._grow(max(4, 2 * self._cap))
        row = self._free.pop()
        self._pos[row] = -1
        self._rows[req_id] = row
        return row

    def _grow(self, cap: int) -> None:
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor: writable in and out of inference mode
            buf = torch.zeros((self.num_layers, cap, self.window, self.num_q_heads, self.head_dim), dtype=self.dtype,
                              device=self.device)
            if self._buf is not None:
                buf[:, : self._cap] = self._buf
        pos = np.full((cap, self.window), -1, dtype=np.int64)
        pos[: self._cap] = self._pos
        self._free = list(range(cap - 1, self._cap - 1, -1)) + self._free
        self._buf, self._pos, self._cap = buf, pos, cap

    def remove(self, req_id: ReqId) -> None:
        """Forget a request (finished, preempted, recomputed); its row is reused. Unknown ids are ignored."""
        row = self._rows.pop(req_id, None)
        if row is None:
            return
        self._pos[row] = -1
        self._free.append(row)
        if not self._rows:  # nobody records: give the memory back
            self._buf, self._cap, self._free = None, 0, []
            self._pos = np.zeros((0, self.window), dtype=np.int64)

    def fork(self, src: ReqId, dst: ReqId) -> None:
        """``dst`` starts with a copy of ``src``'s window (a shared prefill)."""
        if src not in self._rows:
            return
        self.remove(dst)
        d = self._row(dst)
        s = self._rows[src]
        assert self._buf is not None
        with torch.no_grad():
            self._buf[:, d] = self._buf[:, s]
        self._pos[d] = self._pos[s]

    # ------------------------------------------------------------------ writes
    def plan(self, req_ids: Sequence[ReqId], tok_index: np.ndarray, query_pos: np.ndarray) -> WriteIndex | None:
        """Destinations of one step's queries. ``tok_index [B, Q]``: row of each query in the step's flat
        query tensor (-1 = padding), ``query_pos [B, Q]`` true positions (-1 = padding), per request in
        ascending order. Only each request's last ``window`` queries are written (distinct slots). Records
        the slots' positions now (bookkeeping); the tensors follow in :meth:`write`, layer by layer."""
        tok = np.asarray(tok_index, dtype=np.int64)
        qpos = np.asarray(query_pos, dtype=np.int64)
        if tok.size == 0:
            return None
        rows = np.fromiter((self._row(r) for r in req_ids), dtype=np.int64, count=len(req_ids))
        last = qpos.max(axis=1, initial=-1)
        take = (qpos >= 0) & (tok >= 0) & (qpos > last[:, None] - self.window)
        if not take.any():
            return None
        b_idx = np.nonzero(take)[0]
        p = qpos[take]
        r, s = rows[b_idx], p % self.window
        self._pos[r, s] = p
        dev = self.device
        return WriteIndex(torch.from_numpy(tok[take]).to(dev), torch.from_numpy(r).to(dev),
                          torch.from_numpy(s).to(dev))

    def write(self, layer: int, query: torch.Tensor, index: WriteIndex) -> None:
        """Store the step's queries of ``layer``: ``query`` is the flat ``[T, H_q, D]`` (or ``[T, H_q * D]``)
        post-RoPE query tensor the index was planned for."""
        assert self._buf is not None
        q = query.reshape(query.shape[0], self.num_q_heads, self.head_dim)
        self._buf[layer][index.rows, index.slots] = q[index.src].to(self.dtype)

    # ------------------------------------------------------------------ summaries
    def problems(self, req_ids: Sequence[ReqId], seq_lens: Sequence[int], obs_window: int) -> dict[ReqId, str]:
        """Requests whose last ``min(obs_window, seq_len)`` queries are not all in the store, and why."""
        out: dict[ReqId, str] = {}
        if obs_window > self.window:
            return {r: f"obs_window={obs_window} exceeds the {self.window} queries the store keeps" for r in req_ids}
        for r, n in zip(req_ids, seq_lens, strict=True):
            row = self._rows.get(r)
            if row is None:
                out[r] = f"no queries were recorded for request {r!r}"
                continue
            w = min(obs_window, int(n))
            p = self._pos[row]
            have = int(((p >= n - w) & (p < n) & (p >= 0)).sum())
            if have != w:
                out[r] = (f"the query window of request {r!r} holds {have} of its last {w} queries "
                          "(its queries were not recorded from its first token)")
        return out

    def summaries(self, req_ids: Sequence[ReqId], names: Sequence[str] | set[str] | frozenset[str],
                  seq_lens: Sequence[int], obs_window: int, future_window: int,
                  layers: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """Query statistics ``names`` (a subset of ``QUERY_STATS``) of requests ``req_ids`` with processed
        lengths ``seq_lens``, for layers ``[l0, l1)``: ``name -> [B, l1 - l0, H_kv, ...]`` float32 on the
        store's device. RuntimeError when a request's window is incomplete (its queries were not all
        recorded) or larger than the store keeps."""
        import time

        t0 = time.perf_counter()
        names = [n for n in QUERY_STATS if n in set(names)]
        if not names:
            return {}
        if any(n in FUTURE_STATS for n in names) and self.rope is None:
            raise RuntimeError("query_mean_future / query_cov_future need the model's rotary tables")
        problems = self.problems(req_ids, seq_lens, obs_window)
        if problems:
            raise RuntimeError(next(iter(problems.values())))
        l0, l1 = layers if layers is not None else (0, self.num_layers)
        B, L, H, G, D = len(req_ids), l1 - l0, self.num_kv_heads, self.group_size, self.head_dim
        rows = np.asarray([self._rows[r] for r in req_ids], dtype=np.int64)
        seq = np.asarray(seq_lens, dtype=np.int64)
        w = np.minimum(seq, obs_window)
        pos = self._pos[rows]  # [B, window]
        inwin = (pos >= (seq - w)[:, None]) & (pos < seq[:, None]) & (pos >= 0)
        dev = self.device
        assert self._buf is not None
        m = torch.from_numpy(inwin).to(dev)[:, None, :, None, None]  # [B, 1, W, 1, 1]
        zero = torch.zeros((), dtype=torch.float32, device=dev)
        q = self._buf[l0:l1][:, torch.from_numpy(rows).to(dev)].to(torch.float32).transpose(0, 1)  # [B, L, W, Hq, D]
        q = torch.where(m, q, zero)
        wt = torch.from_numpy(w).to(dev, torch.float32)
        out: dict[str, torch.Tensor] = {}
        if "query_mean" in names:
            out["query_mean"] = (q.sum(2).view(B, L, H, G, D).sum(3) / (G * wt)[:, None, None, None]).contiguous()
        if any(n in FUTURE_STATS for n in names):
            rope = self.rope
            assert rope is not None
            cos, sin = rope.cos_sin(torch.from_numpy(pos).to(dev))  # [B, W, D]
            qp = torch.where(m, rope.rotate(q, cos[:, None, :, None, :], sin[:, None, :, None, :], inverse=True), zero)
            mu = qp.sum(2) / wt[:, None, None, None]  # [B, L, Hq, D]
            cbar, sbar = rope.mean_cos_sin(torch.from_numpy(seq).to(dev), future_window)  # [B, D]
            cb, sb = cbar[:, None, None, :], sbar[:, None, None, :]
            if "query_mean_future" in names:
                out["query_mean_future"] = rope.rotate(mu, cb, sb).view(B, L, H, G, D).contiguous()
            if "query_cov_future" in names:
                x = torch.where(m, qp - mu[:, :, None], zero)
                cov = torch.einsum("blwhd,blwhe->blhde", x, x) / wt[:, None, None, None, None]  # [B, L, Hq, D, D]
                cb2, sb2 = cb[..., None, :], sb[..., None, :]  # [B, 1, 1, 1, D]
                cov = rope.rotate(cov, cb2, sb2, dim=-2)  # Rbar S (along the row index d)
                cov = rope.rotate(cov, cb2, sb2, dim=-1)  # (Rbar S) Rbar^T (along the column index e)
                out["query_cov_future"] = cov.view(B, L, H, G, D, D).contiguous()
        self.seconds += time.perf_counter() - t0
        return out
