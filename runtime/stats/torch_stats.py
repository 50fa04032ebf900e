"""Update rules of the attention statistics (``vtoken_sdk.stats.CATALOG``) as torch tensor math: the torch
statistics backend (``StatsCollector``'s ``backend="torch"``, the HF adapter's collector and the fallback when
no compiled kernel runs), which the numba and Triton kernels equal (tests/runtime/test_stats_cpu_kernel.py,
tests/triton/test_stats_collector_parity.py). It is not an oracle: the tests' ground truth is the independent
``tests/oracles/stats_reference.py``.

For one layer and one engine step (a decode token or a prefill chunk). Request ``b`` has query
tokens ``q`` with true positions ``qpos[b, q]`` (-1 = padding; valid queries are the request's newest
tokens, at indices ``0 .. qn-1``) and virtual key slots ``j < cache_lens[b]``. Key ``j`` is *visible*
to query ``q`` iff its true position ``kpos`` (``-1`` = dead) satisfies ``0 <= kpos <= qpos``.

    P[b, h, q, j]   softmax over visible j of scale * q_g . k_j, summed over the G query heads g of
                    KV head h; 0 where j is not visible to q
    n_vis(q)        the number of keys visible to q (per KV head at head granularity; dead slots of a
                    naive-mode cache excluded): the uniform share of q's attention is G / n_vis(q)
    in_window(q)    prompt_lens[b] - obs_window <= qpos < prompt_lens[b]
    low(q, j)       visible(q, j) and P < low_attn_threshold * G / n_vis(q)
    decay           1 - 1 / history_window

    attn_sum[h, s]        += sum_q P
    attn_last[h, s]        = P[q = qn - 1]                    (0 if qn = 0)
    attn_window[h, s]     += sum_{q in window} P              (chunking-independent; decode adds 0)
    low_attn_count[h, s]   = c * decay^qn + sum_q low(q, j) * decay^(qn - 1 - q)

The last rule is the per-query recurrence ``c = c * decay + low`` applied in query order, so it does not
depend on how queries are split into steps either.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from vtoken_sdk.stats import ATTENTION_STATS, KV_STATS, StatsConfig

from ..slot_stats import scatter_into
from ..token_table import slot_index

SET_STATS = ("attn_last",)  # overwritten each step; the others accumulate


def needs_probs(stat_names: Iterable[str]) -> bool:
    return any(s in ATTENTION_STATS for s in stat_names)


def visibility(key_positions: torch.Tensor, block_tables: torch.Tensor, cache_lens: torch.Tensor, block_size: int,
               width: int, query_pos: torch.Tensor) -> torch.Tensor:
    """``visible [B, R, Q, width]``: key slot ``j < width`` (virtual, through ``block_tables [B, nb]`` and
    ``cache_lens [B]``) is visible to query ``q`` (``query_pos [B, Q]``) by true position, from
    ``key_positions [R, S]`` (R = H_kv or 1)."""
    slots, in_range = slot_index(block_tables, cache_lens, width, block_size)
    kp = key_positions[:, slots].permute(1, 0, 2)[:, :, None, :]  # [B, R, 1, L]
    qpos = query_pos.to(kp.device, torch.int64)[:, None, :, None]
    return in_range[:, None, None, :] & (qpos >= 0) & (kp >= 0) & (kp <= qpos)


def step_contributions(probs: torch.Tensor, visible: torch.Tensor | None, query_pos: torch.Tensor,
                       cache_lens: torch.Tensor, prompt_lens: torch.Tensor, group_size: int, cfg: StatsConfig,
                       names: Iterable[str], detail: bool = False) -> dict[str, torch.Tensor]:
    """Per-virtual-slot contributions ``name -> [B, H_kv, L]`` of ``probs [B, H_kv, Q, L]`` for the
    attention statistics in ``names``, plus ``"low_attn_scale" [B]`` (the decay of the old count).
    ``visible [B, R, Q, L]`` is needed for ``low_attn_count`` only. ``detail`` adds ``"P"``,
    ``"threshold" [B, R, Q, 1]`` and ``"weight" [B, Q]`` (tests locate values on the threshold)."""
    names = set(names)
    dev = probs.device
    B, H, Q, L = probs.shape
    qpos = query_pos.to(dev, torch.int64)
    valid_q = qpos >= 0
    qn = valid_q.sum(1)
    P = probs.to(torch.float32) * valid_q[:, None, :, None]
    i = torch.arange(Q, device=dev)[None, :]
    out: dict[str, torch.Tensor] = {}
    if "attn_sum" in names:
        out["attn_sum"] = P.sum(2)
    if "attn_last" in names:
        out["attn_last"] = (P * (valid_q & (i == qn[:, None] - 1))[:, None, :, None]).sum(2)
    if "attn_window" in names:
        plen = prompt_lens.to(dev, torch.int64)[:, None]
        win = valid_q & (qpos >= plen - cfg.obs_window) & (qpos < plen)
        out["attn_window"] = (P * win[:, None, :, None]).sum(2)
    if "low_attn_count" in names:
        if visible is None:
            raise ValueError("low_attn_count needs the visibility mask")
        n_vis = visible.sum(-1, keepdim=True)  # [B, R, Q, 1]: keys each query sees (dead slots excluded)
        thr = cfg.low_attn_threshold * group_size / n_vis.clamp(min=1).to(torch.float32)
        low = (P < thr) & visible
        decay = 1.0 - 1.0 / cfg.history_window
        w = decay ** (qn[:, None] - 1 - i).clamp(min=0).to(torch.float32) * valid_q  # [B, Q]
        out["low_attn_count"] = (low.to(torch.float32) * w[:, None, :, None]).sum(2)
        out["low_attn_scale"] = decay ** qn.to(torch.float32)
        if detail:
            out.update(P=P, threshold=thr, weight=w)
    return out


def fold(layer_stats: dict[str, torch.Tensor], contrib: dict[str, torch.Tensor], b_idx: torch.Tensor,
         j_idx: torch.Tensor, slots: torch.Tensor) -> None:
    """Fold contributions into one layer's stores ``layer_stats[name] [H_kv, S]`` (in place) at the
    visible (request ``b_idx``, virtual slot ``j_idx``) pairs whose physical slots are ``slots [M]``:
    add, overwrite (``attn_last``) or decay-and-add (``low_attn_count``)."""
    for name, t in layer_stats.items():
        vals = contrib[name][b_idx, :, j_idx].T  # [H, M]
        if name in SET_STATS:
            scatter_into(t, slots, vals, "set")
            continue
        if name == "low_attn_count":
            scatter_into(t, slots, contrib["low_attn_scale"].to(t.device)[b_idx].expand(t.shape[0], -1), "scale")
        scatter_into(t, slots, vals, "sum")

__all__ = ["ATTENTION_STATS", "KV_STATS", "SET_STATS", "fold", "needs_probs", "step_contributions", "visibility"]
