"""PyramidKV - SnapKV's window vote, more tokens to the lower layers (a linear pyramid).

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"
(arXiv:2406.02069); kvpress ``PyramidKVPress()``. The score is the shipped ``snapkv``'s; the allocation
(``vt.Pyramid(beta=20, window=64)``, kvpress's ``get_layer_budget``) gives layer 0 about
``2 x budget`` tokens per head and the last layer about ``budget / 20``, in a straight line between,
every head of a layer the same. Where the pyramid does not fit the prompt (a short prompt) every layer
keeps ``budget``. The window is pinned; evicts once, after prefill.
"""

import vtoken_sdk as vt

WINDOW = 64


@vt.policy(budget=vt.Budget(ratio=0.5, when="prefill"), protect=[vt.recent(WINDOW)], granularity="head",
           stats=vt.StatsConfig(obs_window=WINDOW), allocation=vt.Pyramid(beta=20, window=WINDOW))
def pyramidkv(s: vt.TokenStats):
    return vt.avg_pool(vt.where(s.age >= WINDOW, s.attn_window, 0.0), 5)
