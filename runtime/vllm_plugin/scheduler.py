"""Scheduler side of the vLLM plugin: it routes; the block lists are owned by :mod:`.block_manager`.

vLLM's scheduler sizes a request's KV blocks from its TRUE length, which drives positions, stop checks and
max_model_len and is never changed here. The request's block list, its eviction count and every allocation
and free of its blocks belong to one owner, :class:`~.block_manager.EvictingAttentionManager` (vLLM's
full-attention manager by cache length), which vLLM builds for this scheduler's KV cache group: the group
gets the role ``VTOKEN_ROLE`` in this scheduler's copy of the KV cache configuration, and the manager is
registered for that role. This class only routes:

    update_from_output   the worker's report (``vtoken_report = {req_id: Truncation(true_len, cache_len)}``,
                         attached to the ModelRunnerOutput of the step) goes to ``manager.truncate``, which
                         frees the tail blocks; the next ``schedule()`` can admit more requests
    schedule             a request whose block list shrank gets its whole list in the scheduler output
                         (``vtoken_rows``, :mod:`.report`; the runner replaces its copy of the row in place)
    admission            the manager asks :meth:`VTokenScheduler.admission_tokens` for a waiting request's peak

Preemption (recompute) and finishing free everything through vLLM as usual; the manager forgets the eviction
count with the blocks.

Admission. vLLM admits a waiting request only if its whole sequence fits (``scheduler_reserve_full_isl``,
on by default: no over-admission with chunked prefill). With a budget that evicts after every prefill chunk
(``when="chunks"``) a request never holds its whole prompt: at most its budget plus one chunk. Its admission
check is made on that peak instead (:meth:`VTokenScheduler.admission_tokens`), the point of evicting during
prefill; every other request keeps vLLM's check.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from . import block_manager
from .config import PluginConfig, request_options
from .kv_groups import evicting_group
from .report import REPORT_ATTR, ROWS_ATTR

log = logging.getLogger("vtoken.vllm")


def check_supported(vllm_config: Any) -> None:
    """Refuse configurations the plugin does not handle, with a clear message (start-up time)."""
    cc = vllm_config.cache_config
    if cc.enable_prefix_caching:
        pol = PluginConfig.from_vllm_config(vllm_config).load_policy()
        if pol is not None and not pol.spec.uniform:
            raise ValueError("vtoken: prefix caching with a policy of unequal row budgets is not supported (its "
                             "handoff to per-row pages repacks every block of the request, the cached prefix's "
                             "too); start the engine with enable_prefix_caching=False, or serve the policy's "
                             "uniform twin")
    if vllm_config.speculative_config is not None:
        raise ValueError("vtoken: speculative decoding is not supported")
    if vllm_config.kv_transfer_config is not None:
        raise ValueError("vtoken: KV transfer connectors are not supported")


class VTokenScheduler(Scheduler):
    """vLLM v1 ``Scheduler`` whose KV cache manager allocates by cache length (see module doc). With asynchronous
    scheduling on, constructing it gives a :class:`VTokenAsyncScheduler` (vLLM picks its ``AsyncScheduler`` only
    when no scheduler class is named, and the engine arguments name this one)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> VTokenScheduler:
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        if cls is VTokenScheduler and getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling",
                                              False):
            cls = VTokenAsyncScheduler
        return super().__new__(cls)

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        self._vt_cfg = PluginConfig.from_vllm_config(vllm_config)
        check_supported(vllm_config)
        groups = list(kv_cache_config.kv_cache_groups)
        gid = evicting_group(groups)  # the full-attention group; sliding-window groups keep vLLM's managers
        block_manager.register()
        # this scheduler's own copy: the group's role selects the evicting manager (the workers' is untouched)
        groups[gid] = replace(groups[gid], role=block_manager.VTOKEN_ROLE)
        kv_cache_config = replace(kv_cache_config, kv_cache_groups=groups)
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        managers = self.kv_cache_manager.coordinator.single_type_managers
        mgr = managers[gid]
        if not isinstance(mgr, block_manager.EvictingAttentionManager):
            raise RuntimeError(f"vtoken: vLLM built {type(mgr).__name__} for the vtoken KV cache group")
        self._vt_blocks: block_manager.EvictingAttentionManager = mgr
        self._vt_gid = gid
        mgr.bind_siblings([m for i, m in enumerate(managers) if i != gid])
        self.vtoken_stats = {"reports": 0, "blocks_freed": 0, "max_running": 0}
        pol = self._vt_cfg.load_policy()
        self._vt_budget = pol.budget if pol is not None else None
        sc = vllm_config.scheduler_config
        lpt = int(getattr(sc, "long_prefill_token_threshold", 0) or 0)
        self._vt_chunk = min(int(sc.max_num_batched_tokens), lpt) if lpt > 0 else int(sc.max_num_batched_tokens)
        mgr.bind_admission(self._vt_peak_tokens)
        if vllm_config.cache_config.enable_prefix_caching:
            mgr.bind_prefix_rule(self._vt_may_evict)

    def _vt_peak_tokens(self, req_id: str, frozen: int = 0) -> int:
        """The block manager's admission rule: :meth:`admission_tokens` of a known request, no bound otherwise."""
        req = self.requests.get(req_id)
        return self.admission_tokens(req, frozen) if req is not None else 1 << 62

    def _vt_may_evict(self, request: Any) -> bool:
        """The request runs under a policy (not opted out; options that fail to parse: the worker disables its
        eviction, but the scheduler stays on the safe side)."""
        if self._vt_budget is None:
            return False
        try:
            return request_options(getattr(request, "sampling_params", None)).enabled
        except ValueError:
            return True

    def admission_tokens(self, request: Any, frozen: int = 0) -> int:
        """The most tokens ``request`` will hold during its (re)prefill of ``n`` tokens in chunks of at most the
        step's token budget: :meth:`Budget.chunked_prefill_peak` of its budget with the request's own options
        (``n`` unless the budget evicts after every prefill chunk). An opted-out request, or options that fail to
        parse, hold everything, and so does every request in ``naive`` mode (Naive-Evict frees a block only when
        all its tokens are dead: no budget bounds it). ``frozen``: its first tokens are prefix-cache hits, pinned
        (:mod:`.prefix`): it holds them and at most a chunk more if they exceed its budget."""
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
        peak = b.override(opts.budget_tokens, opts.eviction_ratio).chunked_prefill_peak(n, self._vt_chunk)
        return max(peak, min(n, int(frozen) + self._vt_chunk))

    # ------------------------------------------------------------------ the owner's figures
    def evicted_tokens(self, req_id: str) -> int:
        """Tokens of ``req_id`` no longer in the cache (its true length minus its cache length)."""
        return self._vt_blocks.evicted_tokens(req_id)

    def held_blocks(self, req_id: str) -> int:
        return self._vt_blocks.held_blocks(req_id)

    # ------------------------------------------------------------------ routing
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)
        self._vt_blocks.step_scheduled(out)
        self.vtoken_stats["max_running"] = max(self.vtoken_stats["max_running"], len(self.running))
        cached = out.scheduled_cached_reqs
        resend = self._vt_blocks.rows_to_resend(cached.req_ids)
        if resend:  # the runner replaces its row of the evicting group with the whole (truncated) list
            gid, rows = self._vt_gid, {}
            for i, rid in enumerate(cached.req_ids):
                if rid in resend:
                    rows[rid] = list(self.kv_cache_manager.get_block_ids(rid)[gid])  # this step's new blocks too
                    new = cached.new_block_ids[i]
                    if new is not None:  # so they are not appended a second time
                        cached.new_block_ids[i] = tuple([] if g == gid else ids for g, ids in enumerate(new))
            setattr(out, ROWS_ATTR, rows)
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        report = getattr(model_runner_output, REPORT_ATTR, None)
        if report:
            self.vtoken_stats["reports"] += 1
            for rid, t in report.items():
                req = self.requests.get(rid)
                computed = int(req.num_computed_tokens) if req is not None else None
                self.vtoken_stats["blocks_freed"] += self._vt_blocks.truncate(rid, t, computed)
        self._vt_blocks.step_done(scheduler_output)  # before vLLM's update, which may offer blocks (async)
        return super().update_from_output(scheduler_output, model_runner_output)


class VTokenAsyncScheduler(VTokenScheduler, AsyncScheduler):
    """:class:`VTokenScheduler` on vLLM's ``AsyncScheduler`` (asynchronous scheduling: step ``N + 1`` is scheduled
    before step ``N``'s output arrives). Nothing of its own: the eviction report of step ``N`` reaches
    ``update_from_output`` after step ``N + 1`` was scheduled with the blocks the request held before it, and
    :meth:`~.block_manager.EvictingAttentionManager.truncate` keeps the blocks step ``N + 1``'s tokens are written
    to (its ``computed``: vLLM counts a step's tokens when it schedules them); the truncated row reaches the
    runner with step ``N + 2``. A block freed at report ``N`` is handed out at step ``N + 2`` at the earliest,
    after the runner has finished step ``N + 1`` and fenced step ``N``'s compaction."""
