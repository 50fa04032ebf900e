"""Observability inside vLLM: Prometheus counters (``vtoken_*`` on the server's ``/metrics``) and logging
in vLLM's own format.

Counters are created once per process, at 0, when the engine starts (the scheduler's block manager
creates them), so ``/metrics`` lists every ``vtoken_*`` counter before the first request. The API server
exposes the engine-core process's counters through prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, which
``vtoken-cli serve`` sets to a fresh directory); in-process engines (``LLM``) use the default registry.
Only tensor-parallel rank 0 records eviction counters (every rank makes the same decisions).

``vtoken_blocks_freed_total`` counts KV blocks freed by eviction that stay freed, as the scheduler's block
manager sees them (``EvictingAttentionManager.blocks_kept_freed``): a block freed at one step and allocated
to the same request at its next step is not counted (with a budget of whole blocks and slack 0 a decoding
request takes one block and gives it back at every step: none of those is counted). The blocks a request
gave back since its last allocation count when it finishes or is preempted; the blocks vLLM frees then do
not count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

_COUNTERS: Counters | None = None


@dataclass(frozen=True)
class Counters:
    tokens_evicted: Any
    blocks_freed: Any
    tokens_moved: Any
    evictions: Any
    policy_failures: Any
    rejected: Any
    reclaim_seconds: Any
    policy_seconds: Any


def counters() -> Counters:
    """The process's ``vtoken_*`` Prometheus counters."""
    global _COUNTERS
    if _COUNTERS is None:
        from prometheus_client import Counter

        _COUNTERS = Counters(
            Counter("vtoken_tokens_evicted", "Row-tokens evicted by vtoken policies"),
            Counter("vtoken_blocks_freed", "KV blocks freed by vtoken eviction that stay freed (not allocated "
                                           "again to the same request at its next step)"),
            Counter("vtoken_tokens_moved", "Row-tokens moved by vtoken reclamation (compaction copies)"),
            Counter("vtoken_evictions", "Request evictions (a request trimmed to its budget in one step)"),
            Counter("vtoken_policy_failures", "Requests whose policy failed (they fall back to no eviction)"),
            Counter("vtoken_rejected_requests", "Requests rejected at admission for invalid vtoken options"),
            Counter("vtoken_reclaim_seconds", "Seconds spent applying masks and reclaiming (plan + submit)"),
            Counter("vtoken_policy_seconds", "Seconds spent building statistics batches and selecting"),
        )
    return _COUNTERS


def record_step(report: Any) -> None:
    """Add one :class:`~vtoken_runtime.eviction.StepReport` to the counters (all but ``blocks_freed``, which
    the scheduler's block manager counts)."""
    c = counters()
    if report.evicted:
        c.tokens_evicted.inc(sum(report.evicted.values()))
        c.evictions.inc(len(report.evicted))
        c.tokens_moved.inc(report.reclaim.tokens_moved)
    if report.failed:
        c.policy_failures.inc(len(report.failed))
    c.reclaim_seconds.inc(report.reclaim_seconds)
    c.policy_seconds.inc(report.policy_seconds)


def use_vllm_logging() -> None:
    """Route the ``vtoken`` loggers through vLLM's handlers (its format: level, timestamp, file:line)."""
    vllm_log = logging.getLogger("vllm")
    ours = logging.getLogger("vtoken")
    if not vllm_log.handlers or ours.handlers:
        return
    for h in vllm_log.handlers:
        ours.addHandler(h)
    ours.setLevel(vllm_log.level or logging.INFO)
    ours.propagate = False
