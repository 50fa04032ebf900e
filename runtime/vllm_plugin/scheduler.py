"""Scheduler side of the vLLM plugin: allocation and freeing by cache length.

vLLM's scheduler sizes a request's KV blocks from ``request.num_computed_tokens`` (the TRUE length,
which drives positions, stop checks and max_model_len and must not change). vToken keeps that and
subtracts, for allocation only, the tokens the worker evicted:

    blocks needed = cdiv(num_computed_tokens - evicted + num_new_tokens, block_size)

``evicted`` is learnt from the worker's report attached to the ModelRunnerOutput of the same step
(``vtoken_report = {req_id: cache_length}``; synchronous scheduling, so the report always arrives
before the next ``schedule()``). When a report arrives the request's tail blocks beyond
``cdiv(cache_length, block_size)`` go back to vLLM's block pool (tail first), exactly the blocks the
worker dropped from its block-table row, and the next ``schedule()`` can admit more requests.
Preemption (recompute) and finishing free everything as usual and reset ``evicted``.

Admission. vLLM admits a waiting request only if its whole sequence fits (``scheduler_reserve_full_isl``,
on by default: no over-admission with chunked prefill). With a budget that evicts after every prefill chunk
(``when="chunks"``) a request never holds its whole prompt: at most its budget plus one chunk. Its admission
check is made on that peak instead (:meth:`VTokenScheduler.admission_tokens`), the point of evicting during
prefill; every other request keeps vLLM's check.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from vtoken_runtime.token_table import cdiv

from .config import PluginConfig, request_options

log = logging.getLogger("vtoken.vllm")


def check_supported(vllm_config: Any) -> None:
    """Refuse configurations the plugin does not handle, with a clear message (start-up time)."""
    cc, sc = vllm_config.cache_config, vllm_config.scheduler_config
    if cc.enable_prefix_caching:
        raise ValueError("vtoken: prefix caching is not supported with token eviction (a shared block would "
                         "be compacted under another request); start the engine with enable_prefix_caching=False "
                         "(vllm_engine_args() does this)")
    if getattr(sc, "async_scheduling", False):
        raise ValueError("vtoken: async scheduling is not supported (the scheduler needs the step's eviction "
                         "report before the next schedule()); set async_scheduling=False")
    if vllm_config.speculative_config is not None:
        raise ValueError("vtoken: speculative decoding is not supported")
    if vllm_config.kv_transfer_config is not None:
        raise ValueError("vtoken: KV transfer connectors are not supported")
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        raise ValueError(f"vtoken: pipeline parallelism (pipeline_parallel_size={pc.pipeline_parallel_size}) is "
                         "not supported; tensor parallelism is (ranks agree on every eviction)")


class VTokenScheduler(Scheduler):
    """vLLM v1 ``Scheduler`` allocating by cache length and freeing tail blocks after reclamation."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        self._vt_cfg = PluginConfig.from_vllm_config(vllm_config)
        check_supported(vllm_config)
        super().__init__(vllm_config, *args, **kwargs)
        groups = self.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"vtoken: only one KV cache group is supported, got {len(groups)}")
        self._vt_block_size = groups[0].kv_cache_spec.block_size
        self._vt_evicted: dict[str, int] = {}
        self.vtoken_stats = {"reports": 0, "blocks_freed": 0, "max_running": 0}
        pol = self._vt_cfg.load_policy()
        self._vt_budget = pol.budget if pol is not None else None
        sc = vllm_config.scheduler_config
        lpt = int(getattr(sc, "long_prefill_token_threshold", 0) or 0)
        self._vt_chunk = min(int(sc.max_num_batched_tokens), lpt) if lpt > 0 else int(sc.max_num_batched_tokens)
        mgr = self.kv_cache_manager
        orig, pool = mgr.allocate_slots, mgr.block_pool

        def allocate_slots(request: Any, num_new_tokens: int, *a: Any, **kw: Any) -> Any:
            if kw.get("full_sequence_must_fit"):  # vLLM's admission check of a waiting request
                peak = self.admission_tokens(request)
                if peak < int(request.num_tokens):
                    wm = getattr(mgr, "watermark_blocks", 0) if kw.get("has_scheduled_reqs", True) else 0
                    free = pool.get_num_free_blocks() - int(kw.get("reserved_blocks", 0))
                    if cdiv(peak, self._vt_block_size) + wm > free:
                        return None
                    kw["full_sequence_must_fit"] = False
            ev = self._vt_evicted.get(request.request_id, 0)
            if not ev:
                return orig(request, num_new_tokens, *a, **kw)
            request.num_computed_tokens -= ev  # allocation by cache length; restored right after
            try:
                return orig(request, num_new_tokens, *a, **kw)
            finally:
                request.num_computed_tokens += ev

        mgr.allocate_slots = allocate_slots

    def admission_tokens(self, request: Any) -> int:
        """The most tokens ``request`` will hold during its (re)prefill of ``n`` tokens in chunks of at most the
        step's token budget: :meth:`Budget.chunked_prefill_peak` of its budget with the request's own options
        (``n`` unless the budget evicts after every prefill chunk). An opted-out request, or options that fail to
        parse, hold everything, and so does every request in ``naive`` mode (Naive-Evict frees a block only when
        all its tokens are dead: no budget bounds it)."""
        n = int(request.num_tokens)
        b = self._vt_budget
        if b is None or b.when != "chunks" or self._vt_cfg.mode == "naive":
            return n
        try:
            opts = request_options(getattr(request, "sampling_params", None))
        except ValueError:
            return n
        if not opts.enabled:
            return n
        return b.override(opts.budget_tokens, opts.eviction_ratio).chunked_prefill_peak(n, self._vt_chunk)

    # ------------------------------------------------------------------ bookkeeping
    def evicted_tokens(self, req_id: str) -> int:
        """Tokens of ``req_id`` no longer in the cache (its true length minus its cache length)."""
        return self._vt_evicted.get(req_id, 0)

    def held_blocks(self, req_id: str) -> int:
        mgr = self.kv_cache_manager.coordinator.single_type_managers[0]
        return len(mgr.req_to_blocks.get(req_id, ()))

    def _free_request_blocks(self, request: Any) -> None:
        self._vt_evicted.pop(request.request_id, None)
        super()._free_request_blocks(request)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)
        self.vtoken_stats["max_running"] = max(self.vtoken_stats["max_running"], len(self.running))
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        report = getattr(model_runner_output, "vtoken_report", None)
        if report:
            self._vt_apply(report)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _vt_apply(self, report: dict[str, int]) -> None:
        self.vtoken_stats["reports"] += 1
        mgr = self.kv_cache_manager.coordinator.single_type_managers[0]
        pool = self.kv_cache_manager.block_pool
        bs = self._vt_block_size
        for rid, length in report.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            ev = int(req.num_computed_tokens) - int(length)
            if ev < 0:
                raise RuntimeError(f"vtoken: request {rid} reports cache length {length} > true length "
                                   f"{req.num_computed_tokens}")
            self._vt_evicted[rid] = ev
            blocks = mgr.req_to_blocks.get(rid)
            keep = cdiv(int(length), bs)
            if blocks is not None and len(blocks) > keep:
                tail = blocks[keep:]
                del blocks[keep:]
                pool.free_blocks(reversed(tail))
                self.vtoken_stats["blocks_freed"] += len(tail)
