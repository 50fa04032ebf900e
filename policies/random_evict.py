"""Random eviction - the baseline of the seed paper.

The vToken paper (arXiv 2608.13263) evaluates H2O, Scissorhands and uniform random
token eviction; random eviction is also the classic control in Zhang et al. (H2O,
arXiv:2306.14048). Scores are a seeded counter hash, so runs are reproducible.
"""

import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(4), vt.recent(32)], granularity="head", name="random")
def random_evict(s: vt.TokenStats):
    return s.random
