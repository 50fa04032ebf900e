"""vtoken runtime: the vToken layer (block pool, token table, per-slot stats, reclamation planner,
copy engine, paged attention reference), the cache that sequences them, the statistics collector and
the eviction driver the adapters share (HF transformers, the vLLM plugin).

Importing this package is cheap: public names are resolved lazily on first access.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AttentionMetadata",
    "BlockPool",
    "CopyEngine",
    "EvictionDriver",
    "ReclaimStats",
    "StatsCollector",
    "VTokenCache",
    "paged_attention",
]

_LAZY = {
    "AttentionMetadata": ".cache",
    "ReclaimStats": ".cache",
    "VTokenCache": ".cache",
    "BlockPool": ".block_pool",
    "CopyEngine": ".copy_engine",
    "EvictionDriver": ".eviction",
    "StatsCollector": ".stats",
    "paged_attention": ".paged_attention",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
