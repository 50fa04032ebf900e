"""ChunkKV - keep whole chunks of a layer-wide SnapKV score.

Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM
Inference" (arXiv:2502.00299); kvpress ``ChunkKVPress(press=SnapKVPress())``, chunk_length 20.
SnapKV's window vote (window 64, avg pool 5 not fed by the window) summed over the KV heads of a
layer, the window's own keys scored above everything, averaged per chunk of 20 tokens: every head of
a layer keeps the same whole chunks. kvpress keeps ``int(n_chunks * (1 - r))`` chunks; with a token
budget the lowest kept chunk may be cut (keeping its newest tokens).
"""

import vtoken_sdk as vt

WINDOW, CHUNK = 64, 20


@vt.policy(budget=vt.Budget(ratio=0.5, when="prefill"), granularity="head",
           stats=vt.StatsConfig(obs_window=WINDOW))
def chunkkv(s: vt.TokenStats):
    pooled = vt.avg_pool(vt.head_mean(vt.where(s.age >= WINDOW, s.attn_window, 0.0)), 5)
    return vt.chunk_mean(vt.where(s.age >= WINDOW, pooled, 1e4), CHUNK)
