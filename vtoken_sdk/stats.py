"""The catalog of per-token statistics a policy may read.

A policy is a function ``score(s: TokenStats) -> Tensor`` (higher = keep). Every
attribute of :class:`TokenStats` is a float32 tensor of shape ``[B, H, N]``:
``B`` requests, ``H`` KV heads of one layer, ``N`` live tokens of each request in
ascending true position (the *logical view*, whatever the physical layout is).
The runtime evaluates all layers at once (``[B, L, H, N]``); score functions are
elementwise/token-axis/head-mean math, so they never see the difference.

The decorator records which statistics a policy reads; the runtime collects
only those (``policy.reads``). *Stored* statistics are accumulated by the runtime
from the real attention; *derived* ones are computed from positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True)
class StatInfo:
    """One statistic: what it means and how every collector computes it (one meaning everywhere).

    ``source``: ``"attention"`` (from the attention probabilities of each query, summed over the
    query heads of the token's KV head), ``"kv"`` (from the cached key/value when it is written),
    ``"position"`` (derived from true positions, never stored). ``prefill`` / ``decode``: the update
    rule for the queries of a prompt and for generated tokens; ``config``: the ``StatsConfig`` fields
    the rule reads. Collectors implementing it: the torch reference (``vtoken_runtime.stats``, used by
    the HF adapter and the vLLM plugin) and the Triton kernel (``vtoken_runtime.kernels``).
    """

    name: str
    kind: Literal["stored", "derived"]
    doc: str
    source: Literal["attention", "kv", "position"] = "attention"
    prefill: str = ""
    decode: str = ""
    config: tuple[str, ...] = ()


CATALOG: dict[str, StatInfo] = {
    s.name: s
    for s in (
        StatInfo("attn_sum", "stored",
                 "accumulated attention the token received from every query so far "
                 "(summed over the query heads of its KV head) - H2O's heavy-hitter score",
                 prefill="+= p of every prompt query", decode="+= p of every generated query"),
        StatInfo("attn_last", "stored",
                 "attention the token received from the latest query token (summed over "
                 "the query heads of its KV head) - TOVA",
                 prefill="= p of the step's last query", decode="= p of the step's last query"),
        StatInfo("attn_window", "stored",
                 "attention summed over the prompt's last `obs_window` query tokens (SnapKV's "
                 "observation window); generated tokens do not change it",
                 prefill="+= p of prompt queries at positions [prompt_len - obs_window, prompt_len) "
                         "(independent of how the prompt is chunked)",
                 decode="unchanged (tokens generated later keep 0)", config=("obs_window",)),
        StatInfo("low_attn_count", "stored",
                 "Scissorhands: how many of the last ~`history_window` queries gave the token "
                 "less than `low_attn_threshold` x the uniform attention (lower = more pivotal); "
                 "an exponential window: each query first multiplies the count by 1 - 1/history_window",
                 prefill="per query q in order: c = c * (1 - 1/hw) + [p < thr * G / n_visible(q)], "
                         "counted over keys visible to q",
                 decode="the same rule", config=("history_window", "low_attn_threshold")),
        StatInfo("key_norm", "stored", "L2 norm of the token's key (after RoPE) in this KV head",
                 source="kv", prefill="set when the key is cached", decode="set when the key is cached"),
        StatInfo("value_norm", "stored", "L2 norm of the token's value in this KV head",
                 source="kv", prefill="set when the value is cached", decode="set when the value is cached"),
        StatInfo("position", "derived", "true position of the token in the request (0-based)", source="position"),
        StatInfo("age", "derived", "seq_len - 1 - position: 0 for the newest token", source="position"),
        StatInfo("random", "derived",
                 "uniform [0, 1) from a counter hash of (seed, layer, head, position): "
                 "deterministic, independent of the batch", source="position", config=("seed",)),
    )
}

STORED_STATS: tuple[str, ...] = tuple(n for n, s in CATALOG.items() if s.kind == "stored")
DERIVED_STATS: tuple[str, ...] = tuple(n for n, s in CATALOG.items() if s.kind == "derived")
ATTENTION_STATS: tuple[str, ...] = tuple(n for n, s in CATALOG.items() if s.source == "attention")
KV_STATS: tuple[str, ...] = tuple(n for n, s in CATALOG.items() if s.source == "kv")


class StatsConfig(BaseModel):
    """Parameters of the statistics collector (they change what a stat means)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    obs_window: int = Field(default=32, ge=1, description="queries in SnapKV's observation window")
    history_window: int = Field(default=64, ge=1, description="Scissorhands' history window")
    low_attn_threshold: float = Field(default=1.0, gt=0.0,
                                      description="fraction of uniform attention counted as low")
    seed: int = Field(default=0, ge=0, description="seed of the `random` statistic")


class TokenStats:
    """Per-token statistics of a batch, ``[B, H, N]`` float32 each (see module doc).

    Attributes (see ``vtoken_sdk.stats.CATALOG`` for the full text):
    ``attn_sum``, ``attn_last``, ``attn_window``, ``low_attn_count``, ``key_norm``,
    ``value_norm``, ``position``, ``age``, ``random``.

    During decoration a tracing instance hands out symbolic expressions; at run time
    (custom mask policies, the validator) an instance holds real tensors.
    """

    __slots__ = ("_values",)

    def __init__(self, values: dict[str, object]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> object:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        if name in CATALOG:
            raise AttributeError(f"statistic {name!r} was not provided in this batch")
        raise AttributeError(name)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("TokenStats is read-only; compute a new tensor instead")

    def __dir__(self) -> list[str]:
        return sorted(CATALOG)
