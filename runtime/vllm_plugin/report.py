"""What the worker tells the scheduler after a step (``ModelRunnerOutput.vtoken_report``): one
:class:`Truncation` per request evicted in the step. No vLLM import: both sides read it."""

from __future__ import annotations

from typing import NamedTuple


class Truncation(NamedTuple):
    """After this step's eviction the request's token table holds ``cache_len`` of its ``true_len`` tokens
    (``true_len``: the request's length when the report was made, so a report read a step late still gives
    the right eviction count ``true_len - cache_len``)."""

    true_len: int
    cache_len: int
