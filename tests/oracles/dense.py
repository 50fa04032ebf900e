"""Dense ground truth for the HF adapter: HF's own eager attention and ``DynamicCache``,
with the same kept sets the vToken run chose replayed onto the dense cache.

After each eviction recorded by :class:`~vtoken_runtime.hf_adapter.HFSession`
(``record_keeps=True``: ``(logical_len, kept positions [R, n])``), every layer's dense
K/V is restricted per KV head to the kept positions (in position order). Greedy tokens
of this run must equal the paged, compacted run's (``tests/runtime/test_hf_adapter.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def _restrict(cache: Any, cur: list[np.ndarray], kept: np.ndarray, num_layers: int, num_heads: int) -> None:
    for layer in range(num_layers):
        lay = cache.layers[layer]
        rows = kept[layer * num_heads:(layer + 1) * num_heads] if kept.shape[0] > 1 else np.repeat(kept, num_heads, 0)
        idx = np.stack([np.searchsorted(cur[layer][h], rows[h]) for h in range(num_heads)])  # [H, k]
        for h in range(num_heads):
            if not np.array_equal(cur[layer][h][idx[h]], rows[h]):
                raise RuntimeError("kept positions are not a subset of the dense cache")
        it = torch.as_tensor(idx)[None, :, :, None]
        lay.keys = torch.gather(lay.keys, 2, it.expand(lay.keys.shape[0], -1, -1, lay.keys.shape[-1]))
        lay.values = torch.gather(lay.values, 2, it.expand(lay.values.shape[0], -1, -1, lay.values.shape[-1]))
        cur[layer] = rows.copy()


@torch.inference_mode()
def dense_greedy(model: Any, prompt: Sequence[int], max_new_tokens: int,
                 keep_log: Sequence[tuple[int, np.ndarray]] = (), chunk_size: int | None = None) -> list[int]:
    """Greedy decoding with a dense cache restricted to the kept sets of ``keep_log``. ``chunk_size``:
    the prompt is fed in chunks of that size and a kept set recorded at a chunk boundary (eviction
    during prefill, ``Budget(when="chunks")``) restricts the cache before the next chunk."""
    from transformers import DynamicCache

    cfg = model.config
    old = cfg._attn_implementation
    cfg._attn_implementation = "eager"
    try:
        L, H = cfg.num_hidden_layers, cfg.num_key_value_heads
        keeps = dict(keep_log)
        cache = DynamicCache(config=cfg)
        n = len(prompt)
        step = chunk_size or n
        cur = [np.zeros((H, 0), dtype=np.int64) for _ in range(L)]
        for a in range(0, n, step):
            b = min(n, a + step)
            out = model(input_ids=torch.tensor([list(prompt[a:b])]), position_ids=torch.arange(a, b)[None],
                        past_key_values=cache, use_cache=True)
            cur = [np.concatenate([c, np.tile(np.arange(a, b), (H, 1))], axis=1) for c in cur]
            if b in keeps:
                _restrict(cache, cur, keeps[b], L, H)
        gen: list[int] = []
        pos = n
        for step in range(max_new_tokens):
            t = int(out.logits[0, -1].argmax())
            gen.append(t)
            if step == max_new_tokens - 1:
                break
            out = model(input_ids=torch.tensor([[t]]), position_ids=torch.tensor([[pos]]), past_key_values=cache,
                        use_cache=True)
            for layer in range(L):
                cur[layer] = np.concatenate([cur[layer], np.full((H, 1), pos)], axis=1)
            pos += 1
            if pos in keeps:
                _restrict(cache, cur, keeps[pos], L, H)
        return gen
    finally:
        cfg._attn_implementation = old


_ROWS_STATE: dict[str, Any] = {"keep": None}


def _rows_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Eager attention over the full dense cache, causal by index, where (when set) KV head h of this layer
    sees only its kept prompt positions: ``_ROWS_STATE["keep"] [L, H, n_prompt]`` bool; later keys always."""
    B, Hq, Q, D = query.shape
    H, K = key.shape[1], key.shape[2]
    G = Hq // H
    scale = scaling if scaling is not None else D ** -0.5
    q = query.float().view(B, H, G, Q, D)
    s = torch.einsum("bhgqd,bhkd->bhgqk", q, key.float()) * scale
    j, i = torch.arange(K), torch.arange(Q)
    vis = (j[None, :] <= (K - Q) + i[:, None])[None, None, None]  # [1, 1, 1, Q, K]
    keep = _ROWS_STATE["keep"]
    if keep is not None:
        kl = keep[module.layer_idx]  # [H, n]
        full = torch.ones(H, K, dtype=torch.bool)
        full[:, : kl.shape[1]] = kl
        vis = vis & full[None, :, None, None, :]
    p = torch.softmax(s.masked_fill(~vis, float("-inf")), dim=-1)
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, value.float()).reshape(B, Hq, Q, D).transpose(1, 2)
    return out.to(query.dtype), None


@torch.inference_mode()
def dense_greedy_rows(model: Any, prompt: Sequence[int], max_new_tokens: int, kept: Sequence[np.ndarray]) -> list[int]:
    """Greedy decoding with the dense model (full cache, no eviction) where, once the prompt has run, KV head
    ``h`` of layer ``l`` attends only to the prompt positions ``kept[l * H + h]`` (and to every generated
    token): the ground truth for a session whose rows keep unequal sets after prefill (issue 38)."""
    return dense_greedy_row_steps(model, prompt, max_new_tokens, [(len(prompt), kept)])


@torch.inference_mode()
def dense_greedy_row_steps(model: Any, prompt: Sequence[int], max_new_tokens: int,
                           keep_log: Sequence[tuple[int, Sequence[np.ndarray]]]) -> list[int]:
    """:func:`dense_greedy_rows` for a session that evicts its rows again during decode: ``keep_log`` is the
    driver's ``[(logical length at the eviction, kept positions per row), ...]`` in order. The token at position
    ``p`` attends, in row ``r``, to the latest eviction's kept positions (the one with length ``<= p``) and to
    every position from that length on. The first eviction must be the one after the prompt."""
    from transformers import AttentionInterface, DynamicCache
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("vtoken_dense_rows", _rows_attention)
    AttentionMaskInterface.register("vtoken_dense_rows", lambda *args, **kwargs: None)
    cfg = model.config
    old = cfg._attn_implementation
    cfg._attn_implementation = "vtoken_dense_rows"
    L, H, n = cfg.num_hidden_layers, cfg.num_key_value_heads, len(prompt)
    if not keep_log or keep_log[0][0] != n:
        raise ValueError(f"the first eviction must be after the prompt ({n} tokens), got {[a for a, _ in keep_log]}")
    masks = []
    for at, kept in keep_log:
        keep = torch.zeros(L, H, at, dtype=torch.bool)
        for r, p in enumerate(kept):
            keep[r // H, r % H, torch.as_tensor(np.asarray(p), dtype=torch.long)] = True
        masks.append((at, keep))
    try:
        _ROWS_STATE["keep"] = None
        cache = DynamicCache(config=cfg)
        out = model(input_ids=torch.tensor([list(prompt)]), position_ids=torch.arange(n)[None], past_key_values=cache,
                    use_cache=True)
        gen: list[int] = []
        for step in range(max_new_tokens):
            t = int(out.logits[0, -1].argmax())
            gen.append(t)
            if step == max_new_tokens - 1:
                break
            pos = n + step
            _ROWS_STATE["keep"] = [k for at, k in masks if at <= pos][-1]
            out = model(input_ids=torch.tensor([[t]]), position_ids=torch.tensor([[pos]]), past_key_values=cache,
                        use_cache=True)
        return gen
    finally:
        _ROWS_STATE["keep"] = None
        cfg._attn_implementation = old
