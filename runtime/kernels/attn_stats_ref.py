"""Torch reference of the per-slot attention statistics (what attn_stats_triton computes).

Definitions, for one layer and one engine step (a decode token or a prefill chunk). Request ``b``
has query tokens ``q`` with true positions ``qpos[b, q]`` (``-1`` = padding) and visible virtual key
slots ``j < cache_lens[b]`` whose physical slot is ``slot(b, j) = block_tables[b, j // bs] * bs +
j % bs`` and true position ``kpos = key_positions[r, slot]`` (``r`` = KV head ``h`` at head
granularity, 0 otherwise; ``-1`` = dead). Key ``j`` is *visible* to query ``q`` iff ``qpos >= 0``,
``kpos >= 0`` and ``kpos <= qpos`` (causal by true position, exactly as ``paged_attention``).

    P[b, h, q, j]   softmax over visible j of scale * q_g . k_j, summed over the G query heads g
                    of KV head h (GQA); 0 where j is not visible to q
    qn[b]           number of valid queries; they are the request's newest tokens, at indices
                    q = 0 .. qn-1 (``vtoken_runtime.stats_collector`` makes the same assumption)
    n_vis(q)        cache_lens[b] - qn + q + 1: the keys a causal query q sees in a hole-free cache
    low(q, j)       visible(q, j) and P[b, h, q, j] < low_attn_threshold * G / n_vis(q)
                    (G / n_vis = the uniform attention summed over the G heads)
    decay           1 - 1 / history_window

Per-slot updates, for every request and every j < cache_lens[b] (slot s = slot(b, j), KV head h),
identical to ``vtoken_runtime.stats_collector.update_attention_stats``:

    attn_sum[h, s]        += sum_{q < qn} P                                (accumulated attention, H2O)
    attn_last[h, s]        = P[q = qn - 1]            (0 if qn = 0)        (latest query, TOVA)
    attn_window[h, s]      = sum_{qn - 1 - obs_window < q < qn} P          (SnapKV's observation window)
    low_attn_count[h, s]   = c * decay^qn + sum_{q < qn} low(q, j) * decay^(qn - 1 - q)
                             (Scissorhands' low-attention count with an exponential history window)
"""

from __future__ import annotations

import math

import torch

from ..paged_attention import paged_attention

STAT_NAMES = ("attn_sum", "attn_last", "attn_window", "low_attn_count")
SET_STATS = ("attn_last", "attn_window")  # overwritten each step; the others accumulate


def step_stats(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cache_lens: torch.Tensor,
    query_pos: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float | None = None,
    obs_window: int = 32,
    history_window: int = 64,
    low_attn_threshold: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Per-step contributions indexed by virtual slot: name -> ``[B, H_kv, max_len]`` float32, plus
    ``"low_attn_scale"`` ``[B]`` (the decay applied to the old count), and ``"P"``, ``"visible"``,
    ``"threshold"`` ``[B, 1, Q, 1]``, ``"weight"`` ``[B, Q]`` so tests can locate values that sit on the
    low-attention threshold."""
    B, Q, Hq, D = query.shape
    Hkv = key_cache.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    _, probs = paged_attention(query, key_cache, value_cache, block_tables, cache_lens, query_pos,
                               key_positions=key_positions, scale=scale, return_probs=True)
    assert probs is not None
    dev = query.device
    qpos = query_pos.to(dev, torch.int64)
    valid_q = qpos >= 0  # [B, Q]
    qn = valid_q.sum(1)  # [B]
    P = probs.to(torch.float32) * valid_q[:, None, :, None]  # [B, Hkv, Q, Lm]
    Lm = P.shape[-1]
    bs = key_cache.shape[1]
    j = torch.arange(Lm, device=dev)
    lens = cache_lens.to(dev, torch.int64)
    bt = block_tables.to(dev, torch.int64)
    blk = bt[:, (j // bs).clamp(max=bt.shape[1] - 1)]
    slots = blk * bs + j % bs  # [B, Lm]
    kp = key_positions.to(dev)[:, slots].permute(1, 0, 2)  # [B, R, Lm]
    vis = ((j[None, :] < lens[:, None])[:, None, None, :] & valid_q[:, None, :, None]
           & (kp[:, :, None, :] >= 0) & (kp[:, :, None, :] <= qpos[:, None, :, None]))  # [B, R, Q, Lm]
    vis = vis.expand(B, Hkv, Q, Lm)
    i = torch.arange(Q, device=dev)[None, :]
    last = (qn - 1).clamp(min=0)
    is_last = valid_q & (i == last[:, None])
    win = valid_q & (i > last[:, None] - obs_window)
    n_vis = (lens - qn)[:, None] + i + 1
    thr = low_attn_threshold * G / n_vis.clamp(min=1).to(torch.float32)  # [B, Q]
    low = (P < thr[:, None, :, None]) & vis
    decay = 1.0 - 1.0 / history_window
    w = decay ** (qn[:, None] - 1 - i).clamp(min=0).to(torch.float32) * valid_q  # [B, Q]
    return {
        "attn_sum": P.sum(2),
        "attn_last": (P * is_last[:, None, :, None]).sum(2),
        "attn_window": (P * win[:, None, :, None]).sum(2),
        "low_attn_count": (low.to(torch.float32) * w[:, None, :, None]).sum(2),
        "low_attn_scale": decay ** qn.to(torch.float32),
        "P": P, "visible": vis, "threshold": thr[:, None, :, None], "weight": w,
    }


def apply_step_stats(stats: dict[str, torch.Tensor], contrib: dict[str, torch.Tensor], block_tables: torch.Tensor,
                     cache_lens: torch.Tensor, query_pos: torch.Tensor, block_size: int) -> None:
    """Fold per-virtual-slot contributions into the layer's stores ``stats[name]`` ``[H_kv, S]``:
    add (``attn_sum``), overwrite (``attn_last``/``attn_window``), decay-and-add (``low_attn_count``)."""
    for name, t in stats.items():
        v = contrib[name]  # [B, H, Lm]
        B, H, Lm = v.shape
        dev = t.device
        j = torch.arange(Lm, device=dev)
        ok = j[None, :] < cache_lens.to(dev, torch.int64)[:, None]
        bt = block_tables.to(dev, torch.int64)
        slot = bt[:, (j // block_size).clamp(max=bt.shape[1] - 1)] * block_size + j % block_size
        b_idx, j_idx = torch.nonzero(ok, as_tuple=True)
        s = slot[b_idx, j_idx]
        flat = (torch.arange(H, device=dev)[:, None] * t.shape[1] + s[None, :]).reshape(-1)
        vals = v[b_idx, :, j_idx].T.reshape(-1).to(torch.float32)
        if name in SET_STATS:
            t.view(-1).index_copy_(0, flat, vals)
            continue
        if name == "low_attn_count":
            sc = contrib["low_attn_scale"].to(dev)[b_idx].expand(H, -1).reshape(-1)
            t.view(-1).index_copy_(0, flat, t.view(-1)[flat] * sc)
        t.view(-1).index_add_(0, flat, vals)
