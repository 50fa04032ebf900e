"""vToken on vLLM's GPU worker (V1 model runner): the same runner mixin, the GPU's K/V layouts, and the guards.

``VTokenGPUWorker`` is vLLM's ``gpu_worker.Worker`` whose model runner (``GPUModelRunner``, the class
vLLM's CPU runner also derives from) gets :class:`~.worker.VTokenRunnerMixin`: the step rewrite
(:mod:`.step_inputs`), eviction (``EvictionDriver``) and statistics (``StatsCollector``, Triton on CUDA)
are the CPU worker's, line for line. What differs on the GPU:

    K/V access     each layer's logical ``[NB, H_kv, bs, 2D]`` view in the physical order vLLM's
                   ``kv_cache_layout`` resolved (LBNHC, LBHNC, LHBNC); ``vtoken_runtime.kv_layout`` turns
                   it into rows the copy engine moves byte-exactly (fp8 as bytes)
    copies         side stream + event, fenced before the next attention and before vLLM zeroes newly
                   allocated blocks (``_update_states``); the Triton repack kernel moves the rows
    statistics     the Triton statistics kernel (two passes over the keys, no probability matrix)
    selection      the policy's generated Triton select kernel (``compile_policy(device=cuda)``)
    CUDA graphs    FULL / FULL_AND_PIECEWISE decode graphs replay without calling the attention
                   wrapper or the KV-update hook, so statistics would silently stop: a policy that
                   reads statistics forces PIECEWISE capture (attention and KV updates then run
                   eagerly between the captured pieces; logged once). Statistic-free policies keep full
                   graphs (also those reading keys / values: they come from the KV cache at eviction):
                   every per-step write (slot mapping, ``seq_lens``, block-table rows) goes into
                   vLLM's persistent buffers, so captured graphs read the rewritten values.
                   A policy with unequal row budgets forces PIECEWISE too (its writes and attention
                   run in the wrapper)
    row pages      unequal budgets per (layer, KV head): the CPU worker's row cache with
                   ``backend="triton"`` (vLLM's Triton attention backend over an HND cache: the worker
                   puts LBHNC first in its supported layouts; with another backend or an explicit other
                   layout the policy is served with equal budgets, logged: ``_vt_row_cache``)

Refused at start-up, with the setting to change (:func:`check_gpu_config`): the V2 model runner,
FlashInfer and other attention backends (FlashAttention and Triton attention are supported),
block-outermost KV layouts, kernel block size != manager block size, per-token-head quantised KV,
ALiBi, sliding-window or hybrid KV groups, and statistics (or key / value vectors: ``worker.check_vector_reads``)
over a quantised KV cache. Prefix caching and asynchronous scheduling keep vLLM's defaults: their logic is the
scheduler's and this mixin's, the CPU worker's line for line (verified there; not run in a GPU engine). Query statistics (the attention wrapper
records the queries) count as statistics for the CUDA-graph rule; RoPE types the future query statistics
cannot describe are refused when the query window store is built (``stats.rope``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch

from vtoken_sdk.stats import ATTENTION_STATS, KV_STATS, QUERY_STATS

from .worker import VTokenRunnerMixin, install_runner

log = logging.getLogger("vtoken.vllm")

SUPPORTED_IMPLS = {"FlashAttentionImpl": "FLASH_ATTN", "TritonAttentionImpl": "TRITON_ATTN"}


def reads_statistics(stat_names: Iterable[str]) -> bool:
    """Whether a policy reading ``stat_names`` (``policy.reads``) needs the attention wrapper / KV-update hook
    to run: attention statistics, key / value norms, and query statistics (the wrapper records the queries).
    Keys and values read as vectors come from the KV cache at eviction time: no hook."""
    return any(n in ATTENTION_STATS or n in KV_STATS or n in QUERY_STATS for n in stat_names)


def check_gpu_config(*, use_v2_model_runner: bool, impl_names: Iterable[str], alibi: bool, sliding_window: bool,
                     cache_dtype: str, layout: Any, kernel_block_size: int, manager_block_size: int,
                     reads_attention: bool) -> str:
    """Refuse what the GPU path does not support (``ValueError`` naming the setting to change); returns
    the KV layout's name. The KV-cache rules (layout, block sizes, dtype) are the copy engine's
    (``kv_layout.check_supported``); the rest are the runner's.

    Plain values (no vLLM objects), so the rules are tested without a GPU; the worker reads them from
    its configuration and layers (:meth:`VTokenGPURunnerMixin._vt_kv_access`)."""
    from vtoken_runtime.kv_layout import check_supported

    if use_v2_model_runner:
        raise ValueError("vtoken: the V2 model runner is not supported; set VLLM_USE_V2_MODEL_RUNNER=0 "
                         "(vtoken-cli serve does)")
    bad = sorted({n for n in impl_names if n not in SUPPORTED_IMPLS})
    if bad:
        raise ValueError(f"vtoken: attention backend {bad} is not supported on GPU; use "
                         f"--attention-backend {' or '.join(SUPPORTED_IMPLS.values())}")
    if alibi:
        raise ValueError("vtoken: ALiBi models are not supported (the bias depends on the key's slot distance, "
                         "which compaction changes)")
    if sliding_window:
        raise ValueError("vtoken: sliding-window attention is not supported (the window is counted in slots)")
    name = check_supported(layout, manager_block_size=manager_block_size, kernel_block_size=kernel_block_size,
                           kv_cache_dtype=cache_dtype)
    if reads_attention and cache_dtype not in ("auto", "bfloat16", "float16", "half", "float32", "float"):
        raise ValueError(f"vtoken: attention statistics over a quantised KV cache ({cache_dtype}) are not "
                         "supported; use --kv-cache-dtype auto or a statistic-free policy")
    return name


def force_piecewise_graphs(compilation_config: Any, policy: Any) -> bool:
    """Switch FULL / FULL_AND_PIECEWISE CUDA graphs to PIECEWISE when the policy reads statistics (see
    module doc); refuse a compilation whose pieces would still capture the attention or KV-update op.
    Returns True when the mode was changed."""
    from vllm.config import CUDAGraphMode

    stats = tuple(sorted(policy.reads)) if policy is not None else ()
    rows = policy is not None and not policy.spec.uniform  # per-row pages: the wrapper writes and attends
    mode = compilation_config.cudagraph_mode
    if mode is None or mode == CUDAGraphMode.NONE or not (reads_statistics(stats) or rows):
        return False
    changed = mode.has_full_cudagraphs()
    if changed:
        compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
        why = ("gives rows unequal budgets (per-row pages: its KV writes and attention run in the wrapper, "
               "with per-layer page tables built each step)" if rows else
               f"reads {sorted(n for n in stats if reads_statistics([n]))}, collected around the attention op")
        log.warning("vtoken: policy %s %s; CUDA graph mode %s would replay decode steps without the wrapper, so "
                    "PIECEWISE is used", policy.name, why, mode.name)
    if (rows or any(n in ATTENTION_STATS or n in QUERY_STATS for n in stats)) and \
            not compilation_config.splitting_ops_contain_attention():
        raise ValueError("vtoken: this policy reads attention or query statistics (or attends over per-row pages) but "
                         "the compilation captures the attention op inside CUDA graphs (splitting_ops); leave "
                         "splitting_ops unset or use --enforce-eager")
    if (rows or any(n in KV_STATS for n in stats)) and not compilation_config.splitting_ops_contain_kv_cache_update():
        raise ValueError("vtoken: this policy reads key/value norms (or writes per-row pages) but the KV-cache update "
                         "is fused into the captured graph (splitting_ops / fuse_rope_kvcache); leave them unset or "
                         "use --enforce-eager")
    return changed


def prefer_row_layout(names: list[str], policy: Any) -> list[str]:
    """The worker's supported KV layouts (most preferred first) with LBHNC (HND) first when ``policy`` gives rows
    unequal budgets: per-row pages on the GPU are one-head regions of an HND cache (``row_attention.
    hnd_layer_pages``), and vLLM's default preference puts LBNHC first. vLLM's engine core resolves the layout
    from this list; an explicit ``VLLM_KV_CACHE_LAYOUT`` still wins (the runner then serves the policy with equal
    budgets if it is not HND, with a warning)."""
    if policy is None or policy.spec.uniform or "LBHNC" not in names:
        return list(names)
    return ["LBHNC", *[n for n in names if n != "LBHNC"]]


class VTokenGPURunnerMixin(VTokenRunnerMixin):
    """The runner mixin with the GPU's K/V access (layout adapter + Triton copy engine) and guards."""

    _vt_hybrid_ok = False  # one metadata for every KV cache group (the true-length builders are CPU-verified)

    def _vt_kv_access(self, kv: list[torch.Tensor], layer: Any, spec: Any) -> dict[str, Any]:
        from vtoken_runtime.kv_layout import KVLayoutAdapter, LayoutCopyEngine

        cc = self.cache_config
        layout = cc.get_resolved_kv_cache_layout()
        pol = self._vt_policy
        reads = tuple(pol.stored_reads) if pol is not None else ()
        impls = {type(getattr(layer.impl, "_inner", layer.impl)).__name__}
        check_gpu_config(
            use_v2_model_runner=bool(getattr(self.vllm_config, "use_v2_model_runner", False)),
            impl_names=impls, alibi=getattr(layer.impl, "alibi_slopes", None) is not None,
            sliding_window=bool(getattr(spec, "sliding_window", None) or getattr(layer.impl, "sliding_window", None)
                                not in (None, (-1, -1))),
            cache_dtype=str(cc.cache_dtype), layout=layout, kernel_block_size=int(kv[0].shape[2]), manager_block_size=int(spec.block_size),
            reads_attention=any(n in ATTENTION_STATS for n in reads))
        head_size = int(kv[0].shape[3]) // 2
        adapters = [KVLayoutAdapter.from_view(t, head_size) for t in kv]
        return {"kv_views": [a.kv_views(t) for a, t in zip(adapters, kv, strict=True)],
                "copy_engine": partial(LayoutCopyEngine, adapters=adapters)}


try:  # vLLM is optional for importing this module's helpers
    from vllm.v1.worker.gpu_worker import Worker as _GPUWorker
except Exception:  # pragma: no cover - vLLM missing
    _GPUWorker = object  # type: ignore[assignment,misc]


class VTokenGPUWorker(_GPUWorker):  # type: ignore[misc,valid-type]
    """vLLM's GPU worker with the vToken model runner (configured by ``vllm_engine_args``)."""

    def init_device(self) -> None:
        if getattr(self, "use_v2_model_runner", False):
            raise ValueError("vtoken: the V2 model runner is not supported; set VLLM_USE_V2_MODEL_RUNNER=0 "
                             "(vtoken-cli serve does)")
        super().init_device()
        install_runner(self.model_runner, VTokenGPURunnerMixin)
        force_piecewise_graphs(self.vllm_config.compilation_config, self.model_runner._vt_policy)

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return prefer_row_layout(super().get_supported_kv_cache_layouts(), self.model_runner._vt_policy)
