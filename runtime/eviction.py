"""The eviction driver every adapter calls (HF transformers, the vLLM workers): one step, written once.

    add(req, policy, budget)   once per request: its policy and budget (the policy's, or a per-request
                               override with the policy's min_tokens / slack / when); pins live in the cache
    step(req_ids, phases)      after a forward:
      1. who      each eligible request whose budget says so: Budget.should_evict(live, seq_len, phase)
      2. batch    StatsBatch [B, L, H, N] from the cache: live positions, the policy's stored stats,
                  pins, per-request budgets (one batch per policy)
      3. select   ONE batched compiled keep_mask per policy; if it raises, each request is retried
                  alone. A request whose policy raises, or whose mask breaks the selection contract
                  (checked for mask policies, and for every policy under VTOKEN_DEBUG), or whose mask
                  the cache refuses, falls back to no eviction from then on; counted in ``failures``
      4. apply    cache.apply_keep_mask (and every follower cache: the HF adapter's shadow block sizes)
      5. reclaim  cache.reclaim(evicted requests): plan, commit, free tail blocks, async copy
      6. report   StepReport: per request evicted tokens / failure, the reclaim's figures, timings

The compiled form comes from ``vtoken_sdk.compile_policy(policy, device=cache.device)``: the Triton
kernels for CUDA caches, the torch reference elsewhere (``VTOKEN_BACKEND`` overrides).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from vtoken_sdk import Budget, CompiledPolicy, Policy, StatsBatch, compile_policy

from .cache import ReclaimStats, VTokenCache

log = logging.getLogger("vtoken.eviction")
ReqId = Hashable


@dataclass
class TrackedRequest:
    """What the driver knows of one request (set once, at :meth:`EvictionDriver.add`)."""

    policy: Policy | None
    budget: Budget | None
    failures: list[str] = field(default_factory=list)  # the first one disables eviction for the request
    keep_log: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (logical_len, kept positions [R, n])

    @property
    def evicts(self) -> bool:
        return self.policy is not None and not self.failures


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
    policy error on one rank can neither deadlock nor desynchronise the others."""

    def gather_heads(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, L, H_local, N] -> [B, L, H_total, N]`` in rank order, identical on every rank."""
        ...

    def any(self, flags: list[bool]) -> list[bool]:
        """Element-wise OR of ``flags`` over the ranks."""
        ...


COUNTERS = ("evictions", "tokens_evicted", "tokens_moved", "blocks_freed", "policy_failures")


class EvictionDriver:
    """Drives eviction for the requests of one :class:`VTokenCache`. ``followers``: bookkeeping caches that
    receive the same decisions (other block sizes); ``record_keeps``: log every request's kept positions."""

    def __init__(self, cache: VTokenCache, followers: Sequence[VTokenCache] = (), record_keeps: bool = False,
                 collective: Collective | None = None) -> None:
        self.cache = cache
        self.collective = collective
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
        t = TrackedRequest(policy, budget if budget is not None or policy is None else policy.budget)
        self.requests[req_id] = t
        return t

    def remove(self, req_id: ReqId) -> None:
        self.requests.pop(req_id, None)

    # ------------------------------------------------------------------ the step
    def step(self, req_ids: Sequence[ReqId], phases: str | Mapping[ReqId, str]) -> StepReport:
        """Evict where budgets say so (``phases``: "prefill"/"decode", one for all or per request)."""
        report = StepReport()
        cache = self.cache
        groups: dict[int, list[ReqId]] = {}
        for r in req_ids:
            t = self.requests.get(r)
            if t is None or not t.evicts:
                continue
            phase = phases if isinstance(phases, str) else phases[r]
            assert t.budget is not None and t.policy is not None
            if t.budget.should_evict(cache.live_tokens(r), cache.logical_len(r), phase):  # type: ignore[arg-type]
                groups.setdefault(id(t.policy), []).append(r)
        if not groups:
            return report
        t0 = time.perf_counter()
        masks: dict[ReqId, np.ndarray] = {}
        for rs in groups.values():
            masks.update(self._masks(rs, report))
        t1 = time.perf_counter()
        for r, keep in masks.items():
            try:
                n = cache.apply_keep_mask(r, keep)
            except ValueError as e:  # a mask the cache refuses (pins, unequal counts): this request only
                self._fail(r, f"keep mask refused: {e}", report)
                continue
            for c in self.followers:
                c.apply_keep_mask(r, keep)
            if self.record_keeps:
                self.requests[r].keep_log.append((cache.logical_len(r), cache.live_view(r)[0].copy()))
            if n:
                report.evicted[r] = n
        if report.evicted:
            report.reclaim = cache.reclaim(list(report.evicted))
            for c in self.followers:
                c.reclaim(list(report.evicted))
        report.policy_seconds, report.reclaim_seconds = t1 - t0, time.perf_counter() - t1
        c_ = self.counters
        c_["evictions"] += len(report.evicted)
        c_["tokens_evicted"] += sum(report.evicted.values())
        c_["tokens_moved"] += report.reclaim.tokens_moved
        c_["blocks_freed"] += report.reclaim.blocks_freed
        c_["policy_seconds"] += report.policy_seconds
        c_["reclaim_seconds"] += report.reclaim_seconds
        return report

    # ------------------------------------------------------------------ selection
    def _masks(self, rs: list[ReqId], report: StepReport) -> dict[ReqId, np.ndarray]:
        """Keep masks ``[R, n_live]`` per request of one policy: one batched call; if it raises, each
        request is retried alone (on the same batch: no collective runs between the two)."""
        policy = self.requests[rs[0]].policy
        assert policy is not None
        batch, ns = self.stats_batch(rs)
        compiled = compile_policy(policy, device=self.cache.device)
        results: list[np.ndarray | str]
        try:
            results = self._select(policy, compiled, batch, ns)
        except Exception:
            results = []
            for i in range(len(rs)):
                try:
                    results += self._select(policy, compiled, batch.select_requests([i]), ns[i:i + 1])
                except Exception as e:  # the policy's bug, on this request only
                    results.append(f"{type(e).__name__}: {e}")
        failed = [isinstance(x, str) for x in results]
        if self.collective is not None:
            failed = self.collective.any(failed)
        out: dict[ReqId, np.ndarray] = {}
        for r, x, f in zip(rs, results, failed, strict=True):
            if not f:
                out[r] = x  # type: ignore[assignment]
            else:
                self._fail(r, x if isinstance(x, str) else "failed on another tensor-parallel rank", report)
        return out

    def _select(self, policy: Policy, compiled: CompiledPolicy, batch: StatsBatch, ns: list[int]
                ) -> list[np.ndarray | str]:
        """Per request: its keep mask ``[R, n]``, or why it is refused (a contract violation)."""
        mask = compiled.keep_mask(batch)  # [B, L, H, N]
        bad: list[str | None] = [None] * len(ns)
        if policy.kind == "mask" or self.cache.debug:  # score policies hold the contract by construction
            bad = compiled.contract_violations(batch, mask)
        R = self.cache.num_rows
        out: list[np.ndarray | str] = []
        for b, n in enumerate(ns):
            if bad[b] is not None:
                out.append(f"policy {policy.name!r} broke the selection contract: {bad[b]}")
                continue
            m = mask[b, ..., :n].reshape(-1, n)  # [L * H, n], or [1, n] for a positions-only batch
            if m.shape[0] == 1:
                m = m.expand(R, n)
            elif R == 1:
                if not bool((m == m[:1]).all()):
                    out.append(f"policy {policy.name!r} gave per-head masks to a request-granularity cache")
                    continue
                m = m[:1]
            elif m.shape[0] != R:  # request-granularity rows gathered over ranks: all rows agree
                m = m[:1].expand(R, n)
            out.append(m.detach().cpu().numpy().astype(bool))
        return out

    def stats_batch(self, rs: Sequence[ReqId]) -> tuple[StatsBatch, list[int]]:
        """The policy input for requests ``rs`` (one policy): ``(StatsBatch [B, L, H, N], live counts)``."""
        cache = self.cache
        policy = self.requests[rs[0]].policy
        assert policy is not None
        L, H, R = cache.num_layers, cache.num_kv_heads, cache.num_rows
        names = sorted(policy.stored_reads)
        views = [cache.live_view(r)[0] for r in rs]
        ns = [int(p.shape[1]) for p in views]
        B, N = len(rs), max(ns)
        seq = [cache.logical_len(r) for r in rs]
        pos = torch.zeros((B, L, H, N) if R > 1 else (B, 1, 1, N), dtype=torch.int64)
        stats = {s: torch.zeros(B, L, H, N) for s in names}
        pinned = torch.zeros(pos.shape, dtype=torch.bool)
        for b, (r, p, n) in enumerate(zip(rs, views, ns, strict=True)):
            pos[b, ..., :n] = torch.from_numpy(p).view(pos.shape[1:-1] + (n,))
            pos[b, ..., n:] = seq[b] + torch.arange(N - n)  # padding: past the request, never kept
            pins = cache.pinned_positions(r)
            if pins.size:
                pinned[b] = torch.from_numpy(np.isin(pos[b].numpy(), pins))
            for s, t in (cache.gather_stats(r, names) if names else {}).items():
                stats[s][b, ..., :n] = t.cpu()
        if self.collective is not None and policy.granularity == "request" and names:
            stats = {k: self.collective.gather_heads(v) for k, v in stats.items()}  # every head, every rank
        budget = torch.as_tensor([self.requests[r].budget.resolve(s) for r, s in zip(rs, seq, strict=True)],  # type: ignore[union-attr]
                                 dtype=torch.int64)
        dev = cache.device
        batch = StatsBatch(stats={k: v.to(dev) for k, v in stats.items()}, lengths=torch.as_tensor(ns).to(dev),
                           positions=pos.to(dev), seq_lens=torch.as_tensor(seq).to(dev), pinned=pinned.to(dev),
                           budget=budget.to(dev))
        return batch, ns

    def _fail(self, r: ReqId, why: str, report: StepReport) -> None:
        self.requests[r].failures.append(why)
        report.failed[r] = why
        self.counters["policy_failures"] += 1
        log.warning("vtoken: eviction failed for request %r (%s); it falls back to no eviction", r, why)

