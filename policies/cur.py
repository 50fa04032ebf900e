"""CurDKV - approximate leverage scores of keys and values.

Sengupta et al., "Value-Guided KV Compression for LLMs via Approximated CUR Decomposition"
(arXiv:2509.15038); kvpress ``CURPress`` (defaults: ``kv_product``, local windows of 16, 4 sinks).
Squared key and value norms, each normalised by its sum over the token's 16-token window, multiplied.
A window's sum is its mean times its size, ``(max - p) + (p - min) + 1`` of its positions
(``chunk_max(age) - age = p - min``): contiguous at prefill, where kvpress runs. The 4 sinks are
pinned (kvpress scores them 1.0).
"""

import vtoken_sdk as vt

W = 16


@vt.policy(budget=vt.Budget(ratio=0.5, when="prefill"), protect=[vt.sinks(4)], granularity="head")
def cur(s: vt.TokenStats):
    k2, v2 = s.key_norm * s.key_norm, s.value_norm * s.value_norm
    size = vt.chunk_max(s.position, W) - s.position + vt.chunk_max(s.age, W) - s.age + 1.0
    return k2 / (vt.chunk_mean(k2, W) * size) * (v2 / (vt.chunk_mean(v2, W) * size))
