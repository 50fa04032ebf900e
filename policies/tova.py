"""TOVA - Token Omission Via Attention.

Oren et al., "Transformers are Multi-State RNNs", EMNLP 2024 (arXiv:2401.06104).
Keeps the tokens the latest query attends to most, averaged over the heads of each
layer (one decision per layer); the newest token is always kept.
"""

import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.recent(1)], granularity="head")
def tova(s: vt.TokenStats):
    return vt.head_mean(s.attn_last)
