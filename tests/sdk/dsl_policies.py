"""Test policies for the vector statistics and the reductions of the DSL (not shipped: ``policies/`` holds
the shipped ones). ``tests/cases.py`` runs the generic tests over them; ``vtoken-cli compile`` AOT-compiles
this file (tests/triton/test_dsl_ops.py). Each one is the few lines a researcher writes."""

import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(2)], granularity="head")
def keydiff(s: vt.TokenStats):
    """KeyDiff (arXiv:2504.15364), kvpress KeyDiffPress: evict keys most similar to the mean normalised key."""
    return -vt.cosine(s.key, vt.token_mean(s.key / vt.norm(s.key)))


@vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.recent(4)], granularity="head")
def chunkkv(s: vt.TokenStats):
    """ChunkKV (arXiv:2502.00299): SnapKV-style scores averaged over the heads of a layer and over chunks of
    8 tokens, so top-k keeps whole chunks (one layer-wide chunk set, as kvpress ChunkKVPress)."""
    return vt.chunk_mean(vt.head_mean(s.attn_window), 8)


@vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(1)], granularity="head")
def observed_attention(s: vt.TokenStats):
    """kvpress ObservedAttentionPress: attention averaged over the queries that saw each token
    (seq_len - position of them = age + 1)."""
    return s.attn_sum / (s.age + 1.0)


@vt.policy(budget=vt.Budget(ratio=0.4), protect=[vt.sinks(1), vt.recent(2)], granularity="head")
def attn_zscore(s: vt.TokenStats):
    """Standardised accumulated attention plus a sharpened softmax of the last query's attention, with a
    chunk-max bonus: every token reduction of the DSL in one score."""
    z = (s.attn_sum - vt.token_mean(s.attn_sum)) / (vt.token_std(s.attn_sum) + 1e-3)
    last = vt.softmax(s.attn_last * 4.0) * vt.token_sum(s.attn_last)
    return z + last + vt.chunk_max(s.attn_last, 4) / (vt.token_max(s.attn_last) + 1.0)


@vt.policy(budget=vt.Budget(ratio=0.5), granularity="request")
def layer_weighted(s: vt.TokenStats):
    """Deeper layers weigh more; the head index breaks ties (s.layer / s.head as broadcast indices)."""
    return s.attn_sum * (s.layer + 1.0) + 0.01 * s.head + vt.token_max(s.attn_last)


@vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(1)], granularity="head")
def query_dot(s: vt.TokenStats):
    """Expected attention logit of the recent queries' mean (post-RoPE), weighted by the value norm."""
    return vt.dot(s.key, s.query_mean) / vt.sqrt(s.head_dim) * vt.norm(s.value)


class EAParams(vt.Params):
    epsilon: float = 0.0


@vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(4)], granularity="head", params=EAParams(),
           stats=vt.StatsConfig(obs_window=64, future_window=512))
def expected_attention(s: vt.TokenStats, p: EAParams):
    """kvpress ExpectedAttentionPress: softmax over the keys of E[q.k / sqrt(D)] under a Gaussian of the
    recent queries (mean and covariance rotated by the average RoPE of the next future_window positions),
    per query head, averaged over the G query heads, times the value norm."""
    d = s.head_dim
    logits = vt.dot(s.key, s.query_mean_future) / vt.sqrt(d) + vt.quad(s.query_cov_future, s.key) / d / 2.0
    return (vt.group_mean(vt.softmax(logits)) + p.epsilon) * vt.norm(s.value)


POLICIES = {p.name: p for p in (keydiff, chunkkv, observed_attention, attn_zscore, layer_weighted, query_dot,
                                expected_attention)}
