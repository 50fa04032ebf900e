"""HF transformers adapter: run a causal LM over a :class:`VTokenCache` with vtoken policies.

No forked model code: during the session's forwards (and only then: the model's own setting is
restored after each call) the model runs with ``attn_implementation="vtoken_paged"``, a function
registered with transformers' ``AttentionInterface`` (and a no-op mask in
``AttentionMaskInterface``). The model is called with ``use_cache=False`` and true
``position_ids`` (RoPE); every attention layer then

    1. writes the step's new K/V (after RoPE) into the paged cache at reserved slots,
    2. runs paged attention over the request's live tokens (causal by true position),
    3. folds the attention probabilities into the statistics the policies declared,
    4. records the step's post-RoPE queries in the query window store when a policy of the session reads
       query statistics (``query_mean``, ...: :mod:`vtoken_runtime.stats.query_vectors`; every request of the
       session is recorded, so a shared prefill can fork into such policies). Keys and values read by a
       policy (``s.key``, ``s.value``) come from the paged cache itself at eviction time.

After a prefill and after each decode step the eviction driver (``vtoken_runtime.eviction``, shared
with the vLLM plugin) asks each request's policy for a keep mask when its budget says so, applies it
and reclaims: compaction frees tail blocks immediately.

Unequal budgets per (layer, KV head) row (``allocation=``, issue 38): the first eviction of such a request
hands it, with its own blocks, to the session's :class:`~vtoken_runtime.row_cache.RowCache`, which lays
every row out in one-head pages of the same memory (``kv_all``; docs/decisions.md decision 8) and frees the
blocks the rows no longer need. From then on the request decodes over per-row page lists; a batch may mix
both kinds (each layer splits it).
Works for any HF decoder whose attention calls ``attention_interface(self, q, k, v,
mask, scaling=..., **kwargs)`` after RoPE (Llama, Qwen2, Mistral, ...).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .cache import AttentionMetadata, VTokenCache
from .eviction import EvictionDriver, TrackedRequest, refuse_unequal
from .row_cache import RowCache
from .stats import StatsCollector, needs_probs
from .stats.query_vectors import FUTURE_STATS, QueryWindows, WriteIndex
from .stats.rope import RotaryTables, rotary_tables

log = logging.getLogger("vtoken.hf")
ATTN_NAME = "vtoken_paged"
_REGISTERED = False


def register() -> None:
    """Register the ``vtoken_paged`` attention (idempotent; nothing runs at import)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, vtoken_attention)
    AttentionMaskInterface.register(ATTN_NAME, lambda *args, **kwargs: None)
    _REGISTERED = True


@contextmanager
def _vtoken_attention(model: Any) -> Iterator[None]:
    """Route ``model``'s attention to ``vtoken_paged`` for one call and restore it afterwards, so the
    model stays usable outside the session (a plain forward keeps its own attention)."""
    cfg = model.config
    old = getattr(cfg, "_attn_implementation", None)
    cfg._attn_implementation = ATTN_NAME
    try:
        yield
    finally:
        cfg._attn_implementation = old


@dataclass
class RowStep:
    """The part of a batch whose requests live in per-row pages (:class:`RowCache`)."""

    uni_b: torch.Tensor  # [Bu] batch indices of the uniform-cache requests
    row_b: torch.Tensor  # [Br] batch indices of the row requests
    req_ids: list[Hashable]  # [Br]
    valid: torch.Tensor  # [Br, Q] bool
    query_lens: torch.Tensor  # [Br] int64
    slots: np.ndarray  # [R, T_rows] page slots of the row requests' new tokens (row-major over [Br, Q])


@dataclass
class StepContext:
    """What one forward needs in every layer (passed as the ``vtoken_step`` kwarg). The uniform fields cover
    the uniform-cache requests only (``rows.uni_b``) when ``rows`` is set."""

    session: HFSession
    md: AttentionMetadata
    valid: torch.Tensor  # [B, Q] bool
    query_pos: torch.Tensor  # [B, Q] int64, -1 = padding
    prompt_lens: torch.Tensor  # [B] int64 (attn_window: the prompt's last obs_window queries)
    slots: torch.Tensor  # [T] physical slots of the valid new tokens (row-major over [B, Q])
    query_write: WriteIndex | None = None  # where the step's queries go in the query window store
    rows: RowStep | None = None  # requests in per-row pages (None: none in this batch)


def vtoken_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                     vtoken_step: StepContext | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``query [B, H_q, Q, D]``, ``key/value [B, H_kv, Q, D]`` -> ``out [B, Q, H_q, D]``."""
    if vtoken_step is None:
        raise RuntimeError("vtoken_paged attention needs the vtoken_step kwarg; run the model through HFSession")
    ctx = vtoken_step
    rs = ctx.rows
    if rs is None:
        return _uniform_attention(module, ctx, query, key, value, scaling), None
    B, Hq, Q, D = query.shape
    out = query.new_zeros(B, Q, Hq, D)
    if rs.uni_b.numel():
        ub = rs.uni_b
        out[ub] = _uniform_attention(module, ctx, query[ub], key[ub], value[ub], scaling)
    s, layer, rb = ctx.session, module.layer_idx, rs.row_b
    H = s.num_kv_heads
    k = key[rb].transpose(1, 2)[rs.valid]  # [T_rows, H_kv, D]
    v = value[rb].transpose(1, 2)[rs.valid]
    s.rows.write_kv(layer, rs.slots[layer * H:(layer + 1) * H], k, v)
    out[rb] = s.rows.attention(layer, query[rb].transpose(1, 2), rs.req_ids, rs.query_lens, scale=scaling)
    return out, None


def _uniform_attention(module: Any, ctx: StepContext, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       scaling: float | None) -> torch.Tensor:
    """The uniform cache's part of a layer: write K/V, paged attention, statistics, query windows."""
    s = ctx.session
    layer = module.layer_idx
    k = key.transpose(1, 2)[ctx.valid]  # [T, H_kv, D]
    v = value.transpose(1, 2)[ctx.valid]
    s.cache.write_kv_slots(layer, ctx.slots, k, v)
    col = s.collector
    assert col is not None
    col.write_norms(layer, ctx.slots, k, v)
    q = query.transpose(1, 2)  # [B, Q, H_q, D]
    out, probs = s.cache.attention(layer, q, ctx.md, ctx.query_pos, return_probs=s.collect_probs, scale=scaling)
    if probs is not None:
        col.fold_probs(layer, ctx.md, probs, ctx.query_pos, ctx.prompt_lens)
    if ctx.query_write is not None:
        assert s.queries is not None
        s.queries.write(layer, q.reshape(-1, q.shape[2], q.shape[3]), ctx.query_write)
    return out


class HFSession:
    """A paged vToken cache driving a HF causal LM, with per-request policies.

    ``granularity="head"`` caches accept request-granularity policies too (their rows agree).
    ``follower_block_sizes``: extra bookkeeping-only caches (head_size 1) that receive the same
    decisions, so held-block figures for other block sizes come from the real planner.
    ``policies``: the policies the session will run (their statistics and collector parameters are
    claimed up front, which a shared prefill needs: statistics are collected before requests fork).
    Eviction is :class:`~vtoken_runtime.eviction.EvictionDriver`'s; ``requests[r]`` is its record
    (``failures``, ``keep_log``). Policies with unequal budgets per row (``allocation=``, ``when="prefill"``)
    move their requests into ``rows`` (:class:`RowCache`, one-head pages of the same K/V memory and the same
    block pool) at their eviction.
    """

    def __init__(self, model: Any, *, block_size: int = 16, num_blocks: int = 4096, mode: str = "compact",
                 granularity: str = "head", stat_names: Sequence[str] = (), max_requests: int = 64,
                 chunk_size: int = 512, stats_config: Any = None, follower_block_sizes: Sequence[int] = (),
                 record_keeps: bool = False, async_copy: bool = True, debug: bool | None = None,
                 policies: Sequence[Any] = ()) -> None:
        register()
        from vtoken_sdk.stats import StatsConfig

        cfg = model.config
        self.model = model
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group_size = cfg.num_attention_heads // self.num_kv_heads
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.stats_config = stats_config or StatsConfig()
        self._claimed: dict[str, Any] = {} if stats_config is None else dict(stats_config)
        self._started = False  # a forward ran: the collector's parameters are fixed
        self.collector: StatsCollector | None = None  # built by the first forward, with the claimed parameters
        self.queries: QueryWindows | None = None  # query window store, built by the first forward if claimed
        self._query_window = 0  # the largest obs_window of the policies reading query statistics
        self._rope: RotaryTables | None = None
        self.stat_names = tuple(sorted(set(stat_names).union(*(p.stored_reads for p in policies))))
        for p in policies:
            self._adopt_stats_config(p)
        self.collect_probs = needs_probs(self.stat_names)
        # one allocation for every layer's K/V: layer l's uniform cache is kv_all[l], and the row cache sees the
        # same memory as one-head pages of every layer (a block is L x H_kv pages: decision 8)
        self.kv_all = torch.zeros(self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim,
                                  dtype=self.dtype)
        self.cache = VTokenCache(self.num_layers, self.num_kv_heads, self.head_dim, block_size, num_blocks,
                                 granularity=granularity, mode=mode, dtype=self.dtype, stat_names=self.stat_names,
                                 max_requests=max_requests, async_copy=async_copy, debug=debug,
                                 kv_caches=list(self.kv_all.unbind(0)))
        self.rows = RowCache(self.kv_all, self.cache.pool, max_requests, debug=self.cache.debug)
        self.cache.add_pool_holder(self.rows.held_block_ids)  # RowCache's method: no cycle back to the session
        self.followers = {bs: VTokenCache(self.num_layers, self.num_kv_heads, 1, bs,
                                          cdiv(num_blocks * block_size, bs) + max_requests, granularity=granularity,
                                          mode=mode, max_requests=max_requests, async_copy=False)
                          for bs in follower_block_sizes}
        # the driver holds the handoff through a weak reference: a bound method would make a reference cycle
        # (session -> driver -> session) that keeps every K/V tensor alive until the cyclic GC happens to run
        handoff = weakref.WeakMethod(self._handoff)
        self.driver = EvictionDriver(self.cache, list(self.followers.values()), record_keeps=record_keeps,
                                     handoff=(lambda r, k: handoff()(r, k)) if granularity == "head" else None,
                                     rows=self.rows if granularity == "head" else None)
        for p in policies:
            self._claim_queries(p)
        self.requests: dict[Hashable, TrackedRequest] = self.driver.requests
        self.prompt_lens: dict[Hashable, int] = {}  # the prompt's length, declared by prefill()
        self._prompt_ended: set[Hashable] = set()  # requests past their prompt: later tokens are generated

    # ------------------------------------------------------------------ requests
    def add(self, req_id: Hashable, policy: Any | None = None, pinned_positions: Sequence[int] | None = None,
            budget: int | None = None) -> None:
        """Add a request with its policy (None: no eviction), pinned true positions and a per-request
        budget in tokens (overrides the policy's size; its min_tokens / slack / when stay)."""
        self._check_policy(policy)
        pins = np.asarray(list(pinned_positions or ()), dtype=np.int64)
        for c in (self.cache, *self.followers.values()):
            if c.add_request(req_id, pins) is None:
                raise ValueError(f"max_requests reached; cannot add {req_id!r}")
        self._track(req_id, policy, budget)

    def set_pins(self, req_id: Hashable, pinned_positions: Sequence[int]) -> None:
        """Replace a request's pinned true positions (kept by every policy from the next eviction on;
        positions not reached yet are pinned when they arrive). ValueError, changing nothing, when a
        present pin was already evicted."""
        if req_id in self.rows:
            raise ValueError(f"request {req_id!r} is in per-row pages (unequal budgets): its pins are fixed")
        pins = np.asarray(list(pinned_positions), dtype=np.int64)
        for c in (self.cache, *self.followers.values()):  # the first refuses before any changed: same tokens
            c.set_pins(req_id, pins)

    def _check_policy(self, policy: Any | None) -> None:
        if policy is None:
            return
        # before the caches see the request: a refusal changes nothing
        refuse_unequal(policy, rows=self.driver.handoff is not None)
        missing = set(policy.stored_reads) - set(self.stat_names)
        if missing:
            raise ValueError(f"policy {policy.name!r} reads {sorted(missing)}, which this session does not "
                             f"collect (stat_names={list(self.stat_names)})")
        self._claim_queries(policy)
        self._adopt_stats_config(policy)

    def _claim_queries(self, policy: Any) -> None:
        """Policies reading query statistics need the session's queries from the first forward on: the
        store keeps the largest ``obs_window`` claimed before it (ValueError afterwards); RoPE types the
        future statistics cannot describe are refused here (``stats.rope.UnsupportedRope``)."""
        from vtoken_sdk.stats import QUERY_STATS

        reads = set(policy.vector_reads) & set(QUERY_STATS)
        if not reads:
            return
        if reads & set(FUTURE_STATS) and self._rope is None:
            try:
                self._rope = rotary_tables(self.model.config)
            except ValueError as e:
                raise ValueError(f"policy {policy.name!r} reads {sorted(reads & set(FUTURE_STATS))}: {e}") from None
        want = int(policy.spec.stats.obs_window)
        if self._started:
            have = self.queries.window if self.queries is not None else 0
            if want > have:
                raise ValueError(f"policy {policy.name!r} reads {sorted(reads)} over obs_window={want} queries, but "
                                 f"this session records {have} since its first forward; pass policies=[...] to "
                                 "HFSession")
            if self.queries is not None and self.queries.rope is None:
                self.queries.rope = self._rope
            return
        self._query_window = max(self._query_window, want)

    def _track(self, req_id: Hashable, policy: Any | None, budget: int | None) -> None:
        self.driver.add(req_id, policy, None if policy is None or budget is None else policy.budget.override(budget))
        self.prompt_lens.setdefault(req_id, 0)

    _FIELDS_BY_STAT = {"attn_window": ("obs_window",), "low_attn_count": ("history_window", "low_attn_threshold")}

    def _adopt_stats_config(self, policy: Any) -> None:
        """Collector parameters come from the policies; two policies may not disagree on one, and once
        statistics were collected (a forward ran) they cannot change."""
        cfg = policy.spec.stats
        update = {}
        for stat, fields in self._FIELDS_BY_STAT.items():
            if stat not in policy.stored_reads:
                continue
            for f in fields:
                want = getattr(cfg, f)
                have = self._claimed.get(f, getattr(self.stats_config, f) if self._started else None)
                if have is not None and have != want:
                    why = ("for another policy; use separate sessions" if f in self._claimed else
                           "since its first forward; pass policies=[...] (or stats_config=) to HFSession")
                    raise ValueError(f"policy {policy.name!r} needs {f}={want} but this session collects "
                                     f"{f}={have} {why}")
                self._claimed[f] = want
                update[f] = want
        if update:
            self.stats_config = self.stats_config.model_copy(update=update)

    def free(self, req_id: Hashable) -> None:
        if req_id in self.rows:
            self.rows.free(req_id)
        else:
            for c in (self.cache, *self.followers.values()):
                c.free(req_id)
        if self.queries is not None:
            self.queries.remove(req_id)
        self.driver.remove(req_id)
        self.prompt_lens.pop(req_id, None)
        self._prompt_ended.discard(req_id)

    def fork(self, src: Hashable, dst: Hashable, policy: Any | None = None, budget: int | None = None) -> None:
        """Add ``dst`` as a copy of ``src`` (tokens, evictions, K/V, statistics, pins), with its own policy:
        one shared prefill for many configurations."""
        if src in self.rows:
            return self._fork_rows(src, dst, policy, budget)
        self._check_policy(policy)
        pins = self.cache.pinned_positions(src)
        for c in (self.cache, *self.followers.values()):
            if c.fork(src, dst, pins) is None:
                raise MemoryError(f"out of KV blocks or request rows while forking {src!r} -> {dst!r}")
        if self.queries is not None:
            self.queries.fork(src, dst)
        self._track(dst, policy, budget)
        self.prompt_lens[dst] = self.prompt_lens.get(src, 0)
        if src in self._prompt_ended:
            self._prompt_ended.add(dst)

    def _fork_rows(self, src: Hashable, dst: Hashable, policy: Any | None, budget: int | None) -> None:
        """Fork of a request in per-row pages: ``dst`` starts in per-row pages too (it evicts no more)."""
        if dst in self.requests or dst in self.rows:
            raise ValueError(f"request {dst!r} already exists")
        self._check_policy(policy)
        if not self.rows.fork(src, dst):
            raise MemoryError(f"out of KV blocks or request rows while forking {src!r} -> {dst!r}")
        self._track(dst, policy, budget)
        self.requests[dst].in_rows = True
        self.prompt_lens[dst] = self.prompt_lens.get(src, 0)
        if src in self._prompt_ended:
            self._prompt_ended.add(dst)

    def logical_len(self, req_id: Hashable) -> int:
        """True length of a request (positions so far), wherever it lives."""
        return self.rows.logical_len(req_id) if req_id in self.rows else self.cache.logical_len(req_id)

    def _handoff(self, req_id: Hashable, keep: np.ndarray) -> int:
        """The driver's handoff: move ``req_id`` with its unequal keep mask ``[R, n_live]`` into per-row pages,
        in its own blocks (gather first: the layouts share them); the blocks its rows no longer need return
        to the pool. ValueError (nothing changed) for a mask that evicts a pin or a full row cache: the row cache
        validates before it moves anything, and the uniform cache lets the request go only after it took over."""
        c = self.cache
        pos, phys = c.live_slots(req_id)  # [R, n]: positions and uniform physical slots (fenced)
        km = np.asarray(keep, dtype=bool)
        self.rows.adopt_uniform(req_id, c.pinned_positions(req_id), pos, phys, km, list(c.table.get(req_id).blocks),
                                c.logical_len(req_id))
        c.release(req_id)  # its blocks are the row cache's now (the surplus already back in the pool)
        for f in self.followers.values():
            f.free(req_id)
        if self.queries is not None:
            self.queries.remove(req_id)
        return int(km.size - km.sum())

    def _reserve(self, req_id: Hashable, n: int) -> torch.Tensor:
        slots = self.cache.reserve(req_id, n)
        if slots is None:
            raise MemoryError(f"out of KV blocks while reserving {n} tokens for {req_id!r}")
        for c in self.followers.values():
            if c.reserve(req_id, n) is None:
                raise MemoryError("follower cache out of blocks")
        return torch.as_tensor(slots)

    # ------------------------------------------------------------------ forward
    def _check_window(self, req_ids: Sequence[Hashable], lens: Sequence[int]) -> None:
        """Refuse (ValueError, nothing run) tokens that would extend a prompt past the end :meth:`prefill`
        declared while the prompt is open: ``attn_window``'s observation window was placed at that end."""
        if "attn_window" not in self.stat_names:
            return
        for r, n in zip(req_ids, lens, strict=True):
            end = self.prompt_lens.get(r, 0)
            if r in self._prompt_ended or self.logical_len(r) + n <= end:
                continue  # generated tokens, or a chunk of the declared prompt
            where = (f"its prompt ({end} tokens, prefill(evict=False)) is still open" if end else
                     "it has no prompt yet")
            raise ValueError(
                f"request {r!r}: {where}, and attn_window's observation window is the prompt's last obs_window "
                "queries; pass the whole prompt to one prefill() call, or end the prompt first "
                "(evict(req_ids, 'prefill')) so these tokens count as generated ones")

    @torch.inference_mode()
    def forward(self, req_ids: Sequence[Hashable], tokens: Sequence[Sequence[int]], all_logits: bool = False
                ) -> torch.Tensor:
        """Run new tokens of several requests through the model (no eviction). Returns the last token's
        logits ``[B, V]``, or with ``all_logits`` every new token's ``[B, Q, V]`` (padded past a request's
        own count), e.g. for perplexity over a continuation. Tokens after a request's prompt (:meth:`prefill`)
        are generated tokens; a session collecting ``attn_window`` refuses (ValueError) tokens that would
        extend an open prompt or stand in for a missing one (see :meth:`prefill`)."""
        B = len(req_ids)
        lens = [len(t) for t in tokens]
        self._check_window(req_ids, lens)
        Q = max(lens)
        ids = torch.zeros(B, Q, dtype=torch.long)
        qpos = torch.full((B, Q), -1, dtype=torch.long)
        slots, row_slots, uni_b, row_b = [], [], [], []
        for b, (r, toks) in enumerate(zip(req_ids, tokens, strict=True)):
            start = self.logical_len(r)
            ids[b, : lens[b]] = torch.as_tensor(list(toks), dtype=torch.long)
            qpos[b, : lens[b]] = torch.arange(start, start + lens[b])
            if r in self.rows:
                got = self.rows.reserve(r, lens[b])
                if got is None:
                    raise MemoryError(f"out of KV blocks while reserving {lens[b]} tokens for {r!r} (per-row pages)")
                row_slots.append(got)
                row_b.append(b)
            else:
                slots.append(self._reserve(r, lens[b]))
                uni_b.append(b)
        uni_ids = [req_ids[b] for b in uni_b]
        md = self.cache.attention_metadata(uni_ids)
        rows = None
        if row_b:  # the uniform fields below cover the uniform requests only
            ub, rb = torch.as_tensor(uni_b, dtype=torch.long), torch.as_tensor(row_b, dtype=torch.long)
            rows = RowStep(ub, rb, [req_ids[b] for b in row_b], qpos[rb] >= 0,
                           torch.as_tensor([lens[b] for b in row_b], dtype=torch.int64), np.concatenate(row_slots, 1))
        upos = qpos if rows is None else qpos[rows.uni_b]
        plen = torch.as_tensor([self.prompt_lens.get(r, 0) for r in uni_ids], dtype=torch.int64)
        if not self._started:
            self.collector = StatsCollector(self.cache, self.stat_names, self.stats_config, self.group_size)
            if self._query_window:
                self.queries = QueryWindows(self.num_layers, self.num_kv_heads * self.group_size, self.num_kv_heads,
                                            self.head_dim, self._query_window, self.dtype, self.cache.device,
                                            rope=self._rope)
                self.driver.queries = self.queries
            self._started = True
        qwrite = None
        if self.queries is not None and uni_ids:
            tok = torch.arange(len(uni_ids) * Q).view(len(uni_ids), Q).masked_fill(upos < 0, -1)
            qwrite = self.queries.plan(uni_ids, tok.numpy(), upos.numpy())
        ctx = StepContext(self, md, upos >= 0, upos, plen, torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long),
                          qwrite, rows)
        with _vtoken_attention(self.model):
            out = self.model(input_ids=ids, position_ids=qpos.clamp(min=0), use_cache=False, vtoken_step=ctx,
                             logits_to_keep=0)
        logits = out.logits  # [B, Q, V]
        if all_logits:
            return logits.float()
        return logits[torch.arange(B), torch.as_tensor(lens) - 1].float()

    def prefill(self, req_ids: Sequence[Hashable], prompts: Sequence[Sequence[int]], evict: bool = True
                ) -> torch.Tensor:
        """Chunked prefill of whole prompts (``chunk_size`` tokens per forward), then eviction (also after
        every chunk but the last for budgets with ``when="chunks"``).

        Each request's prompt comes in ONE call: ``attn_window`` sums the prompt's last ``obs_window``
        queries, which needs the prompt's end before its first query runs. A session collecting it
        refuses (ValueError, nothing run) a request that already holds tokens (a second prefill, a fork of
        a prefilled request). With ``evict=False`` the prompt stays open until :meth:`evict` (phase
        "prefill" or "decode") or :meth:`decode` ends it; tokens given to :meth:`forward` after that are
        generated tokens (outside the window, as decode steps are)."""
        if "attn_window" in self.stat_names:
            held = [r for r in req_ids if self.logical_len(r) > 0]
            if held:
                raise ValueError(
                    f"requests {held[:4]!r} already hold tokens: attn_window's observation window is the last "
                    "obs_window queries of the prompt, so a prompt must come in one prefill() call; pass the "
                    "whole prompt to prefill(), or feed tokens after it with forward() / decode()")
        for r, p in zip(req_ids, prompts, strict=True):
            self.prompt_lens[r] = self.logical_len(r) + len(p)
        chunks = [self._chunks(len(p)) for p in prompts]
        last_logits: list[torch.Tensor | None] = [None] * len(req_ids)
        for step in range(max((len(c) for c in chunks), default=0)):
            idx = [i for i, c in enumerate(chunks) if step < len(c)]
            piece = [list(prompts[i][chunks[i][step][0]: chunks[i][step][1]]) for i in idx]
            logits = self.forward([req_ids[i] for i in idx], piece)
            for j, i in enumerate(idx):
                last_logits[i] = logits[j]
            mid = [req_ids[i] for i in idx if step < len(chunks[i]) - 1]
            if evict and mid:  # only budgets with when="chunks" evict between chunks
                self.evict(mid, "chunk")
        if evict:
            self.evict(req_ids, "prefill")
        return torch.stack([x for x in last_logits if x is not None])

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        """``[start, end)`` prefill chunks of ``chunk_size`` tokens."""
        bounds = list(range(0, n, self.chunk_size)) + [n]
        return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]

    def decode(self, req_ids: Sequence[Hashable], next_tokens: Sequence[int], evict: bool = True) -> torch.Tensor:
        """One decode step (one token per request), then eviction. Ends the requests' prompts."""
        self._prompt_ended.update(req_ids)
        logits = self.forward(req_ids, [[int(t)] for t in next_tokens])
        if evict:
            self.evict(req_ids, "decode")
        return logits

    def generate(self, req_ids: Sequence[Hashable], prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 eos_token_id: int | None = None) -> list[list[int]]:
        """Greedy generation with eviction after prefill and after every decode step."""
        logits = self.prefill(req_ids, prompts)
        outs: list[list[int]] = [[] for _ in req_ids]
        for step in range(max_new_tokens):
            nxt = logits.argmax(-1).tolist()
            for o, t in zip(outs, nxt, strict=True):
                o.append(int(t))
            if step == max_new_tokens - 1:
                break
            logits = self.decode(req_ids, nxt)
        if eos_token_id is not None:
            outs = [o[: o.index(eos_token_id) + 1] if eos_token_id in o else o for o in outs]
        return outs

    # ------------------------------------------------------------------ eviction
    def evict(self, req_ids: Sequence[Hashable], phase: str) -> int:
        """One eviction step of the driver (see :mod:`vtoken_runtime.eviction`); returns row-tokens evicted.
        A policy that raises, or returns a mask the contract or the cache refuses, fails only its own
        request, which falls back to no eviction (``requests[r].failures``). Phases "prefill" and "decode"
        end the requests' prompts (:meth:`prefill`)."""
        if phase != "chunk":
            self._prompt_ended.update(req_ids)
        return sum(self.driver.step(req_ids, phase).evicted.values())

    # ------------------------------------------------------------------ reporting
    def blocks(self, req_id: Hashable) -> dict[int, dict[str, int]]:
        """Held blocks per block size: full (no eviction), naive, vtoken, ideal. A request in per-row pages has
        its figures at the session's block size only (:meth:`RowCache.blocks`: also ``ideal_pages``,
        ``max_row``, ``rows_live_min`` / ``rows_live_max``)."""
        if req_id in self.rows:
            return {self.block_size: self.rows.blocks(req_id)}
        out = {}
        for bs, c in ((self.block_size, self.cache), *self.followers.items()):
            live, seq = c.live_tokens(req_id), c.logical_len(req_id)
            out[bs] = {"full": cdiv(seq, bs), "naive": c.naive_held_blocks(req_id), "vtoken": c.held_blocks(req_id),
                       "ideal": cdiv(live, bs), "moved": c.tokens_moved(req_id)}
        return out


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def perplexity(nll: Sequence[float]) -> float:
    return math.exp(sum(nll) / max(1, len(nll)))
