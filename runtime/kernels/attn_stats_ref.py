"""Test oracle (and benchmark baseline) of the per-slot attention statistics the kernels compute (the Triton
``attn_stats_triton``, the numba ``stats.cpu_kernel``): nothing runs it at run time.

It computes the probabilities densely (``paged_attention``) and applies the torch backend's update rules
(``vtoken_runtime.stats.torch_stats``), wired to a paged cache given as plain tensors, the way the kernels see
it (an oracle for the kernels' tiling, gathers and passes, not for the rules themselves: those are checked
against the independent ``tests/oracles/stats_reference.py``): ``query [B, Q, H_q, D]``, ``key_cache / value_cache
[NB, bs, H_kv, D]``, ``block_tables [B, max_blocks]``, ``cache_lens [B]``, ``query_pos [B, Q]``
(-1 = padding), ``key_positions [R, NB * bs]`` (R = H_kv or 1; -1 = dead), ``prompt_lens [B]``
(default: the end of this step, i.e. the step completes the prompt).
"""

from __future__ import annotations

import math

import torch

from vtoken_sdk.stats import StatsConfig

from ..paged_attention import paged_attention
from ..stats.torch_stats import ATTENTION_STATS, SET_STATS, fold, step_contributions, visibility
from ..token_table import slot_index

STAT_NAMES = ATTENTION_STATS
__all__ = ["SET_STATS", "STAT_NAMES", "apply_step_stats", "step_stats"]


def step_stats(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
               cache_lens: torch.Tensor, query_pos: torch.Tensor, key_positions: torch.Tensor,
               scale: float | None = None, obs_window: int = 32, history_window: int = 64,
               low_attn_threshold: float = 1.0, prompt_lens: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-step contributions indexed by virtual slot: name -> ``[B, H_kv, max_len]`` float32, plus
    ``"low_attn_scale"`` ``[B]`` (the decay applied to the old count), and ``"P"``, ``"visible"``,
    ``"threshold"`` ``[B, 1, Q, 1]``, ``"weight"`` ``[B, Q]`` so tests can locate values that sit on the
    low-attention threshold."""
    B, Q, Hq, D = query.shape
    Hkv = key_cache.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    _, probs = paged_attention(query, key_cache, value_cache, block_tables, cache_lens, query_pos,
                               key_positions=key_positions, scale=scale, return_probs=True)
    assert probs is not None
    dev = query.device
    qpos = query_pos.to(dev, torch.int64)
    Lm = probs.shape[-1]
    vis = visibility(key_positions.to(dev), block_tables.to(dev), cache_lens.to(dev), key_cache.shape[1], Lm,
                     qpos).expand(B, Hkv, Q, Lm)
    plen = qpos.max(1).values + 1 if prompt_lens is None else prompt_lens.to(dev, torch.int64)
    cfg = StatsConfig(obs_window=obs_window, history_window=history_window, low_attn_threshold=low_attn_threshold)
    out = step_contributions(probs, vis, qpos, cache_lens, plen, Hq // Hkv, cfg, STAT_NAMES, detail=True)
    out["visible"] = vis
    return out


def apply_step_stats(stats: dict[str, torch.Tensor], contrib: dict[str, torch.Tensor], block_tables: torch.Tensor,
                     cache_lens: torch.Tensor, query_pos: torch.Tensor, block_size: int) -> None:
    """Fold per-virtual-slot contributions into the layer's stores ``stats[name]`` ``[H_kv, S]``."""
    dev = next(iter(stats.values())).device
    Lm = next(v for k, v in contrib.items() if k in STAT_NAMES).shape[-1]
    slots, ok = slot_index(block_tables.to(dev), cache_lens.to(dev), Lm, block_size)
    b_idx, j_idx = torch.nonzero(ok, as_tuple=True)
    fold(stats, contrib, b_idx, j_idx, slots[b_idx, j_idx])
