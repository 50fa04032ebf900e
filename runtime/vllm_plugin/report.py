"""The two messages between the vToken scheduler and its workers, attributes on vLLM's own step objects (they
travel with them, pickled, to and from worker processes). No vLLM import: both sides read it.

    worker -> scheduler   ``ModelRunnerOutput.vtoken_report`` (:data:`REPORT_ATTR`): ``{req_id: Truncation}``,
                          one per request evicted in the step
    scheduler -> worker   ``SchedulerOutput.vtoken_rows`` (:data:`ROWS_ATTR`): ``{req_id: [block ids]}``, the
                          whole block list of the evicting KV cache group for each scheduled request whose list
                          shrank since it was last sent (this step's new blocks included, and left out of the
                          step's ``new_block_ids``); the runner replaces its copy of the row in place
"""

from __future__ import annotations

from typing import NamedTuple

REPORT_ATTR = "vtoken_report"
ROWS_ATTR = "vtoken_rows"


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
