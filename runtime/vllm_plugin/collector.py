"""Statistics collection inside vLLM: an attention-impl wrapper feeding the runtime's one collector.

The wrapper sits on ``Attention.impl`` of every decoder layer (vLLM's custom ops look the impl up at
run time, so wrapping the instance changes no vLLM file and keeps the unmodified kernel):

    (a step with requests in per-row pages, issue 39: both hooks run every request through the row path
    instead of vLLM's write and kernel call, :class:`~.rows.RowStep`; the statistics are collected as below)

    do_kv_cache_update(layer, k, v, kv_cache, slot_mapping)   vLLM writes K/V (reshape_and_cache), then
                                                              key_norm / value_norm of the new slots
                                                              (``StatsCollector.write_norms``)
    forward(layer, q, k, v, kv_cache, md, output)             the unmodified paged kernel runs; then, only
                                                              if the policy reads attention statistics,
                                                              ``StatsCollector.attention`` recomputes the
                                                              probabilities of the evicting requests'
                                                              queries over the paged cache and folds them;
                                                              only if it reads query statistics, the
                                                              evicting requests' post-RoPE queries go to
                                                              the query window store (one index_put)

The statistics mean exactly what ``vtoken_sdk.stats.CATALOG`` says (the HF adapter uses the same
collector, ``vtoken_runtime.stats``): prompt queries are identified by ``num_prompt_tokens``, so the
observation window does not depend on how the scheduler chunks a prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

ATTN_STATS = ("attn_sum", "attn_last", "attn_window", "low_attn_count")
KV_STATS = ("key_norm", "value_norm")


@dataclass
class StepContext:
    """What the attention wrapper needs for one engine step (built in ``_prepare_inputs``).

    ``tok_index [B, Q]`` rows of the flat query tensor (-1 = padding), ``query_pos [B, Q]`` true
    positions (-1 = padding), ``prompt_len [B]``, for the requests whose statistics are collected
    (``md`` covers exactly those, in the same order; None when no attention statistic is read).
    ``query_write``: where their queries go in the query window store (None: no query statistic read).
    ``gather_index`` / ``pad_mask`` (derived): the rows the wrapper gathers from the flat query tensor and,
    when a row is padded, the mask zeroing the padding (computed once per step for all layers; the numba
    statistics kernel takes ``tok_index`` instead and reads the rows in place).
    """

    req_ids: list[str]
    md: Any
    tok_index: torch.Tensor
    query_pos: torch.Tensor
    prompt_len: torch.Tensor
    collect_attn: bool
    query_write: Any = None
    padded: bool | None = None  # some tok_index is -1 (None: found from tok_index, a device sync on GPUs)

    def __post_init__(self) -> None:
        # once per step, not per layer: the gather rows (padding -> row 0) and, only when some row is
        # padded, the mask that zeroes the padding's queries
        self.gather_index = self.tok_index.clamp(min=0)
        valid = self.tok_index >= 0
        if self.padded is None:
            self.padded = not bool(valid.all())
        self.pad_mask = valid[:, :, None, None] if self.padded else None


class VTokenAttentionImpl:
    """Delegating wrapper around a vLLM ``AttentionImpl`` (everything not overridden is forwarded).

    ``hooks``: which of ``do_kv_cache_update`` / ``forward`` the engine's policy needs (key/value norms;
    attention or query statistics). A hook it does not need is the wrapped impl's own bound method, set on
    the instance: no extra Python frame per layer and step (policy ``none`` runs vLLM's calls as they are)."""

    def __init__(self, inner: Any, runner: Any, layer_index: int,
                 hooks: frozenset[str] = frozenset({"do_kv_cache_update", "forward"})) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_layer", layer_index)
        for name in {"do_kv_cache_update", "forward"} - hooks:
            object.__setattr__(self, name, getattr(inner, name))  # shadows the hook below

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_inner"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    @property
    def __class__(self) -> type:  # isinstance checks in vLLM see the wrapped impl's class
        return type(self._inner)

    # ------------------------------------------------------------------ hooks
    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        rows = self._runner._vt_rowstep
        if rows is not None:  # a step with row requests: every request's K/V through the row path
            rows.write(self._layer, key, value)
        else:
            self._inner.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        col = self._runner._vt_collector
        if col is not None and col.kv and self._runner._vt_step is not None:
            n = int(slot_mapping.shape[0])
            ok = slot_mapping >= 0
            col.write_norms(self._layer, slot_mapping[ok].to(torch.int64), key[:n][ok], value[:n][ok])

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor, **kw: Any) -> torch.Tensor:
        rows = self._runner._vt_rowstep
        if rows is not None and attn_metadata is not None:
            n = int(attn_metadata.num_actual_tokens)
            rows.attend(self._layer, query[:n], output, float(self._inner.scale))
            out = output
        else:
            out = self._inner.forward(layer, query, key, value, kv_cache, attn_metadata, output=output, **kw)
        step = self._runner._vt_step
        col = self._runner._vt_collector
        if step is not None and attn_metadata is not None and col is not None and step.collect_attn:
            if col.backend == "numba":  # reads each (request, query)'s row of the step's queries in place
                col.attention(self._layer, query, step.md, step.query_pos, step.prompt_len, float(self._inner.scale),
                              token_index=step.tok_index)
            else:
                q = query[step.gather_index]  # [T, H_q, D] -> [B, Q, H_q, D]
                if step.pad_mask is not None:
                    q = torch.where(step.pad_mask, q, torch.zeros((), dtype=q.dtype))
                col.attention(self._layer, q, step.md, step.query_pos, step.prompt_len, float(self._inner.scale))
        if step is not None and attn_metadata is not None and step.query_write is not None:
            self._runner._vt_queries.write(self._layer, query, step.query_write)
        return out


def build_step_index(qsl: np.ndarray, positions: np.ndarray, sel: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``tok_index [B, Q]`` and ``query_pos [B, Q]`` (-1 padded) for the selected batch rows ``sel``."""
    lens = [int(qsl[i + 1] - qsl[i]) for i in sel]
    Q = max(lens) if lens else 1
    tok = np.full((len(sel), Q), -1, dtype=np.int64)
    pos = np.full((len(sel), Q), -1, dtype=np.int64)
    for b, i in enumerate(sel):
        a, e = int(qsl[i]), int(qsl[i + 1])
        tok[b, : e - a] = np.arange(a, e)
        pos[b, : e - a] = positions[a:e]
    return torch.from_numpy(tok), torch.from_numpy(pos)
