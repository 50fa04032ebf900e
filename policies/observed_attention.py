"""ObservedAttention - average attention a token received from the queries that saw it.

kvpress ``ObservedAttentionPress`` (NVIDIA kvpress 0.5.5), an H2O variant (Zhang et al., "H2O:
Heavy-Hitter Oracle", arXiv:2306.14048): attention summed over the queries, divided by how many
queries could attend the key (``N - j`` at prefill, ``age + 1``), averaged over the query heads of
the KV head (here summed: same order). No sinks, no window: kvpress protects nothing.
"""

import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5), granularity="head")
def observed_attention(s: vt.TokenStats):
    return s.attn_sum / (s.age + 1.0)
