"""The soak's pure parts (``vtoken-cli bench soak``): the request mix, the aggregation of results and the
verdicts of the checks. No server, no HTTP: unit-tested in ``tests/bench/test_soak_mix.py``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

# kind -> weight (fraction of requests). Every kind appears once in the first cycle, then a smooth weighted
# round robin keeps the running counts at the weights.
MIX: dict[str, float] = {
    "evict": 0.30, "opt_out": 0.08, "own_ratio": 0.07, "own_budget": 0.07, "pinned": 0.07, "invalid": 0.12,
    "invalid_stream": 0.05, "disconnect_mid": 0.06, "disconnect_first": 0.06, "chat_n": 0.07, "context_limit": 0.05,
}
GOOD = ("evict", "opt_out", "own_ratio", "own_budget", "pinned", "chat_n", "context_limit")
INVALID = ("invalid", "invalid_stream")
DISCONNECT = ("disconnect_mid", "disconnect_first")
# kinds whose engine requests may evict (opted-out requests never do)
EVICTING = ("evict", "own_ratio", "own_budget", "pinned", "chat_n", "context_limit", *DISCONNECT)

BAD: list[tuple[dict[str, Any], str]] = [  # (vllm_xargs, what the 400's message must name)
    ({"vtoken_budget_tokens": -5}, "vtoken_budget_tokens"),
    ({"vtoken_budget_tokens": 1.5}, "vtoken_budget_tokens"),
    ({"vtoken_eviction_ratio": 1.5}, "vtoken_eviction_ratio"),
    ({"vtoken_eviction_ratio": "half"}, "vtoken_eviction_ratio"),
    ({"vtoken_pinned_spans": [10, 0]}, "vtoken_pinned_spans"),
    ({"vtoken_pinned_spans": [0, 16, 32]}, "vtoken_pinned_spans"),
    ({"vtoken_pinned_spans": [[0, 16]]}, "vtoken_pinned_spans"),
    ({"vtoken_enabled": "false"}, "vtoken_enabled"),
    ({"vtoken_enabled": 2}, "vtoken_enabled"),
    ({"vtoken_bogus": 1}, "vtoken_bogus"),
    ({"vtoken": "h2o"}, "vtoken"),
]


def kinds_sequence(n: int, mix: dict[str, float] | None = None) -> list[str]:
    """``n`` request kinds: one of each kind first (in ``mix`` order), then a smooth weighted round robin."""
    mix = mix or MIX
    if any(w <= 0 for w in mix.values()):
        raise ValueError(f"mix weights must be > 0, got {mix}")
    out = list(mix)[:n]
    total = sum(mix.values())
    credit = dict.fromkeys(mix, 0.0)
    while len(out) < n:
        for k, w in mix.items():
            credit[k] += w / total
        best = max(credit, key=lambda k: credit[k])
        credit[best] -= 1.0
        out.append(best)
    return out


@dataclass
class Spec:
    """One request to send: its kind, endpoint, body and what is expected of it."""
    index: int
    kind: str
    path: str
    body: dict[str, Any]
    stream: bool
    prompt_tokens: int  # token count of the prompt (chat: the words' rough token count)
    max_tokens: int
    n: int = 1
    expect_key: str | None = None  # invalid kinds: the key the 400 must name
    replayable: bool = False  # temperature 0, a single choice: the text must not depend on the batch


def _choose_xargs(kind: str, rng: random.Random, length: int) -> dict[str, Any] | None:
    if kind == "opt_out":
        return {"vtoken_enabled": False}
    if kind == "own_ratio":
        return {"vtoken_eviction_ratio": rng.choice([0.3, 0.7])}
    if kind == "own_budget":
        return {"vtoken_budget_tokens": rng.choice([256, 384, 512])}
    if kind == "pinned":
        return {"vtoken_pinned_spans": [0, 64, length - 32, length]}
    return None


def build_spec(index: int, kind: str, rng: random.Random, prompt: list[int], *, model: str, max_model_len: int,
               output_tokens: tuple[int, int], chat_text: str) -> Spec:
    """The request of ``kind`` over the token-id ``prompt`` (completions) or ``chat_text`` (chat)."""
    out = rng.randint(*output_tokens)
    if kind == "chat_n":
        n = rng.choice([2, 3])
        body = {"model": model, "messages": [{"role": "user", "content": chat_text}], "max_tokens": out, "n": n,
                "temperature": 0.8, "seed": index}
        return Spec(index, kind, "/v1/chat/completions", body, False, len(chat_text.split()), out, n=n)
    if kind in INVALID:
        xargs, key = BAD[index % len(BAD)]
        stream = kind == "invalid_stream"
        body = {"model": model, "prompt": prompt[:64], "max_tokens": 4, "stream": stream, "vllm_xargs": xargs}
        return Spec(index, kind, "/v1/completions", body, stream, 64, 4, expect_key=key)
    if kind == "context_limit":
        prompt = prompt[: max_model_len - out]
        body = {"model": model, "prompt": prompt, "max_tokens": max_model_len - len(prompt), "temperature": 0,
                "ignore_eos": True}
        return Spec(index, kind, "/v1/completions", body, False, len(prompt), body["max_tokens"], replayable=True)
    stream = kind in ("evict", "opt_out", *DISCONNECT) or (kind in ("own_ratio", "own_budget", "pinned")
                                                          and index % 2 == 0)
    body = {"model": model, "prompt": prompt, "max_tokens": out, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if kind in DISCONNECT:
        body["max_tokens"] = out = output_tokens[1] * 4  # long enough to still run when the client leaves
        body["ignore_eos"] = True
    xargs = _choose_xargs(kind, rng, len(prompt))
    if xargs is not None:
        body["vllm_xargs"] = xargs
    return Spec(index, kind, "/v1/completions", body, stream, len(prompt), out, replayable=kind in GOOD)


@dataclass
class Result:
    """What one request got."""
    index: int
    kind: str
    status: int  # HTTP status; 0: no response (connection error)
    ok: bool = False  # a good request completed / an invalid one got its 400 naming the key / a disconnect happened
    text: str = ""
    error: str = ""
    ttft_s: float | None = None
    tpot_s: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    max_tokens: int = 0
    n: int = 1
    replayable: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def p99(values: list[float]) -> float | None:
    """The 99th percentile (linear interpolation), None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = 0.99 * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def aggregate(results: list[Result]) -> dict[str, Any]:
    """Counts over the soak's results: per kind, completed good requests, 400s, 5xx, latency percentiles."""
    good = [r for r in results if r.kind in GOOD]
    invalid = [r for r in results if r.kind in INVALID]
    streamed = [r for r in good if r.ttft_s is not None]
    per_kind: dict[str, dict[str, int]] = {}
    for r in results:
        k = per_kind.setdefault(r.kind, {"sent": 0, "ok": 0})
        k["sent"] += 1
        k["ok"] += int(r.ok)
    return {
        "requests": len(results),
        "good": len(good),
        "completed": sum(r.ok for r in good),
        "invalid_sent": len(invalid),
        "rejected_400": sum(r.status == 400 for r in invalid),
        "rejected_400_naming_key": sum(r.ok for r in invalid),
        "disconnects": sum(r.ok for r in results if r.kind in DISCONNECT),
        "status_5xx": sum(r.status >= 500 for r in results),
        "no_response": sum(r.status == 0 and r.kind not in DISCONNECT for r in results),
        "p99_ttft_s": p99([r.ttft_s for r in streamed if r.ttft_s is not None]),
        "p99_tpot_s": p99([r.tpot_s for r in streamed if r.tpot_s is not None]),
        "per_kind": per_kind,
    }


def eviction_bounds(results: list[Result], layers: int, kv_heads: int) -> dict[str, int]:
    """Upper bounds on what the soak's requests can add to the counters: a request is trimmed at most once per
    engine step it runs (at most prompt + max_tokens steps, per choice), and evicts at most its tokens in every
    (layer, KV head) row. Opted-out and invalid requests add nothing."""
    steps = sum((r.prompt_tokens + r.max_tokens) * r.n for r in results if r.kind in EVICTING)
    return {"evictions_max": steps, "tokens_evicted_max": steps * layers * kv_heads,
            "evicting_requests": sum(r.n for r in results if r.kind in EVICTING)}


def counter_verdicts(delta: dict[str, float], bounds: dict[str, int], invalid_sent: int,
                     opt_out_delta: dict[str, float] | None) -> dict[str, bool | None]:
    """Each counter check (True / False; None: not run). ``delta``: the counters' growth over the soak phase;
    ``opt_out_delta``: their growth over a phase of opted-out requests only."""
    out: dict[str, bool | None] = {
        "evictions_positive": delta.get("vtoken_evictions_total", 0) > 0,
        "evictions_bounded": delta.get("vtoken_evictions_total", 0) <= bounds["evictions_max"],
        "tokens_evicted_bounded": delta.get("vtoken_tokens_evicted_total", 0) <= bounds["tokens_evicted_max"],
        "policy_failures_zero": delta.get("vtoken_policy_failures_total", 0) == 0,
        "rejected_equals_invalid_sent": delta.get("vtoken_rejected_requests_total", -1) == invalid_sent,
        "opt_out_phase_evicts_nothing": None,
    }
    if opt_out_delta is not None:
        out["opt_out_phase_evicts_nothing"] = (opt_out_delta.get("vtoken_evictions_total", 0) == 0
                                               and opt_out_delta.get("vtoken_tokens_evicted_total", 0) == 0)
    return out


RSS_GROWTH_MAX_PCT = 5.0


def verdicts(summary: dict[str, Any]) -> dict[str, str]:
    """PASS / FAIL / SKIP for every check of a soak summary (SKIP: the figure is missing, the check did not run)."""
    def v(ok: bool | None) -> str:
        return "SKIP" if ok is None else ("PASS" if ok else "FAIL")

    counters = summary.get("vtoken_counters_checks") or {}
    pool = summary.get("kv_blocks") or {}
    rss = summary.get("rss_growth_pct")
    replayed = summary.get("replayed", 0)
    return {
        "every_good_request_completed": v(summary["good"] > 0 and summary["completed"] == summary["good"]
                                          and summary.get("no_response", 0) == 0),
        "no_5xx": v(summary["status_5xx"] == 0),
        "invalid_rejected_400_naming_key": v(None if summary["invalid_sent"] == 0 else
                                             summary["rejected_400_naming_key"] == summary["invalid_sent"]),
        "outputs_match_alone": v(None if not replayed else summary["mismatched_outputs"] == 0),
        "kv_usage_zero_at_end": v(None if summary.get("kv_usage_end") is None else summary["kv_usage_end"] == 0),
        "block_pool_free_equals_total": v(None if not pool else
                                          pool.get("free") == pool.get("total") and pool.get("held") == 0),
        "vtoken_counters_consistent": v(None if not counters or any(x is None for x in counters.values())
                                        else all(counters.values())),
        "rss_growth_below_5pct": v(None if rss is None else rss < RSS_GROWTH_MAX_PCT),
    }
