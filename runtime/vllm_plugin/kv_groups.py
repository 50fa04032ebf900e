"""Which of vLLM's KV cache groups vToken evicts in: the one full-attention group.

vLLM's hybrid KV cache manager gives a model with sliding-window layers (Gemma 2/3, gpt-oss, Mistral-style
windows) one KV cache group per attention type and size (``KVCacheConfig.kv_cache_groups``), each with its
own block list per request, its own manager and its own block table in the runner::

    group 0  SlidingWindowSpec   layers 0, 2, ...   vLLM's SlidingWindowManager: blocks past the window are
                                                    freed (null blocks in the list); positions are true
    group 1  FullAttentionSpec   layers 1, 3, ...   vToken: the evicting manager by cache length, the token
                                                    table, the compacted slots and lengths

Sliding-window layers are left to vLLM (their blocks are already bounded by the window); eviction, the token
table, the statistics and the block accounting cover the full-attention group only, and the other groups'
attention metadata keep vLLM's true lengths (the worker gives their builders the true lengths, see
``VTokenRunnerMixin._vt_true_length_builders``). A model with one group is the case with no sliding window.

Refused, by name: no full-attention group (every layer windowed: nothing to evict), more than one (one token
table spans one block list), a window inside the full-attention group (the hybrid manager is off:
``--disable-hybrid-kv-cache-manager``), and group types that are neither (Mamba, MLA, cross-attention, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def evicting_group(groups: Sequence[Any], *, hybrid: bool = True) -> int:
    """The index of the full-attention group among vLLM's KV cache groups ``groups``; ``ValueError`` naming the
    groups when the model is not one vToken runs (module doc). ``hybrid=False``: only a model with one group
    (the GPU worker)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    full = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)]
    other = [i for i, g in enumerate(groups) if i not in full and not isinstance(g.kv_cache_spec, SlidingWindowSpec)]
    if other or len(full) != 1:
        why = (f"groups of types {sorted({kinds[i] for i in other})} (vToken evicts in full-attention layers and "
               "leaves sliding-window layers to vLLM)" if other else
               "no full-attention group (every layer has a sliding window: nothing to evict)" if not full else
               f"{len(full)} full-attention groups (one token table spans one block list)")
        raise ValueError(f"vtoken: unsupported KV cache groups {kinds}: {why}")
    spec = groups[full[0]].kv_cache_spec
    if getattr(spec, "sliding_window", None):
        raise ValueError("vtoken: sliding-window layers share the full-attention KV cache group (vLLM's hybrid KV "
                         "cache manager is off); leave --disable-hybrid-kv-cache-manager unset")
    if len(groups) > 1 and not hybrid:
        raise ValueError(f"vtoken: a hybrid model (KV cache groups {kinds}) runs in the CPU worker only: the GPU "
                         "worker gives every group the same metadata")
    return full[0]
