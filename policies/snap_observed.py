"""SnapObserved - SnapKV's window vote plus ObservedAttention's lifetime mean in the upper half of the layers.

vtoken's own policy. Each (layer, KV head) row scores a token by SnapKV's vote (Li et al.,
arXiv:2404.14469): the attention it got from the prompt's last ``W`` queries, per query
(``attn_window / W``), max-pooled over 5 tokens so the neighbours of a token the tail reads stay with
it; in the upper half of the model's layers (``s.layer >= s.num_layers / 2``) it adds twice kvpress'
ObservedAttention (H2O's attention sum over the ``age + 1`` queries that saw the token, Zhang et al.,
arXiv:2306.14048). Both are per-query means of attention probabilities, so they add on one scale.
Sinks and the window pinned; evicts once, after prefill, as SnapKV. How it was chosen: docs/history.md.
"""

import vtoken_sdk as vt

W = 64


@vt.policy(budget=vt.Budget(ratio=0.5, when="prefill"), protect=[vt.sinks(4), vt.recent(W)], granularity="head",
           stats=vt.StatsConfig(obs_window=W))
def snap_observed(s: vt.TokenStats):
    vote = vt.max_pool(vt.where(s.age >= W, s.attn_window / W, 0.0), 5)
    return vote + vt.where(s.layer >= s.num_layers / 2, 2.0 * s.attn_sum / (s.age + 1.0), 0.0)
