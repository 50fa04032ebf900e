"""SnapObserved - SnapKV's observation-window vote plus ObservedAttention's lifetime mean.

vtoken's own policy. SnapKV (Li et al., arXiv:2404.14469) keeps what the prompt's last ``W`` queries
attend to: the best guess of what the continuation reads, but blind to tokens the tail does not look
at (a fact far before the question). kvpress' ObservedAttention (H2O's attention sum over the
``age + 1`` queries that saw the token) keeps what the prompt as a whole attends to. Both are
per-query means of attention probabilities (window sum / W, lifetime sum / (age + 1)), so they add on
one scale: a token stays if the tail or the whole prompt relies on it. Only the window vote is
pooled, with a max over 5 tokens (the SnapKV repository's default pooling; kvpress averages): a token
next to one the tail reads gets that token's vote, so the neighbours of a fact stay with it. Sinks and
the window pinned; evicts once, after prefill, as SnapKV. Picked on held-out text (docs/benchmarks.md,
rounds 5 and 6 of the own-policy search).
"""

import vtoken_sdk as vt

W = 64


@vt.policy(budget=vt.Budget(ratio=0.5, when="prefill"), protect=[vt.sinks(4), vt.recent(W)], granularity="head",
           stats=vt.StatsConfig(obs_window=W))
def snap_observed(s: vt.TokenStats):
    window = vt.where(s.age >= W, s.attn_window / W, 0.0)
    return s.attn_sum / (s.age + 1.0) + vt.max_pool(window, 5)  # this order compiles without spills on sm_90
