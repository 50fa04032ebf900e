"""AdaExpectedAttention - ExpectedAttention's scores with AdaKV's budgets (a layer's tokens shared by score).

Feng et al., Ada-KV (arXiv:2407.11550) over Devoto et al., Expected Attention (arXiv:2510.00636); kvpress
``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))``, the leaderboard's best press at 0.5. The score is
the shipped ``expected_attention``'s with kvpress's ``epsilon`` added to the attention before the value
norm (``(a + 1e-2) x ||v||``: a head whose attention is spread thin still ranks its tokens by their
values); the allocation (``vt.AdaptiveLayer(floor=0.2)``) keeps ``H x budget`` tokens per layer, each head
first its own top ``max(1, int(0.2 x budget))``, the rest to the layer's highest scores. Sinks pinned;
evicts once, after prefill (kvpress compresses the prefill).
"""

import vtoken_sdk as vt

SINKS, EPSILON = 4, 1e-2


@vt.policy(budget=vt.Budget(ratio=0.5, when="prefill"), protect=[vt.sinks(SINKS)], granularity="head",
           stats=vt.StatsConfig(obs_window=64, future_window=512), allocation=vt.AdaptiveLayer(floor=0.2))
def ada_expected_attention(s: vt.TokenStats):
    d = s.head_dim
    logits = vt.dot(s.key, s.query_mean_future) / vt.sqrt(d) + vt.quad(s.query_cov_future, s.key) / d / 2.0
    logits = vt.where(s.position < SINKS, -1e30, logits)
    return (vt.group_mean(vt.softmax(logits)) + EPSILON) * vt.norm(s.value)
