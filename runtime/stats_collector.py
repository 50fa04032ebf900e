"""Per-slot statistics from real attention probabilities (torch path).

Paged attention kernels do not return probabilities, so the adapters ask the
paged attention reference for them (``probs [B, H_kv, Q, L]``: summed over the
query heads of each KV head, indexed by virtual slot) and fold them into the
per-slot store of :class:`~vtoken_runtime.cache.VTokenCache`:

=================  ===========================================================
attn_sum           += sum over this step's queries
attn_last          =  probabilities of the step's last query
attn_window        =  sum over the step's last ``obs_window`` queries (at the end
                      of a prefill: SnapKV's observation window; during decode:
                      the latest query)
low_attn_count     Scissorhands with an exponential history window: per query
                   ``c = c * (1 - 1/history_window) + [p < threshold * G / n_visible]``
                   (G query heads per KV head: ``G / n_visible`` is uniform attention),
                   counted only over keys the query can see
key_norm/value_norm written when K/V are written (see the adapters)
=================  ===========================================================
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .cache import AttentionMetadata, VTokenCache

ATTENTION_STATS = ("attn_sum", "attn_last", "attn_window", "low_attn_count")
NORM_STATS = ("key_norm", "value_norm")


def needs_probs(stat_names: Sequence[str]) -> bool:
    return any(s in ATTENTION_STATS for s in stat_names)


def write_norms(cache: VTokenCache, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Set key/value norms of freshly written tokens: ``k, v [T, H_kv, D]`` at physical ``slots [T]``."""
    names = cache.store.stat_names
    if "key_norm" in names:
        cache.store.tensor("key_norm")[layer][:, slots] = k.float().norm(dim=-1).T
    if "value_norm" in names:
        cache.store.tensor("value_norm")[layer][:, slots] = v.float().norm(dim=-1).T


def update_attention_stats(cache: VTokenCache, layer: int, md: AttentionMetadata, probs: torch.Tensor,
                           query_pos: torch.Tensor, group_size: int, obs_window: int = 32,
                           history_window: int = 64, low_attn_threshold: float = 1.0) -> None:
    """Fold ``probs [B, H_kv, Q, L]`` of one layer into the declared attention statistics.

    ``query_pos [B, Q]`` true positions (-1 = padding query). Queries of a request are its
    newest tokens, so query ``i`` of a request with ``q`` queries and cache length ``n``
    sees ``n - q + i + 1`` live tokens.
    """
    names = cache.store.stat_names
    valid_q = query_pos >= 0  # [B, Q]
    qn = valid_q.sum(1)  # [B]
    B, H, Q, L = probs.shape
    p = probs * valid_q[:, None, :, None]
    if "attn_sum" in names:
        cache.accumulate_stats("attn_sum", layer, md, p.sum(2), reduce="sum")
    last = (qn - 1).clamp(min=0)
    if "attn_last" in names:
        cache.accumulate_stats("attn_last", layer, md, p[torch.arange(B), :, last], reduce="set")
    if "attn_window" in names:
        i = torch.arange(Q)[None, :]
        in_win = valid_q & (i > last[:, None] - obs_window)
        cache.accumulate_stats("attn_window", layer, md, (p * in_win[:, None, :, None]).sum(2), reduce="set")
    if "low_attn_count" in names:
        lens = md.cache_lens.to(torch.int64)
        i = torch.arange(Q)[None, :]
        n_vis = (lens - qn)[:, None] + i + 1  # [B, Q]
        thr = low_attn_threshold * group_size / n_vis.clamp(min=1).to(torch.float32)
        # visibility by true position: key slot j visible to query i iff key_pos <= query_pos
        bs = cache.block_size
        j = torch.arange(L)
        bt = md.block_tables.to(torch.int64)
        blk = bt[:, (j // bs).clamp(max=bt.shape[1] - 1)].clamp(min=0)
        slots = blk * bs + j % bs  # [B, L]
        kp = cache.key_positions(layer)[:, slots].permute(1, 0, 2)  # [B, R_l, L]
        vis = (kp[:, :, None, :] >= 0) & (kp[:, :, None, :] <= query_pos[:, None, :, None])
        vis = vis & (j[None, None, None, :] < lens[:, None, None, None]) & valid_q[:, None, :, None]
        low = (p < thr[:, None, :, None]) & vis  # [B, H, Q, L]
        decay = 1.0 - 1.0 / history_window
        # c_new = c * decay^q + sum_i low_i * decay^(q - 1 - i)
        w = decay ** (qn[:, None] - 1 - i).clamp(min=0).to(torch.float32) * valid_q  # [B, Q]
        add = (low.to(torch.float32) * w[:, None, :, None]).sum(2)  # [B, H, L]
        t = cache.stats_tensor("low_attn_count")[layer]  # [H, S]
        scale = decay ** qn.to(torch.float32)  # [B]
        in_range = j[None, :] < lens[:, None]
        flat = slots[in_range]  # slots of this step's requests
        per_b = scale[:, None].expand(B, L)[in_range]
        t[:, flat] = t[:, flat] * per_b[None, :]
        cache.accumulate_stats("low_attn_count", layer, md, add, reduce="sum")
