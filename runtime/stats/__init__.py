"""The statistics catalog's collectors (torch reference) for the runtime.

``vtoken_sdk.stats.CATALOG`` says what each statistic means (one meaning everywhere); this package
computes it: :mod:`.reference` holds the update rules as tensor math (the ground truth the Triton
kernel is tested against), :mod:`.collector` applies them to a :class:`~vtoken_runtime.cache.VTokenCache`
for one layer and one step. Both adapters (HF, vLLM) use the same collector. The vector statistics'
query summaries come from :mod:`.queries` (the per-request query window store the adapters' attention hooks
write) with the model's rotary tables from :mod:`.rope`; keys and values are read from the KV cache itself
(``VTokenCache.gather_kv_vectors``).
"""

from __future__ import annotations

from .collector import StatsCollector
from .queries import QueryWindows
from .reference import ATTENTION_STATS, KV_STATS, fold, needs_probs, step_contributions, visibility

__all__ = ["ATTENTION_STATS", "KV_STATS", "QueryWindows", "StatsCollector", "fold", "needs_probs", "step_contributions",
           "visibility"]
