"""DuoAttention - retrieval heads keep the whole context, streaming heads only sinks + recent tokens.

Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads"
(arXiv:2410.10819); kvpress ``DuoAttentionPress``. DuoAttention learns which KV heads retrieve; here the
split is made for SmolLM2-135M (30 layers x 3 KV heads) by ``python -m vtoken_bench.duo_heads``: the
quarter of the heads whose query heads put the most attention on a passkey needle while the answer is
produced (the retrieval score of Wu et al., arXiv:2404.15574; 8 passkey prompts of 1,024 tokens, seed 0;
``tests/bench/test_duo_heads.py`` reruns it against this list). Streaming heads keep the 4 sinks and the
64 most recent positions; the score and the budget are not used (the classes decide). SmolLM2 only: on
another model regenerate the list (``--json``) and pass it as ``vt.HeadClasses(retrieval=...)``.
"""

import vtoken_sdk as vt

RETRIEVAL = ((6, 0), (7, 2), (8, 0), (14, 0), (14, 1), (15, 2), (17, 0), (17, 1), (18, 2), (19, 1), (20, 1),
             (20, 2), (21, 0), (21, 1), (21, 2), (22, 1), (22, 2), (23, 0), (23, 1), (23, 2), (24, 1), (28, 0))


@vt.policy(budget=vt.Budget(ratio=0.5, when="prefill"), granularity="head",
           allocation=vt.HeadClasses(retrieval=RETRIEVAL, sinks=4, recent=64, num_layers=30, num_kv_heads=3))
def duo_attention(s: vt.TokenStats):
    return s.position
