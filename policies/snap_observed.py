"""SnapObserved - SnapKV's observation-window vote plus ObservedAttention's lifetime mean in the upper layers.

vtoken's own policy. SnapKV (Li et al., arXiv:2404.14469) keeps what the prompt's last ``W`` queries
attend to: the best guess of what the continuation reads, but blind to tokens the tail does not look
at (a fact far before the question). kvpress' ObservedAttention (H2O's attention sum over the
``age + 1`` queries that saw the token) keeps what the prompt as a whole attends to. Both are
per-query means of attention probabilities (window sum / W, lifetime sum / (age + 1)), so they add on
one scale. The lifetime mean is added (twice) only from layer ``FIRST_LAYER`` on: in the lower layers
attention is local and the lifetime mean of a token mostly says how recent it is, which costs the
continuation's perplexity there; the upper layers are where a fact read across the whole prompt (the
pass key) shows up. The window vote is max-pooled over 5 tokens (the SnapKV repository's pooling): the
neighbours of a token the tail reads stay with it. Sinks and the window pinned; evicts once, after
prefill, as SnapKV. Picked in round 7 of the own-policy search (docs/benchmarks.md): the same
perplexity as the all-layer sum over the whole essay corpus, the pass key kept after eviction far more often.
"""

import vtoken_sdk as vt

W = 64
FIRST_LAYER = 15  # the upper half of SmolLM2-135M's 30 layers; set it to half the depth of your model


@vt.policy(budget=vt.Budget(ratio=0.5, when="prefill"), protect=[vt.sinks(4), vt.recent(W)], granularity="head",
           stats=vt.StatsConfig(obs_window=W))
def snap_observed(s: vt.TokenStats):
    vote = vt.max_pool(vt.where(s.age >= W, s.attn_window / W, 0.0), 5)
    return vote + vt.where(s.layer >= FIRST_LAYER, 2.0 * s.attn_sum / (s.age + 1.0), 0.0)
