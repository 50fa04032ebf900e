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
