"""Statistics collection inside vLLM: an attention-impl wrapper that collects only what the policy reads.

The wrapper sits on ``Attention.impl`` of every decoder layer (vLLM's custom ops look the impl up at
run time, so wrapping the instance changes no vLLM file and keeps the unmodified kernel):

    do_kv_cache_update(layer, k, v, kv_cache, slot_mapping)   vLLM writes K/V (reshape_and_cache), then
                                                              key_norm / value_norm are set for the new
                                                              slots (from the very K/V just cached)
    forward(layer, q, k, v, kv_cache, md, output)             the unmodified paged kernel runs; then, only
                                                              if the policy reads attention statistics,
                                                              the torch paged-attention reference
                                                              recomputes probabilities of the current
                                                              queries over the paged cache
                                                              (``VTokenCache.attention(return_probs)``)
                                                              and updates attn_sum / attn_last /
                                                              attn_window / low_attn_count

Update rules (probabilities ``p`` are summed over the G query heads sharing a KV head):

    attn_sum        += sum over this step's queries
    attn_last        = p of the request's last query of the step
    attn_window     prefill: sum over the prompt's last ``obs_window`` queries (SnapKV's window);
                    decode: decayed running window ``w = w * (1 - 1/W) + p``
    low_attn_count  prefill: number of the prompt's last ``history_window`` queries giving the token
                    less than ``low_attn_threshold * G / visible`` (uniform share); decode: decayed
                    count ``c = c * (1 - 1/hw) + [p < thr * G / visible]``

The decode rules for the two windowed statistics are constant-memory approximations of a sliding
window (an exact window would need the last W probability rows per token); documented in docs/vllm.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

ATTN_STATS = ("attn_sum", "attn_last", "attn_window", "low_attn_count")
KV_STATS = ("key_norm", "value_norm")


@dataclass
class StepContext:
    """What the attention wrapper needs for one engine step (built in ``_prepare_inputs``).

    ``tok_index [B, Q]`` rows of the flat query tensor (-1 = padding), ``query_pos [B, Q]`` true
    positions (-1 = padding), ``prompt_len [B]``, for the requests whose attention statistics are
    collected (``md`` covers exactly those, in the same order).
    """

    req_ids: list[str]
    md: Any
    tok_index: torch.Tensor
    query_pos: torch.Tensor
    prompt_len: torch.Tensor
    collect_attn: bool


class VTokenAttentionImpl:
    """Delegating wrapper around a vLLM ``AttentionImpl`` (everything not overridden is forwarded)."""

    def __init__(self, inner: Any, runner: Any, layer_index: int) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_layer", layer_index)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_inner"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    @property
    def __class__(self) -> type:  # isinstance checks in vLLM see the wrapped impl's class
        return type(self._inner)

    # ------------------------------------------------------------------ hooks
    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        self._inner.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        col = self._runner._vt_collector
        if col is not None and col.kv_stats and self._runner._vt_step is not None:
            col.key_value_norms(self._layer, key, value, slot_mapping)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor, **kw: Any) -> torch.Tensor:
        out = self._inner.forward(layer, query, key, value, kv_cache, attn_metadata, output=output, **kw)
        step = self._runner._vt_step
        col = self._runner._vt_collector
        if step is not None and attn_metadata is not None and col is not None and step.collect_attn:
            col.attention_stats(self._layer, query, step, float(self._inner.scale))
        return out


class StatsCollector:
    """Writes the declared statistics into the ``VTokenCache`` slot store (per physical slot)."""

    def __init__(self, cache: Any, stat_names: tuple[str, ...], stats_config: Any) -> None:
        self.cache = cache
        self.names = set(stat_names)
        self.attn = tuple(n for n in ATTN_STATS if n in self.names)
        self.kv_stats = tuple(n for n in KV_STATS if n in self.names)
        self.cfg = stats_config
        self.seconds = 0.0

    # ------------------------------------------------------------------ K/V norms
    def key_value_norms(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        n = int(slots.shape[0])
        k, v = key[:n], value[:n]
        ok = slots >= 0
        s = slots[ok].to(torch.int64)
        for name, x in (("key_norm", k), ("value_norm", v)):
            if name in self.kv_stats:
                t = self.cache.store.tensor(name)[layer]  # [H, S]; fenced in _prepare_inputs
                t[:, s] = torch.linalg.vector_norm(x[ok].float(), dim=-1).T

    # ------------------------------------------------------------------ attention statistics
    def attention_stats(self, layer: int, query: torch.Tensor, step: StepContext, scale: float) -> None:
        cache, md = self.cache, step.md
        idx = step.tok_index
        q = query[idx.clamp(min=0)]  # [B, Q, Hq, D]
        q = torch.where((idx >= 0)[:, :, None, None], q, torch.zeros((), dtype=q.dtype))
        _, probs = cache.attention(layer, q, md, step.query_pos, return_probs=True, scale=scale)
        assert probs is not None  # [B, Hkv, Q, Lm]
        B, H, Q, Lm = probs.shape
        qpos = step.query_pos
        valid_q = qpos >= 0  # [B, Q]
        if "attn_sum" in self.attn:
            cache.accumulate_stats("attn_sum", layer, md, probs.sum(2), reduce="sum")
        if "attn_last" in self.attn:
            last = (valid_q.to(torch.int64).cumsum(1).argmax(1))  # index of the last valid query
            cache.accumulate_stats("attn_last", layer, md, probs[torch.arange(B), :, last], reduce="set")
        if "attn_window" in self.attn or "low_attn_count" in self.attn:
            G = int(query.shape[1]) // H
            plen = step.prompt_len[:, None]
            is_prefill_q = (qpos < plen) & valid_q  # [B, Q]
            is_decode_q = (qpos >= plen) & valid_q
            for name, w in (("attn_window", self.cfg.obs_window), ("low_attn_count", self.cfg.history_window)):
                if name not in self.attn:
                    continue
                if name == "attn_window":
                    contrib = probs
                else:
                    visible = (probs > 0).sum(-1, keepdim=True).clamp(min=1).to(probs.dtype)
                    thr = float(self.cfg.low_attn_threshold) * G / visible
                    jj = torch.arange(Lm)[None, None, None, :]
                    in_len = jj < md.cache_lens.to(torch.int64)[:, None, None, None]
                    # a key is counted when it is visible to the query (causal by true position) or was
                    # simply not attended by it; keys at or after the query never count
                    contrib = ((probs < thr) & in_len & (probs > 0)).to(probs.dtype)
                # prefill: exact window over the prompt's last w queries
                in_win = is_prefill_q & (qpos >= plen - w)
                pre = (contrib * in_win[:, None, :, None]).sum(2)  # [B, H, Lm]
                has_pre = bool(in_win.any())
                if has_pre:
                    cache.accumulate_stats(name, layer, md, pre, reduce="sum")
                if bool(is_decode_q.any()):
                    self._decayed(name, layer, md, contrib, is_decode_q, w)

    def _decayed(self, name: str, layer: int, md: Any, contrib: torch.Tensor, mask_q: torch.Tensor, w: int) -> None:
        """``x = x * (1 - 1/w) + c`` once per decode query, in query order (vectorized over requests)."""
        cache = self.cache
        t = cache.store.tensor(name)[layer]  # [H, S]
        bs = cache.block_size
        B, H, Q, Lm = contrib.shape
        j = torch.arange(Lm)
        lens = md.cache_lens.to(torch.int64)
        bt = md.block_tables.to(torch.int64)
        blk = bt[:, (j // bs).clamp(max=bt.shape[1] - 1)]
        slot = blk * bs + j % bs  # [B, Lm]
        decay = 1.0 - 1.0 / float(w)
        for qi in range(Q):
            ok = mask_q[:, qi][:, None] & (j[None, :] < lens[:, None])  # [B, Lm]
            if not bool(ok.any()):
                continue
            b_idx, j_idx = torch.nonzero(ok, as_tuple=True)
            s = slot[b_idx, j_idx]
            t[:, s] = t[:, s] * decay + contrib[b_idx, :, qi, j_idx].T


def build_step_index(qsl: np.ndarray, positions: np.ndarray, sel: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``tok_index [B, Q]`` and ``query_pos [B, Q]`` (-1 padded) for the selected batch rows ``sel``."""
    lens = [int(qsl[i + 1] - qsl[i]) for i in sel]
    Q = max(lens) if lens else 1
    tok = np.full((len(sel), Q), -1, dtype=np.int64)
    pos = np.full((len(sel), Q), -1, dtype=np.int64)
    for b, i in enumerate(sel):
        a, e = int(qsl[i]), int(qsl[i + 1])
        tok[b, : e - a] = np.arange(a, e)
        pos[b, : e - a] = positions[a:e]
    return torch.from_numpy(tok), torch.from_numpy(pos)
