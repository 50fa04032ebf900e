"""H2O - Heavy-Hitter Oracle.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", NeurIPS 2023 (arXiv:2306.14048). Keeps the tokens that received the
most accumulated attention ("heavy hitters") plus the most recent tokens.
"""

import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(4), vt.recent(32)], granularity="head")
def h2o(s: vt.TokenStats):
    return s.attn_sum
