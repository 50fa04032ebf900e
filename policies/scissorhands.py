"""Scissorhands - persistence of importance.

Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM
KV Cache Compression at Test Time", NeurIPS 2023 (arXiv:2305.17118). Counts, over a
history window, how often a token received less than average attention and evicts
the tokens with the highest counts; the most recent tokens are protected.
"""

import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(4), vt.recent(32)], granularity="head",
           stats=vt.StatsConfig(history_window=64, low_attn_threshold=1.0))
def scissorhands(s: vt.TokenStats):
    return -s.low_attn_count
