"""AdaSnapObserved - the project's own snap_observed with AdaKV's budgets (a layer's tokens shared by score).

vtoken's ``snap_observed`` (SnapKV's window vote, arXiv:2404.14469, plus ObservedAttention's lifetime mean
in the upper half of the layers, arXiv:2306.14048) with the allocation of Ada-KV (Feng et al.,
arXiv:2407.11550): ``vt.AdaptiveLayer(floor=0.2)`` keeps ``H x budget`` tokens per layer, every KV head
first its own top ``max(1, int(0.2 x budget))``, the rest to the highest scores of all the layer's heads.
Both terms are per-query means of attention probabilities, so scores of different heads compare on one
scale, which a shared layer budget needs. Sinks and the window pinned; evicts once, after prefill.
"""

import vtoken_sdk as vt

W = 64


@vt.policy(budget=vt.Budget(ratio=0.5, when="prefill"), protect=[vt.sinks(4), vt.recent(W)], granularity="head",
           stats=vt.StatsConfig(obs_window=W), allocation=vt.AdaptiveLayer(floor=0.2))
def ada_snap_observed(s: vt.TokenStats):
    vote = vt.max_pool(vt.where(s.age >= W, s.attn_window / W, 0.0), 5)
    return vote + vt.where(s.layer >= s.num_layers / 2, 2.0 * s.attn_sum / (s.age + 1.0), 0.0)
