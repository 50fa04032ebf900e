"""KNorm - keep low-norm keys.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
EMNLP 2024 (arXiv:2406.11430). Keys with a small L2 norm attract more attention, so the
tokens with the largest key norms are evicted. Needs no attention statistics.
"""

import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5), granularity="head")
def knorm(s: vt.TokenStats):
    return -s.key_norm
