"""KeyDiff - keep the keys least similar to the average key.

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments" (arXiv:2504.15364); kvpress ``KeyDiffPress``: the score is minus
the cosine similarity of each cached (post-RoPE) key to the mean of the normalised keys of its head.
Query-free and attention-free. No protection, as in kvpress. Written as ``k.u / |u| / |k|`` rather
than ``vt.cosine`` (same value but for cosine's 1e-8 floor): the fused kernel then needs no spills.
"""

import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5), granularity="head")
def keydiff(s: vt.TokenStats):
    u = vt.token_mean(s.key / vt.norm(s.key))
    return -vt.dot(s.key, u / vt.norm(u)) / vt.norm(s.key)
