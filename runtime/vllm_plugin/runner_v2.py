"""The step rewrite for vLLM's Model Runner V2 (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``).

V2 prepares a step on the device: positions and ``seq_lens`` from ``req_states.num_computed_tokens``
(``prepare_pos_seq_lens``), block tables gathered from its staged :class:`BlockTables` and slot mappings
computed from them (``prepare_attn``). The rewrite is the V1 mixin's (:mod:`.step_inputs`), placed in V2's
hooks and buffers::

    update_requests   the scheduler's truncated lists (SchedulerOutput.vtoken_rows) overwrite the evicting
                      group's row (BlockTables' staged write from column 0 + its block count), before V2
                      appends the step's new blocks; the host copy of each row (V2 keeps none) follows
    prepare_inputs    after V2's: place_new_tokens over the host rows (true positions stay as V2 computed
                      them); the cache lengths go IN PLACE into input_buffers.seq_lens (what the attention
                      metadata and FULL CUDA graphs read); the true lengths are kept aside
    prepare_attn      after V2's: the token table's slots over the evicting group's slot mapping
    sample            first: the true lengths back into input_buffers.seq_lens. V2's sampler decides "still
                      in chunked prefill" by seq_len < prefill_len (get_num_sampled_and_rejected); with
                      cache lengths a decoding request evicted below its prompt length would sample nothing

    host  rows[rid] = [b0 b1 b2 ...]   ->  BlockTables.block_tables[g] row of req_states index i
    step  seq_lens[:B] = cache_len + n (attention)   ...   seq_lens[:B] = computed + n (sampling)

Scope (what this module is and is not): the input preparation, checked on CPU with V2's real classes and its
Triton kernels under the interpreter (``python -m vtoken_bench.v2_inputs_check``). The V1 mixin's cache
construction, statistics hooks and after-step eviction (``worker.VTokenRunnerMixin``) have no V2 counterpart
yet, and V2's ``GPUModelRunner`` needs CUDA streams in its constructor, so no engine runs V2 with vToken: the
workers still refuse V2 and pin V1 (``VLLM_USE_V2_MODEL_RUNNER=0``). One KV-cache group only: V2's
``seq_lens`` is shared by every group's metadata, so a hybrid model's other groups would see cache lengths
(the V1 path gives them true lengths, ``_vt_true_length_builders``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from .report import ROWS_ATTR
from .step_inputs import place_new_tokens


class V2StepRewrite:
    """Host state of the rewrite: the evicting group's block list per request, and the step's true lengths.

    ``cache``: the :class:`~vtoken_runtime.cache.VTokenCache`; ``pool``: its ``ExternalPool``; ``on_new(rid)``
    registers a request seen for the first time; ``num_groups``: V2's KV-cache group count (must be 1)."""

    def __init__(self, cache: Any, pool: Any, on_new: Callable[[str], None], max_num_reqs: int, device: Any,
                 num_groups: int = 1, cached_prefix: bool = False) -> None:
        if num_groups != 1:
            raise ValueError(f"vtoken: Model Runner V2 with {num_groups} KV-cache groups is not supported (V2's "
                             "seq_lens is shared by every group's metadata); use one group or the V1 runner "
                             "(VLLM_USE_V2_MODEL_RUNNER=0)")
        self.cache, self.pool, self.on_new = cache, pool, on_new
        self.group = 0
        self.cached_prefix = cached_prefix
        self.rows: dict[str, list[int]] = {}
        self.true_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self._slots: torch.Tensor | None = None
        self._num_reqs = 0  # > 0: input_buffers.seq_lens holds this many cache lengths (prepare_inputs to sample)

    # ------------------------------------------------------------------ request states
    def drop(self, finished: Iterable[str], preempted: Iterable[str]) -> None:
        """Finished requests leave the token table; preempted ones are reset (recompute)."""
        cache = self.cache
        cache.fence()
        for rid in preempted:
            if cache.has_request(rid):
                cache.preempt(rid)
            self.rows.pop(rid, None)
        for rid in finished:
            if cache.has_request(rid):
                cache.free(rid)
            self.rows.pop(rid, None)

    def added(self, new_reqs: Iterable[Any]) -> None:
        """New (and resumed) requests: their whole block list, as V2 wrote it (``overwrite=True``)."""
        for nr in new_reqs:
            self.rows[nr.req_id] = list(nr.block_ids[self.group])

    def update(self, scheduler_output: Any, block_tables: Any, req_index: dict[str, int]) -> None:
        """Before V2's ``update_requests``: truncated lists overwrite their rows, then the host copy takes the
        step's new blocks (V2 appends them to the device rows itself)."""
        g = self.group
        for rid, ids in (getattr(scheduler_output, ROWS_ATTR, None) or {}).items():
            i = req_index.get(rid)
            if i is None or rid not in self.rows:
                raise RuntimeError(f"vtoken: the scheduler sent the block list of request {rid}, unknown to the runner")
            block_tables.block_tables[g].stage_write(i, 0, list(ids))
            block_tables.num_blocks.np[g, i] = len(ids)
            self.rows[rid] = list(ids)
        reqs = scheduler_output.scheduled_cached_reqs
        resumed = getattr(reqs, "resumed_req_ids", None) or ()
        for rid, new in zip(reqs.req_ids, reqs.new_block_ids, strict=True):
            if rid in resumed:  # V2 re-adds preempted requests as new ones; a resumed list would replace the row
                raise RuntimeError(f"vtoken: request {rid} was resumed as a cached request, which Model Runner V2 "
                                   "does not do (its whole block list would replace the row)")
            if new is not None:
                self.rows[rid].extend(new[g])

    # ------------------------------------------------------------------ the step
    def rewrite_lengths(self, input_batch: Any) -> np.ndarray:
        """After V2's ``prepare_inputs``: reserve the new tokens, keep the true lengths, write the cache lengths
        in place. Returns the cache lengths ``[B]``."""
        B = int(input_batch.num_reqs)
        req_ids = list(input_batch.req_ids)
        n = np.asarray(input_batch.num_scheduled_tokens[:B], dtype=np.int32)
        computed = np.asarray(input_batch.num_computed_tokens_np[:B], dtype=np.int32)
        qsl = np.asarray(input_batch.query_start_loc_np[:B + 1], dtype=np.int32)
        width = max((len(self.rows[r]) for r in req_ids), default=0)
        rows = np.zeros((B, max(width, 1)), dtype=np.int32)
        per_row = np.zeros(B, dtype=np.int32)
        for i, rid in enumerate(req_ids):
            ids = self.rows[rid]
            rows[i, :len(ids)] = ids
            per_row[i] = len(ids)
        slots = np.full(int(qsl[B]), -1, dtype=np.int64)
        seq = place_new_tokens(self.cache, self.pool, req_ids, n, computed, rows, per_row, qsl, slots, self.on_new,
                               cached_prefix=self.cached_prefix)
        lens = input_batch.seq_lens
        self.true_lens[:B].copy_(lens[:B])
        lens[:B].copy_(torch.from_numpy(seq).to(lens.device, non_blocking=True))
        self._slots = torch.from_numpy(slots)
        self._num_reqs = B
        return seq

    def rewrite_slots(self, slot_mappings: torch.Tensor) -> None:
        """After V2's ``prepare_attn``: the token table's slots over the evicting group's slot mapping
        ``[num_groups, T_padded]`` (padding stays V2's pad id)."""
        if self._slots is None:
            return
        T = int(self._slots.shape[0])
        slot_mappings[self.group, :T].copy_(self._slots.to(slot_mappings.device, non_blocking=True))

    def restore_lengths(self, input_batch: Any) -> None:
        """Before sampling: the true lengths back where V2's sampler reads them."""
        B = self._num_reqs
        if B:
            input_batch.seq_lens[:B].copy_(self.true_lens[:B])
            self._num_reqs = 0


class VTokenV2InputsMixin:
    """Model Runner V2's hooks carrying :class:`V2StepRewrite` (``self._vt_v2``; ``None``: plain V2)."""

    _vt_v2: V2StepRewrite | None = None

    def finish_requests(self, scheduler_output: Any) -> None:
        r = self._vt_v2
        if r is not None:
            r.drop(scheduler_output.finished_req_ids, scheduler_output.preempted_req_ids or ())
        super().finish_requests(scheduler_output)  # type: ignore[misc]

    def add_requests(self, scheduler_output: Any) -> None:
        super().add_requests(scheduler_output)  # type: ignore[misc]
        if self._vt_v2 is not None:
            self._vt_v2.added(scheduler_output.scheduled_new_reqs)

    def update_requests(self, scheduler_output: Any) -> None:
        if self._vt_v2 is not None:
            self._vt_v2.update(scheduler_output, self.block_tables, self.req_states.req_id_to_index)  # type: ignore[attr-defined]
        super().update_requests(scheduler_output)  # type: ignore[misc]

    def prepare_inputs(self, scheduler_output: Any, batch_req_state: Any, batch_desc: Any, num_active_loras: int) -> Any:
        ib = super().prepare_inputs(scheduler_output, batch_req_state, batch_desc, num_active_loras)  # type: ignore[misc]
        if self._vt_v2 is not None:
            self._vt_v2.rewrite_lengths(ib)
        return ib

    def prepare_attn(self, input_batch: Any) -> Any:
        block_tables, slot_mappings = super().prepare_attn(input_batch)  # type: ignore[misc]
        if self._vt_v2 is not None:
            self._vt_v2.rewrite_slots(slot_mappings)
        return block_tables, slot_mappings

    def sample(self, hidden_states: Any, input_batch: Any, grammar_output: Any) -> Any:
        if self._vt_v2 is not None:
            self._vt_v2.restore_lengths(input_batch)
        return super().sample(hidden_states, input_batch, grammar_output)  # type: ignore[misc]
