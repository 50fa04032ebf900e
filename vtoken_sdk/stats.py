"""The catalog of statistics a policy may read.

A policy is a function ``score(s: TokenStats) -> Tensor`` (higher = keep). Most
attributes of :class:`TokenStats` are *token-scalars*: float32 ``[B, H, N]``, ``B``
requests, ``H`` KV heads of one layer, ``N`` live tokens of each request in ascending
true position (the *logical view*, whatever the physical layout is). The runtime
evaluates all layers at once (``[B, L, H, N]``); score functions never see the difference.

Kinds (``StatInfo.kind``): *stored* statistics are accumulated per slot by the runtime from
the real attention; *derived* ones are computed from positions / shapes; *vector* ones
(``key``, ``value``, query summaries) are not stored per slot: the runtime gathers them
from the KV cache through the token table, or summarises the recent queries, only when
a policy reads them, and hands them over in ``StatsBatch.vectors``. Their shapes
(``StatInfo.axes``, besides ``B, H``): ``N`` tokens, ``D`` head dimension, ``G`` query
heads per KV head (GQA group, query head ``h * G + g`` of KV head ``h``), ``E`` a second
``D`` (matrices).

The decorator records which statistics a policy reads; the runtime collects
only those (``policy.reads``, ``policy.stored_reads``, ``policy.vector_reads``).
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
    ``"position"`` (derived from true positions, never stored), ``"index"`` (derived from the
    layer / head index or the head dimension), ``"kvcache"`` (vectors read from the KV cache through
    the token table at eviction time), ``"query"`` (summaries of the request's recent queries, kept
    by the runtime per layer). ``prefill`` / ``decode``: the update rule for the queries of a prompt
    and for generated tokens; ``config``: the ``StatsConfig`` fields the rule reads; ``axes``: the
    axes besides ``[B, H]`` (``StatsBatch`` layout: ``[B, L, H, *axes]``). Collectors implementing
    it: the torch reference (``vtoken_runtime.stats``, used by the HF adapter and the vLLM plugin)
    and the Triton kernel (``vtoken_runtime.kernels``).
    """

    name: str
    kind: Literal["stored", "derived", "vector"]
    doc: str
    source: Literal["attention", "kv", "position", "index", "kvcache", "query"] = "attention"
    prefill: str = ""
    decode: str = ""
    config: tuple[str, ...] = ()
    axes: tuple[str, ...] = ("N",)

    @property
    def shape(self) -> str:
        """The shape a score function sees, e.g. ``[B, H, N, D]`` (``E`` prints as ``D``)."""
        dims = ["B", "H", *("D" if a == "E" else a for a in self.axes)]
        return "[" + ", ".join(dims if self.axes else [*dims, "1"]) + "]"


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
        StatInfo("layer", "derived",
                 "index of the layer (StatsBatch.layer_offset + row layer), float32, one value per head "
                 "[B, H, 1] broadcast over the tokens", source="index", axes=()),
        StatInfo("num_layers", "derived",
                 "number of layers of the model (StatsBatch.num_layers, supplied by the runtime), float32 "
                 "[B, H, 1]: write depth rules as fractions of it, e.g. s.layer >= s.num_layers // 2",
                 source="index", axes=()),
        StatInfo("head", "derived",
                 "index of the KV head within its layer (0..H-1 over the model's KV heads, also under tensor "
                 "parallelism: StatsBatch.head_offset + row head), float32 [B, H, 1]", source="index", axes=()),
        StatInfo("head_dim", "derived",
                 "D, the size of the key / value / query vectors, float32 [B, H, 1] (for 1/sqrt(D) scalings)",
                 source="index", axes=()),
        StatInfo("key", "vector",
                 "the token's key in this KV head exactly as cached, i.e. after RoPE at its true position "
                 "(the vector attention reads), float32 [B, H, N, D]",
                 source="kvcache", prefill="read from the KV cache at eviction time (not stored per slot)",
                 decode="read from the KV cache at eviction time (not stored per slot)", axes=("N", "D")),
        StatInfo("value", "vector",
                 "the token's value in this KV head exactly as cached, float32 [B, H, N, D]",
                 source="kvcache", prefill="read from the KV cache at eviction time (not stored per slot)",
                 decode="read from the KV cache at eviction time (not stored per slot)", axes=("N", "D")),
        StatInfo("query_mean", "vector",
                 "mean of the post-RoPE query vectors of the last W = min(obs_window, seq_len) query tokens "
                 "the request has processed (positions [seq_len - W, seq_len), prompt or generated), pooled "
                 "over the G query heads of the KV head: (1 / (G W)) sum_g sum_q q_rope[h*G + g, q], "
                 "float32 [B, H, D] (broadcast over the tokens)",
                 source="query", prefill="summary of the window at eviction time",
                 decode="summary of the window at eviction time", config=("obs_window",), axes=("D",)),
        StatInfo("query_mean_future", "vector",
                 "ExpectedAttention's query mean per query head: Rbar @ mu_g, where mu_g = (1/W) sum_q "
                 "q_pre[h*G + g, q] is the mean of the pre-RoPE queries of query head h*G + g over the same "
                 "W = min(obs_window, seq_len) latest query tokens, and Rbar = (1/F) sum_{p=seq_len}^{seq_len+F-1} "
                 "R(p) the average RoPE rotation of the next F = future_window positions (R(p) the D x D matrix "
                 "with rope(q, p) = R(p) @ q, as the model's rotary embedding computes it), float32 [B, H, G, D]",
                 source="query", prefill="summary of the window at eviction time",
                 decode="summary of the window at eviction time", config=("obs_window", "future_window"),
                 axes=("G", "D")),
        StatInfo("query_cov_future", "vector",
                 "ExpectedAttention's query covariance per query head: Rbar @ S_g @ Rbar^T, where S_g = (1/W) "
                 "sum_q (q_pre - mu_g)(q_pre - mu_g)^T is the population covariance of the pre-RoPE queries of "
                 "query head h*G + g over the W latest query tokens (mu_g, Rbar as in query_mean_future), "
                 "float32 [B, H, G, D, D] (row index D, column index E)",
                 source="query", prefill="summary of the window at eviction time",
                 decode="summary of the window at eviction time", config=("obs_window", "future_window"),
                 axes=("G", "D", "E")),
    )
}

STORED_STATS: tuple[str, ...] = tuple(n for n, s in CATALOG.items() if s.kind == "stored")
DERIVED_STATS: tuple[str, ...] = tuple(n for n, s in CATALOG.items() if s.kind == "derived")
VECTOR_STATS: tuple[str, ...] = tuple(n for n, s in CATALOG.items() if s.kind == "vector")
KVCACHE_STATS: tuple[str, ...] = tuple(n for n, s in CATALOG.items() if s.source == "kvcache")
QUERY_STATS: tuple[str, ...] = tuple(n for n, s in CATALOG.items() if s.source == "query")
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
    future_window: int = Field(default=512, ge=1,
                               description="future positions averaged into query_*_future (ExpectedAttention)")


class TokenStats:
    """Statistics of a batch (see module doc): token-scalars ``[B, H, N]`` float32, head-scalars
    ``[B, H, 1]``, vectors with the shapes of ``CATALOG[name].shape``.

    Attributes (see ``vtoken_sdk.stats.CATALOG`` for the full text):
    ``attn_sum``, ``attn_last``, ``attn_window``, ``low_attn_count``, ``key_norm``,
    ``value_norm``, ``position``, ``age``, ``random``, ``layer``, ``num_layers``, ``head``, ``head_dim``,
    ``key``, ``value``, ``query_mean``, ``query_mean_future``, ``query_cov_future``.

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
