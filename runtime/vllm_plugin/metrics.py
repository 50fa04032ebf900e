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

Block-pool gauges (the soak's leak check, ``vtoken-cli bench soak``): ``vtoken_kv_blocks_total`` (the pool's
usable blocks: vLLM's ``num_gpu_blocks`` less its null block), ``vtoken_kv_blocks_free`` (the pool's own free
count, ``BlockPool.get_num_free_blocks``) and ``vtoken_kv_blocks_held`` (the blocks on the manager's request
block lists). Two independent accounts of one pool: ``free + held == total`` whenever the scheduler is between
steps, and ``free == total`` once nothing runs. The scheduler's block manager sets them at start-up and after
every allocation, tail free and request free. In multiprocess mode they are ``livesum`` gauges: the sum over
the live processes that set them, the engine-core processes, one per data-parallel rank, each with its own
pool (``--data-parallel-size 2``: both pools; ``mostrecent`` showed whichever rank wrote last, half the pool;
``tests/vllm/test_vllm_dp.py``); in-process engines use the default registry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

_COUNTERS: Counters | None = None
_POOL: PoolGauges | None = None


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


@dataclass(frozen=True)
class PoolGauges:
    total: Any
    free: Any
    held: Any


def pool_gauges() -> PoolGauges:
    """The process's ``vtoken_kv_blocks_*`` gauges (created once, at 0)."""
    global _POOL
    if _POOL is None:
        from prometheus_client import Gauge

        _POOL = PoolGauges(
            Gauge("vtoken_kv_blocks_total", "Usable KV blocks of the scheduler's block pool (null block excluded)",
                  multiprocess_mode="livesum"),
            Gauge("vtoken_kv_blocks_free", "Free KV blocks, as the block pool counts them",
                  multiprocess_mode="livesum"),
            Gauge("vtoken_kv_blocks_held", "KV blocks on requests' block lists, as the vtoken block manager counts them",
                  multiprocess_mode="livesum"),
        )
    return _POOL


def record_pool(total: int, free: int, held: int) -> None:
    """Set the block-pool gauges (see the module docstring)."""
    g = pool_gauges()
    g.total.set(total)
    g.free.set(free)
    g.held.set(held)


def record_step(report: Any, rows_only: bool = False) -> None:
    """Add one :class:`~vtoken_runtime.eviction.StepReport` to the counters (all but ``blocks_freed``, which
    the scheduler's block manager counts). ``rows_only``: a later pipeline stage, which holds other layers'
    rows of the same requests: only its row-token counts (``tokens_evicted``, ``tokens_moved``) add up; the
    first stage counts the requests, failures and times."""
    c = counters()
    if report.evicted:
        c.tokens_evicted.inc(sum(report.evicted.values()))
        c.tokens_moved.inc(report.reclaim.tokens_moved)
        if not rows_only:
            c.evictions.inc(len(report.evicted))
    if rows_only:
        return
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
