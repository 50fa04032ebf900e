"""One collector for every adapter: writes the statistics a policy reads into the cache's slot store.

    write_norms(layer, slots, k, v)            when K/V of new tokens are cached: key_norm / value_norm
    fold_probs(layer, md, probs, qpos, plen)   after attention, with its probabilities (HF: the same pass)
    attention(layer, q, md, qpos, plen, scale) vLLM: its kernels do not return probabilities, so the
                                               statistics are produced from the queries and the paged keys
                                               by one of three backends (same rules, tested equal):

        backend   where                what it computes
        torch     torch_stats, any     the probabilities over the paged cache, then fold_probs
        triton    CUDA caches          two passes over the keys (row max / sum-of-exp, then per key the
                                       reductions); no probability matrix (kernels.attn_stats_triton)
        numba     CPU, when available  the same two passes compiled for the CPU (stats.cpu_kernel)

    ``backend="auto"`` (env ``VTOKEN_STATS_BACKEND``) picks triton for CUDA caches, numba on CPU when the
    kernel module imports, torch otherwise.

Only the statistics in ``stat_names`` are collected; the rules are :mod:`.torch_stats`'s.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from vtoken_sdk.stats import StatsConfig

from .torch_stats import ATTENTION_STATS, KV_STATS, fold, step_contributions, visibility

log = logging.getLogger("vtoken.stats")


class StatsCollector:
    """Collects into ``cache`` (a :class:`~vtoken_runtime.cache.VTokenCache`); ``group_size`` = query heads
    per KV head. ``seconds`` accumulates the time spent (statistics cost, reported by benchmarks). ``keys``
    (numba backend only): per layer, what the kernel reads instead of ``cache.key_cache(layer)``, for a cache
    whose keys no strided view addresses (vLLM's CPU ``amx`` layout: :class:`~.cpu_kernel.PairedKeys`)."""

    def __init__(self, cache: Any, stat_names: Iterable[str], config: StatsConfig | None, group_size: int,
                 backend: str | None = None, keys: list[Any] | None = None) -> None:
        names = set(stat_names)
        self.cache = cache
        self.cfg = config or StatsConfig()
        self.group_size = int(group_size)
        self.attn = tuple(n for n in ATTENTION_STATS if n in names)
        self.kv = tuple(n for n in KV_STATS if n in names)
        self.seconds = 0.0
        self.backend = resolve_backend(backend, cache.device)
        self._kernel = kernel_for(self.backend)
        if keys is not None and (self.backend != "numba" or len(keys) != cache.num_layers):
            raise ValueError(f"StatsCollector: keys (one per layer, {cache.num_layers}) are read by the numba backend "
                             f"only; got {len(keys)} with backend {self.backend!r}")
        self._keys = keys
        self._layers: dict[int, tuple[tuple[Any, ...], Any]] = {}  # numba: layer -> (its tensors, PreparedLayer)
        self._step: tuple[Any, Any, Any, Any, Any] | None = None  # numba: (md, query_pos, prompt_lens, token_index, prepared)

    def write_norms(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Key/value norms of freshly cached tokens: ``k, v [T, H_kv, D]`` at physical ``slots [T]``."""
        for name, x in (("key_norm", k), ("value_norm", v)):
            if name in self.kv:
                self.cache.scatter_stats(name, layer, slots, torch.linalg.vector_norm(x.float(), dim=-1).T, "set")

    def fold_probs(self, layer: int, md: Any, probs: torch.Tensor, query_pos: torch.Tensor,
                   prompt_lens: torch.Tensor) -> None:
        """Fold ``probs [B, H_kv, Q, L]`` (:func:`~vtoken_runtime.paged_attention.paged_attention`'s) of one
        layer into the attention statistics. ``query_pos [B, Q]`` (-1 = padding), ``prompt_lens [B]``."""
        if not self.attn:
            return
        t0 = time.perf_counter()
        cache = self.cache
        L = probs.shape[-1]
        b_idx, j_idx, slots = cache.visible_slots(md, L)
        vis = None
        if "low_attn_count" in self.attn:
            vis = visibility(cache.key_positions(layer), md.block_tables, md.cache_lens, cache.block_size, L, query_pos)
        contrib = step_contributions(probs, vis, query_pos, md.cache_lens, prompt_lens, self.group_size, self.cfg,
                                     self.attn)
        fold(cache.stats_update_handles(layer, self.attn), contrib, b_idx, j_idx, slots)
        self.seconds += time.perf_counter() - t0

    def attention(self, layer: int, query: torch.Tensor, md: Any, query_pos: torch.Tensor,
                  prompt_lens: torch.Tensor, scale: float | None = None,
                  token_index: torch.Tensor | None = None) -> None:
        """Statistics of ``query [B, Q, H_q, D]`` over the paged cache (see module doc for the backends); or of the
        query rows ``[T, H_q, D]`` that ``token_index [B, Q]`` (-1 = padding) names per (request, query): the numba
        kernel reads them in place, the other backends take them gathered (padding zeroed)."""
        if not self.attn:
            return
        if token_index is not None and self.backend != "numba":
            query, token_index = gather_query_rows(query, token_index), None
        t0 = time.perf_counter()
        if self._kernel is None:
            _, probs = self.cache.attention(layer, query, md, query_pos, return_probs=True, scale=scale)
            assert probs is not None
            self.seconds += time.perf_counter() - t0
            self.fold_probs(layer, md, probs, query_pos, prompt_lens)
            return
        cache, cfg = self.cache, self.cfg
        if cache.in_flight:
            cache.fence()
        if self.backend == "numba":
            try:
                self._numba(layer, query, md, query_pos, prompt_lens, scale, token_index)
            except ValueError:  # misuse: shapes, dtypes
                raise
            except Exception as e:  # the kernel could not load or compile: it wrote nothing
                if self._keys is not None:
                    raise RuntimeError("vtoken: the numba statistics kernel failed and no other backend reads this "
                                       f"cache's key layout ({type(e).__name__}: {e})") from e
                log.warning("vtoken: the numba statistics kernel failed (%s: %s); the torch backend collects the "
                            "statistics from now on", type(e).__name__, e)
                self.backend, self._kernel = "torch", None
                self.seconds += time.perf_counter() - t0
                self.attention(layer, query, md, query_pos, prompt_lens, scale, token_index)
                return
        else:
            self._kernel(query, cache.key_cache(layer), md.block_tables, md.cache_lens, query_pos,
                         cache.key_positions(layer), cache.stats_update_handles(layer, self.attn), scale=scale,
                         obs_window=cfg.obs_window, history_window=cfg.history_window,
                         low_attn_threshold=cfg.low_attn_threshold, prompt_lens=prompt_lens)
        self.seconds += time.perf_counter() - t0

    def _numba(self, layer: int, query: torch.Tensor, md: Any, query_pos: torch.Tensor, prompt_lens: torch.Tensor,
               scale: float | None, token_index: torch.Tensor | None = None) -> None:
        """The numba kernel on arguments prepared once per layer (views of the cache's key, position and
        statistic stores, rebuilt when one of those tensors changes) and once per step (the metadata, the same
        for every layer): most of a decode call's Python otherwise (``stats.cpu_kernel.prepare_layer``)."""
        from .cpu_kernel import prepare_layer, prepare_step, run_prepared

        cache, cfg = self.cache, self.cfg
        handles = cache.stats_update_handles(layer, self.attn)
        key = (cache.key_cache(layer) if self._keys is None else self._keys[layer], cache.store.positions.data_ptr(),
               *(h.data_ptr() for h in handles.values()))
        prep = self._layers.get(layer)
        if prep is None or prep[0][0] is not key[0] or prep[0][1:] != key[1:]:
            prep = (key, prepare_layer(key[0], cache.key_positions(layer), handles))
            self._layers[layer] = prep
        if self._step is None or self._step[0] is not md or self._step[1] is not query_pos \
                or self._step[2] is not prompt_lens or self._step[3] is not token_index:
            self._step = (md, query_pos, prompt_lens, token_index,
                          prepare_step(md.block_tables, md.cache_lens, query_pos, prompt_lens, token_index))
        run_prepared(prep[1], self._step[4], query, scale, cfg.obs_window, cfg.history_window, cfg.low_attn_threshold)


def gather_query_rows(rows: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """``rows [T, H_q, D]`` -> ``[B, Q, H_q, D]`` by ``token_index [B, Q]``, the padding (-1) zeroed."""
    q = rows[token_index.clamp(min=0)]
    return torch.where((token_index >= 0)[:, :, None, None], q, torch.zeros((), dtype=q.dtype, device=q.device))


BACKENDS = ("auto", "torch", "triton", "numba")


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """The statistics backend for a cache on ``device``: explicit, env ``VTOKEN_STATS_BACKEND``, or auto."""
    b = backend or os.environ.get("VTOKEN_STATS_BACKEND", "auto")
    if b not in BACKENDS:
        raise ValueError(f"statistics backend {b!r} (VTOKEN_STATS_BACKEND); expected one of {BACKENDS}")
    if b != "auto":
        return b
    if torch.device(device).type == "cuda":
        return "triton"
    return "numba" if _numba_kernel() is not None else "torch"


def _numba_kernel() -> Callable[..., None] | None:
    from .cpu_kernel import kernels_available, update_attn_stats_cpu

    return update_attn_stats_cpu if kernels_available() else None


def kernel_for(backend: str) -> Callable[..., None] | None:
    """The in-place update function of a compiled backend (``update_attn_stats`` signature), None for torch."""
    if backend == "triton":
        from ..kernels.attn_stats_triton import update_attn_stats

        return update_attn_stats
    if backend == "numba":
        k = _numba_kernel()
        if k is None:
            raise RuntimeError("statistics backend 'numba' requested but numba (or the kernel) is unavailable")
        return k
    return None
