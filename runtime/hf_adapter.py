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
Works for any HF decoder whose attention calls ``attention_interface(self, q, k, v,
mask, scaling=..., **kwargs)`` after RoPE (Llama, Qwen2, Mistral, ...).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .cache import AttentionMetadata, VTokenCache
from .eviction import EvictionDriver, TrackedRequest, refuse_unequal
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
class StepContext:
    """What one forward needs in every layer (passed as the ``vtoken_step`` kwarg)."""

    session: HFSession
    md: AttentionMetadata
    valid: torch.Tensor  # [B, Q] bool
    query_pos: torch.Tensor  # [B, Q] int64, -1 = padding
    prompt_lens: torch.Tensor  # [B] int64 (attn_window: the prompt's last obs_window queries)
    slots: torch.Tensor  # [T] physical slots of the valid new tokens (row-major over [B, Q])
    query_write: WriteIndex | None = None  # where the step's queries go in the query window store


def vtoken_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                     vtoken_step: StepContext | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``query [B, H_q, Q, D]``, ``key/value [B, H_kv, Q, D]`` -> ``out [B, Q, H_q, D]``."""
    if vtoken_step is None:
        raise RuntimeError("vtoken_paged attention needs the vtoken_step kwarg; run the model through HFSession")
    ctx = vtoken_step
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
    return out, None


class HFSession:
    """A paged vToken cache driving a HF causal LM, with per-request policies.

    ``granularity="head"`` caches accept request-granularity policies too (their rows agree).
    ``follower_block_sizes``: extra bookkeeping-only caches (head_size 1) that receive the same
    decisions, so held-block figures for other block sizes come from the real planner.
    ``policies``: the policies the session will run (their statistics and collector parameters are
    claimed up front, which a shared prefill needs: statistics are collected before requests fork).
    Eviction is :class:`~vtoken_runtime.eviction.EvictionDriver`'s; ``requests[r]`` is its record
    (``failures``, ``keep_log``).
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
        self.cache = VTokenCache(self.num_layers, self.num_kv_heads, self.head_dim, block_size, num_blocks,
                                 granularity=granularity, mode=mode, dtype=self.dtype, stat_names=self.stat_names,
                                 max_requests=max_requests, async_copy=async_copy, debug=debug)
        self.followers = {bs: VTokenCache(self.num_layers, self.num_kv_heads, 1, bs,
                                          cdiv(num_blocks * block_size, bs) + max_requests, granularity=granularity,
                                          mode=mode, max_requests=max_requests, async_copy=False)
                          for bs in follower_block_sizes}
        self.driver = EvictionDriver(self.cache, list(self.followers.values()), record_keeps=record_keeps)
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
        pins = np.asarray(list(pinned_positions), dtype=np.int64)
        for c in (self.cache, *self.followers.values()):  # the first refuses before any changed: same tokens
            c.set_pins(req_id, pins)

    def _check_policy(self, policy: Any | None) -> None:
        if policy is None:
            return
        refuse_unequal(policy)  # before the caches see the request: a refusal changes nothing
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
            if r in self._prompt_ended or self.cache.logical_len(r) + n <= end:
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
        slots = []
        for b, (r, toks) in enumerate(zip(req_ids, tokens, strict=True)):
            start = self.cache.logical_len(r)
            ids[b, : lens[b]] = torch.as_tensor(list(toks), dtype=torch.long)
            qpos[b, : lens[b]] = torch.arange(start, start + lens[b])
            slots.append(self._reserve(r, lens[b]))
        md = self.cache.attention_metadata(list(req_ids))
        plen = torch.as_tensor([self.prompt_lens.get(r, 0) for r in req_ids], dtype=torch.int64)
        if not self._started:
            self.collector = StatsCollector(self.cache, self.stat_names, self.stats_config, self.group_size)
            if self._query_window:
                self.queries = QueryWindows(self.num_layers, self.num_kv_heads * self.group_size, self.num_kv_heads,
                                            self.head_dim, self._query_window, self.dtype, self.cache.device,
                                            rope=self._rope)
                self.driver.queries = self.queries
            self._started = True
        qwrite = None
        if self.queries is not None:
            tok = torch.arange(B * Q).view(B, Q).masked_fill(qpos < 0, -1)
            qwrite = self.queries.plan(list(req_ids), tok.numpy(), qpos.numpy())
        ctx = StepContext(self, md, qpos >= 0, qpos, plen, torch.cat(slots), qwrite)
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
            held = [r for r in req_ids if self.cache.logical_len(r) > 0]
            if held:
                raise ValueError(
                    f"requests {held[:4]!r} already hold tokens: attn_window's observation window is the last "
                    "obs_window queries of the prompt, so a prompt must come in one prefill() call; pass the "
                    "whole prompt to prefill(), or feed tokens after it with forward() / decode()")
        for r, p in zip(req_ids, prompts, strict=True):
            self.prompt_lens[r] = self.cache.logical_len(r) + len(p)
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
        """Held blocks per block size: full (no eviction), naive, vtoken, ideal."""
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
