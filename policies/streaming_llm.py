"""StreamingLLM - attention sinks plus a sliding window.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024
(arXiv:2309.17453). Keeps the first tokens (sinks) and the most recent ones: scoring by
position makes the budget select the newest tokens.
"""

import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(4)], granularity="request")
def streaming_llm(s: vt.TokenStats):
    return s.position
