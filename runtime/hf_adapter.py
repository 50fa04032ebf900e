"""HF transformers adapter: run a causal LM over a :class:`VTokenCache` with vtoken policies.

No forked model code: the model runs with ``attn_implementation="vtoken_paged"``, a
function registered with transformers' ``AttentionInterface`` (and a no-op mask in
``AttentionMaskInterface``). The model is called with ``use_cache=False`` and true
``position_ids`` (RoPE); every attention layer then

    1. writes the step's new K/V (after RoPE) into the paged cache at reserved slots,
    2. runs paged attention over the request's live tokens (causal by true position),
    3. folds the attention probabilities into the statistics the policies declared.

After each forward the adapter asks each request's policy for a keep mask (when its
budget says so), applies it and reclaims: compaction frees tail blocks immediately.
Works for any HF decoder whose attention calls ``attention_interface(self, q, k, v,
mask, scaling=..., **kwargs)`` after RoPE (Llama, Qwen2, Mistral, ...).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .cache import AttentionMetadata, VTokenCache
from .stats_collector import needs_probs, update_attention_stats, write_norms

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


@dataclass
class StepContext:
    """What one forward needs in every layer (passed as the ``vtoken_step`` kwarg)."""

    session: HFSession
    md: AttentionMetadata
    valid: torch.Tensor  # [B, Q] bool
    query_pos: torch.Tensor  # [B, Q] int64, -1 = padding
    slots: torch.Tensor  # [T] physical slots of the valid new tokens (row-major over [B, Q])


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
    write_norms(s.cache, layer, ctx.slots, k, v)
    q = query.transpose(1, 2)  # [B, Q, H_q, D]
    out, probs = s.cache.attention(layer, q, ctx.md, ctx.query_pos, return_probs=s.collect_probs, scale=scaling)
    if probs is not None:
        cfg = s.stats_config
        update_attention_stats(s.cache, layer, ctx.md, probs, ctx.query_pos, s.group_size, cfg.obs_window,
                               cfg.history_window, cfg.low_attn_threshold)
    return out, None


@dataclass
class RequestInfo:
    policy: Any | None  # vtoken_sdk.Policy or None (no eviction)
    budget: int | None = None  # per-request budget override (tokens)
    pins: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    failures: list[str] = field(default_factory=list)
    keep_log: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (logical_len, kept positions [R, n])


class HFSession:
    """A paged vToken cache driving a HF causal LM, with per-request policies.

    ``granularity="head"`` caches accept request-granularity policies too (their rows agree).
    ``shadow_block_sizes``: extra bookkeeping-only caches (head_size 1) that receive the same
    decisions, so held-block figures for other block sizes come from the real planner.
    """

    def __init__(self, model: Any, *, block_size: int = 16, num_blocks: int = 4096, mode: str = "compact",
                 granularity: str = "head", stat_names: Sequence[str] = (), max_requests: int = 64,
                 chunk_size: int = 512, stats_config: Any = None, shadow_block_sizes: Sequence[int] = (),
                 record_keeps: bool = False, async_copy: bool = True, debug: bool | None = None) -> None:
        register()
        from vtoken_sdk.stats import StatsConfig

        cfg = model.config
        if getattr(cfg, "_attn_implementation", None) != ATTN_NAME:
            cfg._attn_implementation = ATTN_NAME
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
        self.stat_names = tuple(sorted(set(stat_names)))
        self.collect_probs = needs_probs(self.stat_names)
        self.record_keeps = record_keeps
        self.cache = VTokenCache(self.num_layers, self.num_kv_heads, self.head_dim, block_size, num_blocks,
                                 granularity=granularity, mode=mode, dtype=self.dtype, stat_names=self.stat_names,
                                 max_requests=max_requests, async_copy=async_copy, debug=debug)
        self.shadows = {bs: VTokenCache(self.num_layers, self.num_kv_heads, 1, bs,
                                        cdiv(num_blocks * block_size, bs) + max_requests, granularity=granularity,
                                        mode=mode, max_requests=max_requests, async_copy=False)
                        for bs in shadow_block_sizes}
        self.requests: dict[Hashable, RequestInfo] = {}

    # ------------------------------------------------------------------ requests
    def add(self, req_id: Hashable, policy: Any | None = None, pinned_positions: Sequence[int] | None = None,
            budget: int | None = None) -> None:
        if policy is not None:
            missing = set(policy.stored_reads) - set(self.stat_names)
            if missing:
                raise ValueError(f"policy {policy.name!r} reads {sorted(missing)}, which this session does not "
                                 f"collect (stat_names={list(self.stat_names)})")
            self._adopt_stats_config(policy)
        pins = np.asarray(list(pinned_positions or ()), dtype=np.int64)
        for c in (self.cache, *self.shadows.values()):
            if c.add_request(req_id, pins) is None:
                raise ValueError(f"max_requests reached; cannot add {req_id!r}")
        self.requests[req_id] = RequestInfo(policy, budget, np.unique(pins))

    _FIELDS_BY_STAT = {"attn_window": ("obs_window",), "low_attn_count": ("history_window", "low_attn_threshold")}

    def _adopt_stats_config(self, policy: Any) -> None:
        """Collector parameters come from the policies; two policies may not disagree on one."""
        cfg = policy.spec.stats
        update = {}
        for stat, fields in self._FIELDS_BY_STAT.items():
            if stat not in policy.stored_reads:
                continue
            for f in fields:
                want = getattr(cfg, f)
                have = self._claimed.get(f)
                if have is not None and have != want:
                    raise ValueError(f"policy {policy.name!r} needs {f}={want} but this session collects "
                                     f"{f}={have} for another policy; use separate sessions")
                self._claimed[f] = want
                update[f] = want
        if update:
            self.stats_config = self.stats_config.model_copy(update=update)

    def free(self, req_id: Hashable) -> None:
        for c in (self.cache, *self.shadows.values()):
            c.free(req_id)
        del self.requests[req_id]

    def fork(self, src: Hashable, dst: Hashable, policy: Any | None = None, budget: int | None = None) -> None:
        """Copy a request that has not evicted anything yet (e.g. one shared prefill, many policies)."""
        c = self.cache
        n = c.logical_len(src)
        if c.live_tokens(src) != n:
            raise ValueError(f"fork source {src!r} has already evicted tokens")
        self.add(dst, policy, self.requests[src].pins.tolist(), budget)
        slots = self._reserve(dst, n)
        st = c.table.get(src)
        _, vs = c.table.live_view(st)
        src_slots = torch.as_tensor(st.phys(vs[0]))
        for layer in range(self.num_layers):
            kc, vc = c.key_cache(layer), c.value_cache(layer)
            b, o = src_slots // c.block_size, src_slots % c.block_size
            c.write_kv_slots(layer, slots, kc[b, o], vc[b, o])
        for name in self.stat_names:
            t = c.stats_tensor(name)
            t[:, :, slots] = t[:, :, src_slots]

    def _reserve(self, req_id: Hashable, n: int) -> torch.Tensor:
        slots = self.cache.reserve(req_id, n)
        if slots is None:
            raise MemoryError(f"out of KV blocks while reserving {n} tokens for {req_id!r}")
        for c in self.shadows.values():
            if c.reserve(req_id, n) is None:
                raise MemoryError("shadow cache out of blocks")
        return torch.as_tensor(slots)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, req_ids: Sequence[Hashable], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Run new tokens of several requests through the model; returns last-token logits ``[B, V]``."""
        B = len(req_ids)
        lens = [len(t) for t in tokens]
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
        valid = qpos >= 0
        ctx = StepContext(self, md, valid, qpos, torch.cat(slots))
        pos_ids = qpos.clamp(min=0)
        out = self.model(input_ids=ids, position_ids=pos_ids, use_cache=False, vtoken_step=ctx,
                         logits_to_keep=0)
        logits = out.logits  # [B, Q, V]
        last = torch.as_tensor(lens) - 1
        return logits[torch.arange(B), last].float()

    def prefill(self, req_ids: Sequence[Hashable], prompts: Sequence[Sequence[int]], evict: bool = True
                ) -> torch.Tensor:
        """Chunked prefill of whole prompts (``chunk_size`` tokens per forward), then eviction."""
        chunks = [self._chunks(len(p)) for p in prompts]
        last_logits: list[torch.Tensor | None] = [None] * len(req_ids)
        for step in range(max((len(c) for c in chunks), default=0)):
            idx = [i for i, c in enumerate(chunks) if step < len(c)]
            piece = [list(prompts[i][chunks[i][step][0]: chunks[i][step][1]]) for i in idx]
            logits = self.forward([req_ids[i] for i in idx], piece)
            for j, i in enumerate(idx):
                last_logits[i] = logits[j]
        if evict:
            self.evict(req_ids, "prefill")
        return torch.stack([x for x in last_logits if x is not None])

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        """``[start, end)`` prefill chunks; the last one holds at least ``obs_window`` tokens so the
        observation window (SnapKV) sees the prompt's last W queries in one step."""
        bounds = list(range(0, n, self.chunk_size)) + [n]
        w = min(n, self.stats_config.obs_window)
        if len(bounds) > 2 and bounds[-1] - bounds[-2] < w:
            bounds[-2] = n - w
        return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]

    def decode(self, req_ids: Sequence[Hashable], next_tokens: Sequence[int], evict: bool = True) -> torch.Tensor:
        """One decode step (one token per request), then eviction."""
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
        """Ask each request's policy for a keep mask where its budget says so; apply and reclaim.

        A policy that raises, or returns a mask the cache refuses (pins, unequal counts), fails
        only its own requests: they keep their cache this step and the failure is logged.
        """
        groups: dict[int, list[Hashable]] = {}
        for r in req_ids:
            info = self.requests[r]
            p = info.policy
            if p is None:
                continue
            if not p.budget.should_evict(self.cache.live_tokens(r), self.cache.logical_len(r), phase, info.budget):
                continue
            groups.setdefault(id(p), []).append(r)
        evicted = 0
        touched = []
        for rs in groups.values():
            policy = self.requests[rs[0]].policy
            try:
                masks = self._keep_masks(policy, rs)
            except Exception as e:  # the policy's bug: these requests keep their cache this step
                log.warning("policy %s failed for %d request(s): %s", policy.name, len(rs), e)
                for r in rs:
                    self.requests[r].failures.append(f"{type(e).__name__}: {e}")
                continue
            for r, keep in zip(rs, masks, strict=True):
                if isinstance(keep, str):
                    log.warning("%s (request %r keeps its cache)", keep, r)
                    self.requests[r].failures.append(keep)
                    continue
                try:
                    evicted += self.cache.apply_keep_mask(r, keep)
                except ValueError as e:
                    log.warning("keep mask of policy %s refused for %r: %s", policy.name, r, e)
                    self.requests[r].failures.append(str(e))
                    continue
                for c in self.shadows.values():
                    c.apply_keep_mask(r, keep)
                if self.record_keeps:
                    pos, _ = self.cache.live_view(r)
                    self.requests[r].keep_log.append((self.cache.logical_len(r), pos.copy()))
                touched.append(r)
        if touched:
            self.cache.reclaim(touched)
            for c in self.shadows.values():
                c.reclaim(touched)
        return evicted

    def _keep_masks(self, policy: Any, rs: list[Hashable]) -> list[np.ndarray | str]:
        from vtoken_sdk.batch import StatsBatch

        c = self.cache
        L, H = self.num_layers, self.num_kv_heads
        views = [c.live_view(r) for r in rs]
        n_max = max(v[0].shape[1] for v in views)
        B = len(rs)
        rows = c.num_rows
        pos = torch.full((B, L, H, n_max), 0, dtype=torch.int64) if rows > 1 else torch.zeros(B, 1, 1, n_max,
                                                                                             dtype=torch.int64)
        stats = {name: torch.zeros(B, L, H, n_max) for name in policy.stored_reads}
        lengths = torch.zeros(B, dtype=torch.int64)
        seq = torch.zeros(B, dtype=torch.int64)
        budget = torch.zeros(B, dtype=torch.int64)
        pinned = torch.zeros(pos.shape, dtype=torch.bool)
        for b, (r, (p, _)) in enumerate(zip(rs, views, strict=True)):
            n = p.shape[1]
            pt = torch.as_tensor(p)
            pos[b, ..., :n] = pt.view(L, H, n) if rows > 1 else pt.view(1, 1, n)
            pos[b, ..., n:] = c.logical_len(r) + torch.arange(n_max - n)
            lengths[b] = n
            seq[b] = c.logical_len(r)
            info = self.requests[r]
            budget[b] = info.budget if info.budget is not None else policy.budget.resolve(int(seq[b]))
            if info.pins.size:
                pinned[b] = torch.as_tensor(np.isin(pos[b].numpy(), info.pins))
            if policy.stored_reads:
                g = c.gather_stats(r, sorted(policy.stored_reads))
                for name, t in g.items():
                    stats[name][b, ..., :n] = t
        batch = StatsBatch(stats=stats, lengths=lengths, positions=pos, seq_lens=seq, pinned=pinned, budget=budget)
        compiled = policy.compile("torch")
        mask = compiled.keep_mask(batch)  # [B, L, H, N]
        bad: list[str | None] = [None] * B
        if policy.kind == "mask" or self.cache.debug:  # score policies hold the contract by construction
            bad = compiled.contract_violations(batch, mask)
        out: list[np.ndarray | str] = []
        for b, (p, _) in enumerate(views):
            if bad[b] is not None:
                out.append(f"policy {policy.name!r} broke the selection contract: {bad[b]}")
                continue
            n = p.shape[1]
            m = mask[b, ..., :n].reshape(L * H, n)
            if rows == 1:
                if not (m == m[:1]).all():
                    raise ValueError(f"policy {policy.name!r} gave per-head masks to a request-granularity cache")
                m = m[:1]
            out.append(m.numpy())
        return out

    # ------------------------------------------------------------------ reporting
    def blocks(self, req_id: Hashable) -> dict[int, dict[str, int]]:
        """Held blocks per block size: full (no eviction), naive, vtoken, ideal."""
        out = {}
        for bs, c in ((self.block_size, self.cache), *self.shadows.items()):
            live, seq = c.live_tokens(req_id), c.logical_len(req_id)
            out[bs] = {"full": cdiv(seq, bs), "naive": c.naive_held_blocks(req_id), "vtoken": c.held_blocks(req_id),
                       "ideal": cdiv(live, bs), "moved": c.tokens_moved(req_id)}
        return out


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def perplexity(nll: Sequence[float]) -> float:
    return math.exp(sum(nll) / max(1, len(nll)))
