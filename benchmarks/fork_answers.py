"""One context, many eviction configurations: kvpress's query-agnostic protocol on :class:`HFSession`.

The context is prefilled once with no eviction (request ``base``); each configuration is a fork of it with
its own policy and budget, evicted once (phase ``prefill``), then the question is fed to every fork in one
batch and the answers are decoded greedily together::

    base: prefill(context) ──fork──> c0 (policy, budget) ─ evict ─┐
                          ├─fork──> c1 ...                  ─ evict ─┼─ forward(question) ─ greedy decode
                          └─fork──> ck ...                  ─ evict ─┘

Forks run in groups of ``group`` (the KV blocks of one group at a time, besides ``base``). Used by
``eval ruler`` (:mod:`.ruler_eval`) and ``eval niah`` (:mod:`.niah_heatmap`); a fork's answer equals that of
its configuration run alone (``tests/bench/test_fork_answers.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Fork:
    """One configuration: ``policy`` None keeps the full cache; ``budget`` tokens (None: the policy's)."""

    label: Hashable
    policy: Any | None
    budget: int | None = None


def answer_forks(model: Any, context: Sequence[int], question: Sequence[int], forks: Sequence[Fork],
                 max_new_tokens: int, *, eos_ids: Sequence[int] = (), group: int = 8,
                 chunk_size: int | None = None, block_size: int = 16,
                 done: Callable[[dict[Hashable, list[int]]], bool] | None = None) -> dict[Hashable, list[int]]:
    """Greedy answer token ids of every fork, ``{label: ids}``.

    A fork stops at its first token in ``eos_ids`` (kept in its ids) or after ``max_new_tokens``; ``done``
    (the ids so far of the group's forks) stops the whole group early. ``chunk_size``: prefill chunk of the
    context (None: one chunk). A policy that fails at run time (the session falls back to no eviction for
    that request) raises RuntimeError naming the fork: an answer without the eviction asked for is no answer.
    """
    from vtoken_runtime.hf_adapter import HFSession

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens {max_new_tokens}; expected >= 1")
    labels = [f.label for f in forks]
    if len(set(labels)) != len(labels):
        raise ValueError(f"fork labels must be distinct, got {labels}")
    n, q = len(context), len(question)
    group = max(1, min(group, len(forks)))
    distinct = list({id(f.policy): f.policy for f in forks if f.policy is not None}.values())
    per_req = -(-(n + q + max_new_tokens) // block_size) + 1
    s = HFSession(model, block_size=block_size, num_blocks=per_req * (group + 1) + 8, granularity="head",
                  max_requests=group + 2, chunk_size=max(chunk_size or n, 1), policies=distinct)
    stop = {int(t) for t in eos_ids}
    out: dict[Hashable, list[int]] = {}
    try:
        s.add("base", None)
        s.prefill(["base"], [list(context)], evict=False)
        for g in range(0, len(forks), group):
            chunk = forks[g: g + group]
            ids = [f"c{g + i}" for i in range(len(chunk))]
            for rid, f in zip(ids, chunk, strict=True):
                s.fork("base", rid, f.policy, f.budget)
            s.evict(ids, "prefill")
            failed = {f.label: s.requests[rid].failures for rid, f in zip(ids, chunk, strict=True)
                      if s.requests[rid].failures}
            if failed:
                raise RuntimeError(f"the policy failed at run time (fell back to no eviction): {failed}")
            logits = s.forward(ids, [list(question)] * len(ids))
            gen: dict[str, list[int]] = {rid: [] for rid in ids}
            active = list(ids)
            for step in range(max_new_tokens):
                nxt = [int(t) for t in logits.argmax(-1).tolist()]
                for rid, t in zip(active, nxt, strict=True):
                    gen[rid].append(t)
                still = [(rid, t) for rid, t in zip(active, nxt, strict=True) if t not in stop]
                if step == max_new_tokens - 1 or not still:
                    break
                if done is not None and done({f.label: gen[rid] for rid, f in zip(ids, chunk, strict=True)}):
                    break
                active = [rid for rid, _ in still]
                logits = s.decode(active, [t for _, t in still], evict=False)
            for rid, f in zip(ids, chunk, strict=True):
                out[f.label] = gen[rid]
                s.free(rid)
    finally:
        s.cache.close()
    return out
