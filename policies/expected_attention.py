"""ExpectedAttention - the attention future queries are expected to pay, times the value norm.

Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution" (arXiv:2510.00636); kvpress ``ExpectedAttentionPress``. Recent queries are modelled as a
Gaussian per query head (mean and covariance of the pre-RoPE queries, rotated by the RoPE averaged
over the next 512 positions); ``E[exp(q.k/sqrt(D))]`` gives the logit ``mu.k/sqrt(D) + k'Sk/(2D)``;
softmax over the keys, mean over the query heads of the KV head, times ``||v||``. The 4 sinks are
pinned and left out of the softmax (kvpress pads them with ``max + 1``). kvpress takes the statistics
of every prompt query but the sinks: ``obs_window >= prompt length - 4`` reproduces that at prefill.
"""

import vtoken_sdk as vt

SINKS = 4


@vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(SINKS)], granularity="head",
           stats=vt.StatsConfig(obs_window=64, future_window=512))
def expected_attention(s: vt.TokenStats):
    d = s.head_dim
    logits = vt.dot(s.key, s.query_mean_future) / vt.sqrt(d) + vt.quad(s.query_cov_future, s.key) / d / 2.0
    logits = vt.where(s.position < SINKS, -1e30, logits)
    return vt.group_mean(vt.softmax(logits)) * vt.norm(s.value)
