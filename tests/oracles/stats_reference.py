"""Independent reference of the per-slot statistics (``vtoken_sdk.stats.CATALOG``, stored kind).

Shares no code with the runtime: no paging, no block tables, no slot store, no vectorised update
rules. One request at a time, token ``t`` of the request sits at true position ``t`` (no eviction):

1. :func:`dense_probs` computes the attention probabilities ``P [H_kv, T, T]`` densely (query
   position x key position), causal by true position, one softmax per (query head, query) in a
   Python loop, in float64, summed over the G query heads of each KV head (GQA).
   :func:`sum_query_heads` does the GQA sum for probabilities that come from elsewhere (HF eager).
2. :func:`reference_stats` replays the request's engine steps (each a list of consecutive query
   positions: a prefill chunk or one decode token) and applies each statistic's definition query
   by query. The rule set is a parameter (:data:`RULES`) so a change of meaning is one new entry;
   ``"catalog"`` is the meaning of ``vtoken_sdk.stats.CATALOG``, per query ``q`` of a request with
   prompt length ``plen``, in position order:
       attn_sum       += P[q]
       attn_last       = P[last query of the step]
       attn_window    += P[q] if plen - obs_window <= q < plen (the prompt's last W queries, however
                         the prompt is chunked; decode queries add nothing)
       low_attn_count  c = c * (1 - 1/history_window) + low(q) (prefill and decode alike)

   with ``low(q)[k] = [k <= q and P[q, k] < low_attn_threshold * G / (q + 1)]`` (``q + 1`` keys are
   visible to query ``q``; ``G / (q + 1)`` is the uniform attention summed over the G heads).
3. ``key_norm`` / ``value_norm`` = L2 norm of the cached (post-RoPE) key / value.

A probability within ``near_rtol`` (relative) of the low-attention threshold may fall on either
side in float32; :class:`Snapshot` carries ``low_attn_slack``, the weight such (query, key) pairs
have in the count, so a comparison can allow exactly that much difference and no more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Semantics = Literal["catalog"]
SEMANTICS: tuple[Semantics, ...] = ("catalog",)
ATTENTION_STATS = ("attn_sum", "attn_last", "attn_window", "low_attn_count")
NORM_STATS = ("key_norm", "value_norm")
_SLACK = "low_attn_slack"


@dataclass(frozen=True)
class RefParams:
    """Collector parameters (``vtoken_sdk.StatsConfig``) plus the width of the threshold band."""

    obs_window: int
    history_window: int
    low_attn_threshold: float = 1.0
    near_rtol: float = 1e-5


@dataclass
class Snapshot:
    """Reference values of one request after one step: name -> ``[L, H_kv, n]`` float64, token ``n``
    at position ``n``; ``low_attn_slack [L, H_kv, n]`` is the part of ``low_attn_count`` that comes
    from probabilities within ``near_rtol`` of the threshold (either outcome is right there)."""

    step: list[int]
    values: dict[str, torch.Tensor]
    low_attn_slack: torch.Tensor


def dense_probs(query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """``query [H_q, T, D]``, ``keys [H_kv, T, D]`` (index = true position) -> ``P [H_kv, T, T]`` float64:
    ``P[h, t, s] = sum_g softmax_{s' <= t}(scale * q[h * G + g, t] . k[h, s'])[s]``, 0 for ``s > t``."""
    Hq, T, _ = query.shape
    Hkv = keys.shape[0]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    G = Hq // Hkv
    q64, k64 = query.double(), keys.double()
    out = torch.zeros(Hkv, T, T, dtype=torch.float64)
    for hq in range(Hq):
        h = hq // G
        for t in range(T):
            logits = [scale * float(q64[hq, t] @ k64[h, s]) for s in range(t + 1)]
            m = max(logits)
            e = [math.exp(x - m) for x in logits]
            z = sum(e)
            for s in range(t + 1):
                out[h, t, s] += e[s] / z
    return out


def sum_query_heads(att: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``att [H_q, T, T]`` per query head (query head ``h_q`` uses KV head ``h_q // G``) -> ``[H_kv, T, T]``."""
    Hq, T, _ = att.shape
    G = Hq // num_kv_heads
    out = torch.zeros(num_kv_heads, T, T, dtype=torch.float64)
    for hq in range(Hq):
        out[hq // G] += att[hq].double()
    return out


def kv_norms(x: torch.Tensor) -> torch.Tensor:
    """``x [H_kv, T, D]`` -> ``[H_kv, T]`` float64 L2 norms."""
    return x.double().pow(2).sum(-1).sqrt()


# ------------------------------------------------------------------------------- rule sets
# Each rule updates one (layer, KV head) state in place: name -> [T] float64 (only [:n] is live),
# given P [T, T] (query position x key position), the step's query positions and n = cache length.

_Rule = Callable[[dict[str, torch.Tensor], torch.Tensor, list[int], int, int, RefParams, int], None]


def _low(p: torch.Tensor, q: int, G: int, prm: RefParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Low-attention indicator of query ``q`` over keys ``0..n-1`` (``p [n]``), and the near-threshold one."""
    n = p.shape[0]
    visible = torch.arange(n) <= q
    thr = prm.low_attn_threshold * G / (q + 1)
    low = visible & (p < thr)
    near = visible & ((p - thr).abs() <= prm.near_rtol * thr)
    return low.double(), near.double()


def _catalog(s: dict[str, torch.Tensor], P: torch.Tensor, step: list[int], n: int, G: int, prm: RefParams,
             prompt_len: int) -> None:
    decay = 1.0 - 1.0 / prm.history_window
    s["attn_last"][:n] = P[step[-1], :n]
    for q in step:
        p = P[q, :n]
        s["attn_sum"][:n] += p
        if prompt_len - prm.obs_window <= q < prompt_len:
            s["attn_window"][:n] += p
        low, near = _low(p, q, G, prm)
        s["low_attn_count"][:n] = s["low_attn_count"][:n] * decay + low
        s[_SLACK][:n] = s[_SLACK][:n] * decay + near


RULES: dict[str, _Rule] = {"catalog": _catalog}


def reference_stats(probs: Sequence[torch.Tensor], steps: Sequence[Sequence[int]], group_size: int,
                    params: RefParams, prompt_len: int, semantics: Semantics = "catalog",
                    keys: Sequence[torch.Tensor] | None = None,
                    values: Sequence[torch.Tensor] | None = None) -> list[Snapshot]:
    """Replay one request's steps; one :class:`Snapshot` per step.

    ``probs``: per layer ``[H_kv, T, T]`` (from :func:`dense_probs` / :func:`sum_query_heads`);
    ``steps``: query positions of each step, consecutive from 0 (every step takes the newest tokens);
    ``prompt_len``: the request's prompt length; ``keys`` / ``values``: per layer ``[H_kv, T, D]`` adds
    ``key_norm`` / ``value_norm``."""
    if semantics not in RULES:
        raise ValueError(f"unknown semantics {semantics!r}; expected one of {SEMANTICS}")
    rule = RULES[semantics]
    L = len(probs)
    H, T, _ = probs[0].shape
    expect = 0
    for st in steps:
        if not st or list(st) != list(range(expect, expect + len(st))):
            raise ValueError(f"step {list(st)} does not continue at position {expect}")
        expect += len(st)
    if expect > T:
        raise ValueError(f"steps reach position {expect - 1} but probs cover {T} tokens")
    state = [[{name: torch.zeros(T, dtype=torch.float64) for name in (*ATTENTION_STATS, _SLACK)}
              for _ in range(H)] for _ in range(L)]
    norms: dict[str, torch.Tensor] = {}
    if keys is not None:
        norms["key_norm"] = torch.stack([kv_norms(k) for k in keys])
    if values is not None:
        norms["value_norm"] = torch.stack([kv_norms(v) for v in values])
    out = []
    for st in steps:
        step = list(st)
        n = step[-1] + 1
        for layer in range(L):
            P = probs[layer].double()
            for h in range(H):
                rule(state[layer][h], P[h], step, n, group_size, params, prompt_len)
        vals = {name: torch.stack([torch.stack([state[layer][h][name][:n] for h in range(H)]) for layer in range(L)])
                for name in ATTENTION_STATS}
        vals.update({name: t[:, :, :n].clone() for name, t in norms.items()})
        slack = torch.stack([torch.stack([state[layer][h][_SLACK][:n] for h in range(H)]) for layer in range(L)])
        out.append(Snapshot(step, vals, slack))
    return out


def mismatches(got: Mapping[str, torch.Tensor], want: Snapshot, atol: float = 1e-5, rtol: float = 1e-4,
               names: Sequence[str] | None = None) -> list[str]:
    """Compare runtime values ``got`` (name -> ``[L, H_kv, n]``, token order = position order) with a
    snapshot; returns one line per statistic that differs (empty = all match).

    ``low_attn_count`` may differ by the snapshot's slack (threshold ties) and no more."""
    out = []
    for name in names or list(want.values):
        w = want.values[name]
        if name not in got:
            out.append(f"{name}: not collected")
            continue
        g = got[name].double()
        if g.shape != w.shape:
            out.append(f"{name}: shape {tuple(g.shape)} != reference {tuple(w.shape)}")
            continue
        allow = atol + rtol * w.abs()
        if name == "low_attn_count":
            allow = allow + want.low_attn_slack
        bad = (g - w).abs() > allow
        if bool(bad.any()):
            idx = [tuple(int(x) for x in i) for i in bad.nonzero()[:4]]
            detail = ", ".join(f"(layer {a}, head {b}, pos {c}): got {float(g[a, b, c]):.7g} want "
                               f"{float(w[a, b, c]):.7g}" for a, b, c in idx)
            out.append(f"{name}: {int(bad.sum())} of {bad.numel()} differ after step {want.step[0]}.."
                       f"{want.step[-1]}; {detail}")
    return out
