"""AdaSnapKV - SnapKV's window vote with AdaKV's budgets: a layer's tokens go to its heads by their scores.

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM
Inference" (arXiv:2407.11550) over SnapKV (Li et al., arXiv:2404.14469); kvpress
``AdaKVPress(SnapKVPress())``. The score is the shipped ``snapkv``'s; the allocation
(``vt.AdaptiveLayer``) keeps ``H x budget`` tokens per layer: every KV head first keeps its own top
``max(1, int(0.2 x budget))`` (kvpress's ``alpha_safeguard``), the rest of the layer's total goes to the
highest scores of all its heads, so heads that attend sharply keep fewer tokens and diffuse heads more.
The window is pinned; evicts once, after prefill.
"""

import vtoken_sdk as vt

WINDOW = 64


@vt.policy(budget=vt.Budget(ratio=0.5, when="prefill"), protect=[vt.recent(WINDOW)], granularity="head",
           stats=vt.StatsConfig(obs_window=WINDOW), allocation=vt.AdaptiveLayer(floor=0.2))
def ada_snapkv(s: vt.TokenStats):
    return vt.avg_pool(vt.where(s.age >= WINDOW, s.attn_window, 0.0), 5)
