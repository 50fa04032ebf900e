"""Paged attention reference in torch (ground truth for the vToken layer; not a fast kernel).

    query          [B, Q, H_q, D]        Q = 1 for decode, a chunk for chunked prefill (pad: pos -1)
    key/value      [NB, bs, H_kv, D]     any strides (the vllm_cpu layout is a permuted view)
    block_tables   [B, max_blocks] int32 virtual slot j of request b -> block block_tables[b, j // bs]
    cache_lens     [B] int32             virtual slots 0..cache_len-1 are visible (live + holes)
    query_pos      [B, Q] int64          true positions of the queries (-1 = padding row)
    key_positions  [R_l, NB * bs] int64  true position of the token in each physical slot (-1 = dead);
                                         R_l = H_kv at head granularity (per-row mappings), 1 otherwise

GQA: H_q = G * H_kv, query head g * ... is grouped as [H_kv, G] (query head h_q uses KV head h_q // G).
Causal masking is by *true position*: key k is visible to query q iff key_pos <= query_pos, which after
compaction (tokens out of slot order) is the only correct rule. Without ``key_positions`` the vLLM rule
is used: key index j is visible to query i iff j <= cache_len - query_len + i (ordered layouts only).
Invalid keys: j >= cache_len, key_pos < 0 (evicted: the naive baseline's holes), ``slot_valid`` False.
"""

from __future__ import annotations

import math

import torch

from .token_table import slot_index


def _gather_heads_first(cache: torch.Tensor, blk: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """Rows ``cache[blk, off]`` of a ``[NB, bs, H, D]`` cache as ``[B, H, L, D]`` float32 (contiguous).

    When the layout allows a flat ``[NB * bs * H, D]`` view, one ``index_select`` gathers the rows
    directly in heads-first order (row ``slot * H + h``): one pass instead of gather + transpose.
    The vLLM CPU layout (a permuted view) takes the generic advanced-indexing path."""
    B, L = blk.shape
    NB, bs, H, D = cache.shape
    try:
        flat = cache.view(NB * bs * H, D)
    except RuntimeError:
        return cache[blk, off].transpose(1, 2).to(torch.float32).contiguous()
    slot = blk * bs + off  # [B, L]
    idx = (slot[:, None, :] * H + torch.arange(H, device=slot.device)[None, :, None]).reshape(-1)
    return flat.index_select(0, idx).view(B, H, L, D).to(torch.float32)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cache_lens: torch.Tensor,
    query_pos: torch.Tensor,
    key_positions: torch.Tensor | None = None,
    scale: float | None = None,
    slot_valid: torch.Tensor | None = None,
    return_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns ``(out [B, Q, H_q, D], probs [B, H_kv, Q, max_len] or None)``.

    ``probs`` are the attention probabilities summed over the query heads sharing each KV head,
    indexed by virtual slot (what a stats collector scatters into the per-slot store). Padding query
    rows produce zeros. ``slot_valid`` is an optional ``[B, H_kv or 1, max_len]`` bool mask.
    """
    B, Q, Hq, D = query.shape
    NB, bs, Hkv, _ = key_cache.shape
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} not a multiple of kv heads {Hkv}")
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    dev = query.device
    lens = cache_lens.to(dev, torch.int64)
    L = int(lens.max().item()) if B else 0
    L = max(L, 1)
    j = torch.arange(L, device=dev)
    slots, in_range = slot_index(block_tables.to(dev), lens, L, bs)  # [B, L]
    blk, off = slots // bs, slots % bs
    k = _gather_heads_first(key_cache, blk, off)  # [B, Hkv, L, D] float32, contiguous
    v = _gather_heads_first(value_cache, blk, off)
    qf = query.to(torch.float32).view(B, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Q, D)
    scores = torch.matmul(qf, k.transpose(-1, -2)).view(B, Hkv, G, Q, L) * scale  # [B, Hkv, G, Q, L]

    qpos = query_pos.to(dev, torch.int64)  # [B, Q]
    valid = in_range[:, None, None, None, :] & (qpos >= 0)[:, None, None, :, None]  # [B, 1, 1, Q, L]
    if key_positions is not None:
        kp = key_positions.to(dev)[:, slots]  # [R_l, B, L]
        kp = kp.permute(1, 0, 2)[:, :, None, None, :]  # [B, R_l, 1, 1, L]
        valid = valid & (kp >= 0) & (kp <= qpos[:, None, None, :, None])
    else:
        qlen = (qpos >= 0).sum(dim=1)  # [B]
        i = torch.arange(Q, device=dev)
        limit = (lens - qlen)[:, None] + i[None, :]  # [B, Q]
        valid = valid & (j[None, None, :] <= limit[:, :, None])[:, None, None, :, :]
    if slot_valid is not None:
        valid = valid & slot_valid.to(dev)[:, :, None, None, :L]
    scores = scores.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # fully masked (padding) rows
    out = torch.matmul(probs.view(B, Hkv, G * Q, L), v).view(B, Hkv, G, Q, D)
    out = out.permute(0, 3, 1, 2, 4).reshape(B, Q, Hq, D).to(query.dtype)
    return out, (probs.sum(dim=2) if return_probs else None)


def dense_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Dense ground truth for one request: ``query [Q, H_q, D]``, ``keys/values [H_kv, N, D]``,
    ``query_pos [Q]``, ``key_pos [H_kv or 1, N]`` -> ``[Q, H_q, D]`` (causal by true position)."""
    Q, Hq, D = query.shape
    Hkv = keys.shape[0]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qf = query.to(torch.float32).view(Q, Hkv, G, D)
    s = torch.einsum("qhgd,hnd->hgqn", qf, keys.to(torch.float32)) * scale
    mask = key_pos[:, None, None, :] <= query_pos[None, None, :, None]
    p = torch.nan_to_num(torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1), nan=0.0)
    return torch.einsum("hgqn,hnd->qhgd", p, values.to(torch.float32)).reshape(Q, Hq, D).to(query.dtype)
