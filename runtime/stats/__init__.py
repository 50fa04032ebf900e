"""The statistics catalog's collectors for the runtime.

``vtoken_sdk.stats.CATALOG`` says what each statistic means (one meaning everywhere); this package
computes it: :mod:`.torch_stats` holds the update rules as tensor math (the torch backend: the HF adapter's
collector and the vLLM fallback), :mod:`.cpu_kernel` the numba backend (CPU) and
``vtoken_runtime.kernels.attn_stats_triton`` the Triton one (CUDA); :mod:`.collector` applies a backend to a
:class:`~vtoken_runtime.cache.VTokenCache` for one layer and one step. Both adapters (HF, vLLM) use the same
collector. The tests' ground truth is ``tests/oracles/stats_reference.py`` (no code shared with these). The
vector statistics' query summaries come from :mod:`.query_vectors` (the per-request query window store the
adapters' attention hooks write) with the model's rotary tables from :mod:`.rope`; keys and values are read
from the KV cache itself (``VTokenCache.gather_kv_vectors``).
"""

from __future__ import annotations

from .collector import StatsCollector
from .query_vectors import QueryWindows
from .torch_stats import ATTENTION_STATS, KV_STATS, fold, needs_probs, step_contributions, visibility

__all__ = ["ATTENTION_STATS", "KV_STATS", "QueryWindows", "StatsCollector", "fold", "needs_probs", "step_contributions",
           "visibility"]
