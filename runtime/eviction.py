"""The eviction driver every adapter calls (HF transformers, the vLLM workers): one step, written once.

    add(req, policy, budget)   once per request: its policy and budget (the policy's, or a per-request
                               override with the policy's min_tokens / slack / when); pins live in the cache
    step(req_ids, phases)      after a forward:
      1. who      each eligible request whose budget says so: Budget.should_evict(live, seq_len, phase)
      2. batch    StatsBatch [B, L, H, N] from the cache: live positions, the policy's stored stats,
                  pins, per-request budgets (one batch per policy), and the vector statistics it reads
                  (``policy.vector_reads``): keys / values gathered from the KV cache through the token
                  table (``cache.gather_kv_vectors``), query summaries from the query window store
                  (``queries``, :mod:`vtoken_runtime.stats.query_vectors`). A head-granularity policy reading
                  vectors is evaluated in layer chunks (``StatsBatch.layer_offset``) whose vectors stay
                  under ``vector_chunk_bytes`` (env ``VTOKEN_VECTOR_CHUNK_BYTES``, default 256 MiB)
      3. select   ONE batched compiled keep_mask per policy; if it raises, each request is retried
                  alone. A request whose policy raises, or whose mask breaks the selection contract
                  (checked for mask policies, and for every policy under VTOKEN_DEBUG), or whose mask
                  the cache refuses, falls back to no eviction from then on; counted in ``failures``.
                  Runtime faults are not the policy's and propagate (``_debug.runtime_fault``: a broken
                  invariant, out of memory, a device error): the step cannot go on over a state nobody
                  can trust
      4. apply    cache.apply_keep_mask (and every follower cache: the HF adapter's ``follower_block_sizes``);
                  a policy with unequal budgets per row (``allocation=``) hands the request to the adapter's
                  per-row pages instead (``handoff``: the HF adapter's :class:`~vtoken_runtime.row_cache.RowCache`),
                  once, after prefill: it evicts no more by scores (``TrackedRequest.in_rows``); rows
                  that are position classes (``HeadClasses``, DuoAttention) are cut back to their sinks
                  and recent window during decode (``streams_rows``, the adapter's ``RowAccess``)
      5. reclaim  cache.reclaim(evicted requests): plan, commit, free tail blocks, async copy
      6. report   StepReport: per request evicted tokens / failure, the reclaim's figures, timings

The compiled form comes from ``vtoken_sdk.compile_policy(policy, device=cache.device)``: the Triton
kernels for CUDA caches, the torch backend elsewhere (``VTOKEN_POLICY_BACKEND`` overrides).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from vtoken_sdk import Budget, CompiledPolicy, HeadClasses, Policy, StatsBatch, compile_policy
from vtoken_sdk.budget import PHASES_OF
from vtoken_sdk.stats import KVCACHE_STATS, QUERY_STATS

from ._debug import reraise_runtime_fault
from .cache import ReclaimStats, VTokenCache
from .stats.query_vectors import QueryWindows

log = logging.getLogger("vtoken.eviction")
ReqId = Hashable


@dataclass
class TrackedRequest:
    """What the driver knows of one request (set once, at :meth:`EvictionDriver.add`)."""

    policy: Policy | None
    budget: Budget | None
    failures: list[str] = field(default_factory=list)  # the first one disables eviction for the request
    # (logical_len, kept positions [R, n]; a list of R arrays for a request handed to per-row pages)
    keep_log: list[tuple[int, np.ndarray | list[np.ndarray]]] = field(default_factory=list)
    in_rows: bool = False  # handed to per-row pages (unequal budgets): evicts no more (but see streams_rows)
    rows_len: int = 0  # logical length at its last per-row eviction (the handoff included)
    frozen: int = 0  # the first `frozen` positions are a frozen prefix (prefix caching): pinned

    @property
    def evicts(self) -> bool:
        return self.policy is not None and not self.failures and not self.in_rows


@dataclass
class StepReport:
    """What one :meth:`EvictionDriver.step` did."""

    evicted: dict[ReqId, int] = field(default_factory=dict)  # row-tokens evicted per request (> 0 only)
    failed: dict[ReqId, str] = field(default_factory=dict)  # requests that failed in this step
    reclaim: ReclaimStats = field(default_factory=ReclaimStats)
    policy_seconds: float = 0.0
    reclaim_seconds: float = 0.0


class Collective(Protocol):
    """What the driver needs from a tensor-parallel group (every rank holds some KV heads of every layer).

    Ranks see identical requests, lengths and pins, so they pick identical candidates; two collectives
    per policy group and step then keep their decisions identical: request-granularity statistics are
    gathered along the head axis BEFORE any policy code runs (every rank scores the same full batch),
    and failures are agreed AFTER selection (a request that failed on any rank fails on all), so a
    policy error on one rank can neither deadlock nor desynchronise the others. A policy with unequal budgets
    (``allocation=``) is gathered the same way, positions and pins included: a layer's counts need every
    head's scores, so every rank selects the whole layer, exactly as one rank would, and keeps its own heads'
    rows (:meth:`EvictionDriver._select`)."""

    rank: int  # this rank's place in the group (its heads are ``rank * H_local ..``)
    world_size: int

    def gather_heads(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, L, H_local, *axes] -> [B, L, H_total, *axes]`` (along dim 2) in rank order, identical on every
        rank (scalar statistics ``[B, L, H, N]`` and vectors such as keys ``[B, L, H, N, D]``)."""
        ...

    # Pipeline parallelism: each stage holds some layers (``pp_size`` stages, see ``gather_layers``). Request-
    # granularity statistics are gathered along the layer axis too (every stage scores the whole model), and
    # ``any`` / ``max`` agree over every rank of every stage.
    pp_size: int

    def gather_layers(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, L_stage, H, *axes] -> [B, L_model, H, *axes]`` (along dim 1) in stage order, identical on every
        stage."""
        ...

    def any(self, flags: list[bool]) -> list[bool]:
        """Element-wise OR of ``flags`` over the ranks."""
        ...

    def max(self, values: list[int]) -> list[int]:
        """Element-wise maximum of ``values`` over the ranks."""
        ...


class Handoff(Protocol):
    """Moves a request and its unequal keep mask ``[R, n_live]`` out of the uniform cache into per-row pages;
    returns the row-tokens evicted. ValueError: refused, nothing changed."""

    def __call__(self, req_id: ReqId, keep: np.ndarray) -> int: ...


class RowAccess(Protocol):
    """The adapter's per-row pages, for requests already handed to them (``in_rows``) whose policy's rows are
    position classes (:class:`~vtoken_sdk.HeadClasses`, DuoAttention): what the driver reads to re-evict them
    during decode, and the eviction itself."""

    def row_view(self, req_id: ReqId) -> tuple[list[np.ndarray], np.ndarray, int]:
        """``(positions of every row (ascending), pinned positions, logical length)``."""
        ...

    def row_evict(self, req_id: ReqId, keep: list[np.ndarray]) -> int:
        """Keep ``keep[r]`` (bool over row ``r``'s tokens) in every row, compact, free emptied blocks; returns the
        row-tokens evicted. ValueError: refused, nothing changed."""
        ...


def head_classes_row_keep(alloc: HeadClasses, positions: Sequence[np.ndarray], pinned: np.ndarray, seq_len: int,
                          num_kv_heads: int, head_offset: int = 0, layer_offset: int = 0) -> list[np.ndarray]:
    """:func:`vtoken_sdk.allocation.head_classes_keep` for rows of unequal lengths (a request in per-row pages):
    row ``r = layer * num_kv_heads + head`` (this rank's heads start at global head ``head_offset``, its layers
    at ``layer_offset``) keeps every token if it is a retrieval row, else its pins and the positions ``< sinks``
    or ``>= seq_len - recent``. Returns one bool array per row."""
    ret = set(alloc.retrieval)
    pins = np.asarray(pinned, dtype=np.int64)
    out = []
    for r, p in enumerate(positions):
        layer, head = layer_offset + r // num_kv_heads, head_offset + r % num_kv_heads
        p = np.asarray(p, dtype=np.int64)
        if (layer, head) in ret:
            out.append(np.ones(p.size, dtype=bool))
        else:
            out.append((p < alloc.sinks) | (p >= seq_len - alloc.recent) | np.isin(p, pins))
    return out


def streams_rows(policy: Policy | None, budget: Budget | None) -> bool:
    """Whether a request of ``policy`` in per-row pages is evicted again during decode: its rows are position
    classes (:class:`~vtoken_sdk.HeadClasses`: streaming rows keep sinks and a recent window, so they need no
    statistics) and its budget evicts during decode (``when`` "decode" or "both")."""
    return (policy is not None and isinstance(policy.spec.allocation, HeadClasses) and budget is not None
            and "decode" in PHASES_OF[budget.when])


COUNTERS = ("evictions", "tokens_evicted", "tokens_moved", "blocks_freed", "policy_failures")


def refuse_unequal(policy: Policy | None, budget: Budget | None = None, rows: bool = False) -> None:
    """ValueError for a policy whose rows keep unequal numbers of tokens where the runtime cannot hold them.

    ``rows=False`` (the experiment runner, a driver without a handoff): the token table keeps one length per
    request (docs/decisions.md, decision 4), so any unequal allocation is refused. ``rows=True`` (the HF
    adapter and the vLLM workers, which have per-row pages, decision 8): refused unless the budget evicts once, after prefill
    (``when="prefill"``), because a request in per-row pages is not evicted again by scores (its statistics
    would need one length per row). Position classes (:class:`~vtoken_sdk.HeadClasses`, DuoAttention) need no
    statistics: they may also evict during decode (``when="decode"`` or ``"both"``: :func:`streams_rows`)."""
    if policy is None or policy.spec.uniform:
        return
    if rows:
        when = (budget or policy.budget).when
        if isinstance(policy.spec.allocation, HeadClasses) and when in ("prefill", "decode", "both"):
            return  # position classes: re-evicted during decode without statistics (streams_rows)
        if when != "prefill":
            raise ValueError(f"policy {policy.name!r} has allocation={policy.spec.allocation!r} and evicts with "
                             f"when={when!r}; per-row pages take a request once, after prefill: use "
                             "budget=vt.Budget(..., when='prefill') (every shipped unequal policy does), or "
                             "allocation=vt.Uniform() to evict during decode (only vt.HeadClasses rows, which need "
                             "no statistics, are evicted again during decode)")
        return
    raise ValueError(f"policy {policy.name!r} has allocation={policy.spec.allocation!r} (unequal budgets per "
                     "(layer, KV head) row); this runtime keeps one length per request and runs only "
                     "allocation=vt.Uniform(); per-row pages exist in the HF adapter (HFSession, "
                     "docs/decisions.md, decision 8) and come to vLLM with issue 39. To serve it now, "
                     "configure(allocation=vt.Uniform())")


class EvictionDriver:
    """Drives eviction for the requests of one :class:`VTokenCache`. ``followers``: bookkeeping caches that
    receive the same decisions (other block sizes); ``record_keeps``: log every request's kept positions."""

    def __init__(self, cache: VTokenCache, followers: Sequence[VTokenCache] = (), record_keeps: bool = False,
                 collective: Collective | None = None, queries: QueryWindows | None = None,
                 vector_chunk_bytes: int | None = None, handoff: Handoff | None = None, layer_base: int = 0,
                 model_layers: int | None = None, rows: RowAccess | None = None) -> None:
        self.cache = cache
        self.rows = rows  # per-row pages, for the decode re-eviction of position-class rows (streams_rows)
        # the cache's layer 0 is the model's layer ``layer_base`` of ``model_layers`` (a pipeline stage holds a
        # contiguous run of layers): what ``s.layer`` / ``s.num_layers`` read
        self.layer_base, self.model_layers = int(layer_base), model_layers
        self.handoff = handoff
        self.collective = collective
        self.queries = queries  # the query window store (query statistics), set by the adapter
        self.vector_chunk_bytes = int(vector_chunk_bytes or os.environ.get("VTOKEN_VECTOR_CHUNK_BYTES", 256 << 20))
        self.followers = list(followers)
        self.record_keeps = record_keeps
        self.requests: dict[ReqId, TrackedRequest] = {}
        self.counters: dict[str, float] = {k: 0 for k in COUNTERS} | {"policy_seconds": 0.0,
                                                                       "reclaim_seconds": 0.0}

    # ------------------------------------------------------------------ requests
    def add(self, req_id: ReqId, policy: Policy | None, budget: Budget | None = None) -> TrackedRequest:
        """Track a request (already added to the cache). ``budget``: a per-request override."""
        if req_id in self.requests:
            raise ValueError(f"request {req_id!r} is already tracked")
        refuse_unequal(policy, budget, rows=self.handoff is not None)
        t = TrackedRequest(policy, budget if budget is not None or policy is None else policy.budget)
        self.requests[req_id] = t
        return t

    def remove(self, req_id: ReqId) -> None:
        self.requests.pop(req_id, None)

    def freeze_prefix(self, req_id: ReqId, tokens: int) -> bool:
        """Freeze the request's first ``tokens`` positions (vLLM's prefix cache holds them, or may: see
        ``vllm_plugin.prefix``): pinned in the cache and its followers (never evicted; compaction never moves a
        token below the first hole, so never moved either). The budget is unchanged: it counts them, as it
        counts every pin. Monotone: a smaller ``tokens`` changes nothing. Returns whether the prefix grew.
        ValueError (nothing changed) if a position in it is already evicted."""
        t = self.requests[req_id]
        if tokens <= t.frozen:
            return False
        pins = np.union1d(self.cache.pinned_positions(req_id), np.arange(tokens, dtype=np.int64))
        for c in (self.cache, *self.followers):
            c.set_pins(req_id, pins)
        t.frozen = int(tokens)
        return True

    # ------------------------------------------------------------------ the step
    def step(self, req_ids: Sequence[ReqId], phases: str | Mapping[ReqId, str]) -> StepReport:
        """Evict where budgets say so (``phases``: "prefill"/"decode", one for all or per request)."""
        report = StepReport()
        cache = self.cache
        groups: dict[int, list[ReqId]] = {}
        streaming: list[ReqId] = []
        for r in req_ids:
            t = self.requests.get(r)
            if t is not None and t.in_rows and not t.failures and self.rows is not None and \
                    streams_rows(t.policy, t.budget) and \
                    (phases if isinstance(phases, str) else phases[r]) == "decode":
                streaming.append(r)
            if t is None or not t.evicts:
                continue
            phase = phases if isinstance(phases, str) else phases[r]
            assert t.budget is not None and t.policy is not None
            if t.budget.should_evict(cache.live_tokens(r), cache.logical_len(r), phase,  # type: ignore[arg-type]
                                     block_size=cache.block_size):
                groups.setdefault(id(t.policy), []).append(r)
        if streaming:
            self._stream_rows(streaming, report)
        if not groups:
            self._count(report)
            return report
        t0 = time.perf_counter()
        masks: dict[ReqId, np.ndarray] = {}
        for rs in groups.values():
            masks.update(self._masks(rs, report))
        t1 = time.perf_counter()
        handed: list[ReqId] = []
        for r, keep in masks.items():
            t = self.requests[r]
            assert t.policy is not None
            if not t.policy.spec.uniform and self.handoff is not None:
                n, kept = self._hand_off(r, keep, report)
                if n < 0:
                    continue
                handed.append(r)
                if kept is not None:
                    t.keep_log.append(kept)
                if n:
                    report.evicted[r] = n
                continue
            try:
                n = cache.apply_keep_mask(r, keep)
            except ValueError as e:  # a mask the cache refuses (pins, unequal counts): this request only
                self._fail(r, f"keep mask refused: {e}", report)
                continue
            for c in self.followers:
                c.apply_keep_mask(r, keep)
            if self.record_keeps:
                t.keep_log.append((cache.logical_len(r), cache.live_view(r)[0].copy()))
            if n:
                report.evicted[r] = n
        compacted = [r for r in report.evicted if r not in handed]
        if compacted:
            report.reclaim = cache.reclaim(compacted)
            for c in self.followers:
                c.reclaim(compacted)
        report.policy_seconds, report.reclaim_seconds = t1 - t0, time.perf_counter() - t1
        self._count(report)
        return report

    def _count(self, report: StepReport) -> None:
        c_ = self.counters
        c_["evictions"] += len(report.evicted)
        c_["tokens_evicted"] += sum(report.evicted.values())
        c_["tokens_moved"] += report.reclaim.tokens_moved
        c_["blocks_freed"] += report.reclaim.blocks_freed
        c_["policy_seconds"] += report.policy_seconds
        c_["reclaim_seconds"] += report.reclaim_seconds

    def _stream_rows(self, rs: list[ReqId], report: StepReport) -> None:
        """Decode re-eviction of requests in per-row pages whose rows are position classes (``streams_rows``):
        every streaming row back to its sinks, pins and recent window once the request has grown by more than
        the budget's slack since its last per-row eviction (``slack="block"``: a block). The decision reads only
        the logical length, which every tensor-parallel rank sees alike, so the ranks evict at the same steps."""
        assert self.rows is not None
        col = self.collective
        head_offset = col.rank * self.cache.num_kv_heads if col is not None else 0
        for r in rs:
            t = self.requests[r]
            assert t.budget is not None and t.policy is not None
            positions, pinned, n = self.rows.row_view(r)
            slack = self.cache.block_size if t.budget.slack == "block" else int(t.budget.slack)
            if n - t.rows_len <= slack:
                continue
            keep = head_classes_row_keep(t.policy.spec.allocation, positions, pinned, n, self.cache.num_kv_heads,
                                         head_offset=head_offset, layer_offset=self.layer_base)
            try:
                evicted = self.rows.row_evict(r, keep)
            except ValueError as e:
                if col is not None:  # the keep is the runtime's own (no policy code): ranks would part ways
                    raise RuntimeError(f"vtoken: request {r!r}: the per-row cut of its streaming rows was refused on "
                                       f"rank {col.rank} ({e}); tensor-parallel ranks cannot stay in step") from e
                self._fail(r, f"per-row eviction refused: {e}", report)
                continue
            t.rows_len = n
            if self.record_keeps:
                t.keep_log.append((n, [p[k] for p, k in zip(positions, keep, strict=True)]))
            if evicted:
                report.evicted[r] = evicted

    # ------------------------------------------------------------------ selection
    def _masks(self, rs: list[ReqId], report: StepReport) -> dict[ReqId, np.ndarray]:
        """Keep masks ``[R, n_live]`` per request of one policy: one batched call per layer chunk; if it
        raises, each request is retried alone (on the same batch: no collective runs between the two)."""
        policy = self.requests[rs[0]].policy
        assert policy is not None
        results: dict[ReqId, list[np.ndarray] | str] = {r: [] for r in rs}
        if policy.vector_reads & set(QUERY_STATS):  # incomplete query windows fail their request only
            for r, why in self._query_window_problems(policy, rs).items():
                results[r] = why
        live = [r for r in rs if not isinstance(results[r], str)]
        compiled = compile_policy(policy, device=self.cache.device)
        for chunk in self._layer_chunks(policy, live) if live else ():
            batch, ns = self.stats_batch(live, chunk)
            rows = self.cache.num_rows if chunk is None else (chunk[1] - chunk[0]) * self.cache.num_kv_heads
            part: list[np.ndarray | str]
            try:
                part = self._select(policy, compiled, batch, ns, rows)
            except Exception as e:
                reraise_runtime_fault(e)  # a broken invariant, out of memory, a device error: not the policy's
                part = []
                for i in range(len(live)):
                    try:
                        part += self._select(policy, compiled, batch.select_requests([i]), ns[i:i + 1], rows)
                    except Exception as err:
                        reraise_runtime_fault(err)
                        part.append(f"{type(err).__name__}: {err}")  # the policy's bug, on this request only
            for r, x in zip(live, part, strict=True):
                acc = results[r]
                if isinstance(acc, str):
                    continue
                if isinstance(x, str):
                    results[r] = x
                else:
                    acc.append(x)
        failed = [isinstance(results[r], str) for r in rs]
        if self.collective is not None:
            failed = self.collective.any(failed)
        out: dict[ReqId, np.ndarray] = {}
        for r, f in zip(rs, failed, strict=True):
            x = results[r]
            if not f:
                assert not isinstance(x, str)
                out[r] = x[0] if len(x) == 1 else np.concatenate(x, axis=0)
            else:
                self._fail(r, x if isinstance(x, str) else "failed on another tensor-parallel rank", report)
        return out

    def _query_window_problems(self, policy: Policy, rs: list[ReqId]) -> dict[ReqId, str]:
        """Requests whose query statistics cannot be summarised (no store, or an incomplete window)."""
        q = self.queries
        if q is None:
            return {r: f"policy {policy.name!r} reads {sorted(policy.vector_reads & set(QUERY_STATS))}, but this "
                       "adapter records no queries" for r in rs}
        return q.problems(rs, [self.cache.logical_len(r) for r in rs], policy.spec.stats.obs_window)

    def _layer_chunks(self, policy: Policy, rs: list[ReqId]) -> list[tuple[int, int] | None]:
        """Layer ranges evaluated one at a time: ``[None]`` (all layers in one batch) unless a head-granularity
        policy reads vectors whose batch would exceed ``vector_chunk_bytes``."""
        cache = self.cache
        vec = policy.vector_reads
        if not vec or policy.granularity != "head" or cache.num_rows == 1 or not rs:
            return [None]
        B, H, L = len(rs), cache.num_kv_heads, cache.num_layers
        N, D = max(cache.live_tokens(r) for r in rs), cache.head_size
        G = self.queries.group_size if self.queries is not None else 1
        per_head = {"key": N * D, "value": N * D, "query_mean": D, "query_mean_future": G * D,
                    "query_cov_future": G * D * D}
        per_layer = 4 * B * H * sum(per_head[n] for n in vec)
        step = max(1, min(L, self.vector_chunk_bytes // max(1, per_layer)))
        if step >= L:
            return [None]
        return [(a, min(L, a + step)) for a in range(0, L, step)]

    def _select(self, policy: Policy, compiled: CompiledPolicy, batch: StatsBatch, ns: list[int],
                rows: int | None = None) -> list[np.ndarray | str]:
        """Per request: its keep mask ``[rows, n]`` (default: the cache's rows), or why it is refused (a
        contract violation)."""
        mask = compiled.keep_mask(batch)  # [B, L, H, N]
        bad: list[str | None] = [None] * len(ns)
        if policy.kind == "mask" or self.cache.debug:  # score policies hold the contract by construction
            bad = compiled.contract_violations(batch, mask)
        R = self.cache.num_rows if rows is None else rows
        host = mask.detach().to("cpu", torch.bool).numpy()  # the batch's masks reach the host in one transfer
        out: list[np.ndarray | str] = []
        for b, n in enumerate(ns):
            if bad[b] is not None:
                out.append(f"policy {policy.name!r} broke the selection contract: {bad[b]}")
                continue
            m = host[b, ..., :n].reshape(-1, n)  # [L * H, n], or [1, n] for a positions-only batch
            if m.shape[0] == 1:
                m = np.broadcast_to(m, (R, n))
            elif R == 1:
                if not (m == m[:1]).all():
                    out.append(f"policy {policy.name!r} gave per-head masks to a request-granularity cache")
                    continue
                m = m[:1]
            elif m.shape[0] != R and not policy.spec.uniform:  # every head gathered: this rank's heads
                col = self.collective
                assert col is not None
                h = self.cache.num_kv_heads  # [Lc * H_total, n] -> this rank's [Lc * H_local, n]
                m = m.reshape(R // h, col.world_size * h, n)[:, col.rank * h:(col.rank + 1) * h].reshape(R, n)
            elif m.shape[0] != R:  # request-granularity rows gathered over ranks: all rows agree
                m = np.broadcast_to(m[:1], (R, n))
            out.append(m)
        return out

    def stats_batch(self, rs: Sequence[ReqId], layers: tuple[int, int] | None = None
                    ) -> tuple[StatsBatch, list[int]]:
        """The policy input for requests ``rs`` (one policy): ``(StatsBatch [B, L, H, N], live counts)``.
        ``layers = (l0, l1)``: only those layers (``layer_offset = l0``; head granularity only)."""
        cache = self.cache
        policy = self.requests[rs[0]].policy
        assert policy is not None
        L, H, R = cache.num_layers, cache.num_kv_heads, cache.num_rows
        l0, l1 = layers if layers is not None else (0, L)
        if layers is not None and R == 1:
            raise ValueError("layer chunks need a head-granularity cache")
        Lc = l1 - l0
        names = sorted(policy.stored_reads)
        kv_names = sorted(policy.vector_reads & set(KVCACHE_STATS))
        q_names = sorted(policy.vector_reads & set(QUERY_STATS))
        if kv_names or names:  # physical slots: the device reads go by them
            lv = [cache.live_slots(r) for r in rs]
            views, phys = [p for p, _ in lv], [s for _, s in lv]
        else:
            views, phys = [cache.live_view(r)[0] for r in rs], []
        if R > 1:
            views = [p[l0 * H:l1 * H] for p in views]
        ns = [int(p.shape[1]) for p in views]
        B, N = len(rs), max(ns)
        seq = [cache.logical_len(r) for r in rs]
        pos = np.zeros((B, Lc, H, N) if R > 1 else (B, 1, 1, N), dtype=np.int64)  # host: bookkeeping only
        pinned = np.zeros(pos.shape, dtype=bool)
        for b, (r, p, n) in enumerate(zip(rs, views, ns, strict=True)):
            pos[b, ..., :n] = p.reshape(pos.shape[1:-1] + (n,))
            pos[b, ..., n:] = seq[b] + np.arange(N - n)  # padding: past the request, never kept
            pins = cache.pinned_positions(r)
            if pins.size:
                pinned[b] = np.isin(pos[b], pins)
        # the statistics stay on their device: one gather per statistic for the whole batch
        stats = cache.gather_stats_batch(names, phys, N, (l0, l1)) if names else {}
        vectors: dict[str, torch.Tensor] = {}
        if kv_names:  # [B, Lc, H, N, D] from the KV cache, in the live-view order of pos
            vectors.update(cache.gather_kv_vectors(rs, kv_names, (l0, l1), N, slots=phys))
        if q_names:
            assert self.queries is not None
            vectors.update(self.queries.summaries(rs, q_names, seq, policy.spec.stats.obs_window,
                                                  policy.spec.stats.future_window, (l0, l1)))
        col = self.collective
        head_offset = 0  # the batch's heads are the layer's heads from here on (s.head, s.random)
        if col is not None and policy.granularity == "head" and policy.spec.uniform:
            head_offset = col.rank * cache.num_kv_heads  # this rank's own heads
        if col is not None and (policy.granularity == "request" or not policy.spec.uniform):  # every head, every rank
            stats = {k: col.gather_heads(v) for k, v in stats.items()}
            vectors = {k: col.gather_heads(v) for k, v in vectors.items()}
            if R > 1:  # unequal budgets select every head of a layer: its positions and pins too (as float32:
                # vLLM's CPU all-gather takes floating point only; positions < 2**24 are exact)
                pos = col.gather_heads(torch.from_numpy(pos.astype(np.float32))).numpy().astype(np.int64)
                pinned = col.gather_heads(torch.from_numpy(pinned.astype(np.float32))).numpy() > 0
        layer_offset = self.layer_base + l0  # the model's index of the batch's first layer (s.layer)
        if col is not None and policy.granularity == "request" and col.pp_size > 1:
            # pipeline stages: every stage scores every layer of the model, as one stage would
            stats = {k: col.gather_layers(v) for k, v in stats.items()}
            vectors = {k: col.gather_layers(v) for k, v in vectors.items()}
            layer_offset = 0
        budget = [self.requests[r].budget.resolve(s) for r, s in zip(rs, seq, strict=True)]  # type: ignore[union-attr]
        dev = cache.device
        batch = StatsBatch(stats={k: v.to(dev) for k, v in stats.items()}, lengths=_up(ns, dev), positions=_up(pos, dev),
                           seq_lens=_up(seq, dev), pinned=_up(pinned, dev), budget=_up(budget, dev),
                           layer_offset=layer_offset, head_offset=head_offset,
                           vectors={k: v.to(dev) for k, v in vectors.items()},
                           head_dim=cache.head_size if "head_dim" in policy.reads else None,
                           num_layers=self.model_layers or L)
        return batch, ns

    def _hand_off(self, r: ReqId, keep: np.ndarray, report: StepReport
                  ) -> tuple[int, tuple[int, list[np.ndarray]] | None]:
        """Give request ``r`` and its unequal keep mask ``[R, n]`` to the adapter's per-row pages. Returns
        ``(row-tokens evicted, (logical_len, kept positions per row) when keeps are recorded)``, or ``(-1, ...)``
        when the handoff refused the mask (the request fails and stays in the uniform cache, unchanged)."""
        assert self.handoff is not None
        kept = None
        length = self.cache.logical_len(r)  # read before the handoff: the uniform cache lets the request go
        if self.record_keeps:  # read before the handoff: the uniform cache lets the request go
            pos = self.cache.live_view(r)[0]
            kept = (self.cache.logical_len(r), [p[k] for p, k in zip(pos, keep, strict=True)])
        try:
            n = self.handoff(r, keep)
        except ValueError as e:
            self._fail(r, f"keep mask refused: {e}", report)
            return -1, kept
        self.requests[r].in_rows = True
        self.requests[r].rows_len = length
        return n, kept

    def _fail(self, r: ReqId, why: str, report: StepReport) -> None:
        self.requests[r].failures.append(why)
        report.failed[r] = why
        self.counters["policy_failures"] += 1
        log.warning("vtoken: eviction failed for request %r (%s); it falls back to no eviction", r, why)



def _up(a: Sequence[int] | np.ndarray, dev: torch.device) -> torch.Tensor:
    """Host bookkeeping (int64 / bool) to ``dev``: a host-to-device copy, never a device sync."""
    t = torch.from_numpy(np.asarray(a, dtype=np.int64) if not isinstance(a, np.ndarray) else a)
    return t if dev.type == "cpu" else t.to(dev, non_blocking=True)

