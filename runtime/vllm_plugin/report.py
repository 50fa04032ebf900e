"""What the worker tells the scheduler after a step (``ModelRunnerOutput.vtoken_report``): one
:class:`Truncation` per request evicted in the step. No vLLM import: both sides read it."""

from __future__ import annotations

from typing import NamedTuple


class Truncation(NamedTuple):
    """After this step's eviction the request's token table holds ``cache_len`` of its ``true_len`` tokens
    (``true_len``: the request's length when the report was made, so a report read a step late still gives
    the right eviction count ``true_len - cache_len``).

    ``intact``: the request's first position ever evicted in any (layer, KV head) row, or ``-1`` when the
    worker does not track it (prefix caching off). Every position before it is still in place, with the
    K/V it was computed with before the request's first eviction: the blocks below it are what the
    scheduler may offer to the prefix cache (:meth:`~.block_manager.EvictingAttentionManager.cache_blocks`)."""

    true_len: int
    cache_len: int
    intact: int = -1
