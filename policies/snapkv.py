"""SnapKV - observation-window voting.

Li et al., "SnapKV: LLM Knows What You Are Looking for Before Generation", NeurIPS 2024
(arXiv:2404.14469). Scores each prompt token by the attention it gets from the last
W prompt tokens (the observation window), smoothed by pooling over neighbouring tokens
so that kept tokens come in clusters; the window itself is always kept (and, as in
kvpress, does not leak into its neighbours' pooled scores). Runs after prefill.
"""

import vtoken_sdk as vt

WINDOW = 64


@vt.policy(budget=vt.Budget(ratio=0.5, when="prefill"), protect=[vt.recent(WINDOW)], granularity="head",
           stats=vt.StatsConfig(obs_window=WINDOW))
def snapkv(s: vt.TokenStats):
    return vt.avg_pool(vt.where(s.age >= WINDOW, s.attn_window, 0.0), 5)
