"""DiverseHitters - heavy hitters normalised by their observers, boosted by key diversity.

vtoken's own policy, between H2O (Zhang et al., arXiv:2306.14048: attention summed over every
query) and kvpress' ObservedAttention (the sum divided by the ``age + 1`` queries that saw the token):
dividing by ``sqrt(age + 1)`` ranks a token by how consistently it is attended (a sum over n
observers scaled as its noise, sqrt(n)), so old tokens no longer win by age alone and new ones need
more than one glance. Times ``1 + (1 - cos(k, u))`` with ``u`` the mean unit key (KeyDiff,
arXiv:2504.15364): distinctive keys are kept over redundant ones. Sinks and a recent window pinned.
"""

import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(4), vt.recent(32)], granularity="head")
def diverse_hitters(s: vt.TokenStats):
    u = vt.token_mean(s.key / vt.norm(s.key))
    diversity = 1.0 - vt.dot(s.key, u / vt.norm(u)) / vt.norm(s.key)
    return s.attn_sum / vt.sqrt(s.age + 1.0) * (1.0 + diversity)
