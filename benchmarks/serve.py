"""Serving benchmark of the vLLM plugin (``vtoken-cli bench serve``): SmolLM2 under a fixed KV budget.

The trace: 16 essay prompts of 1K-1.5K tokens (varied lengths), outputs of 128-192 tokens (``--quick``: 11
requests, prompts of 1K-1.15K, outputs of 64-96); 16, so that a vToken row at 0.7 (up to 3.3x vanilla, whose
running peak is 5) is not capped by the trace. The KV budget (``kv_blocks``) is sized from the trace:
``vanilla_target + 0.5`` mean whole requests, so vanilla vLLM holds ``vanilla_target`` (4; quick 3) at once
and no engine's count sits on a rounding edge. Prefill is chunked (``chunk_tokens``, 128, one chunk per
step); vToken and Naive-Evict rows evict after every prefill chunk by default (``when="chunks"``): a long
prompt never holds more than its budget plus one chunk, and the vToken scheduler admits it on that peak
(vLLM's own check wants the whole prompt's blocks free: ``scheduler.VTokenScheduler.admission_tokens``).
``slack`` is the evicting rows' budget slack, default ``"block"``: a request evicts only when it would
otherwise hold a block more than its budget needs, so it holds exactly the blocks of slack 0 after every
step while the policy and the compaction run once per several decode steps (``Budget``).

(a) concurrency      the whole trace submitted at once (``max_num_seqs`` = trace size): the running peak
                     (most requests scheduled in one step) and the no-preemption ("guaranteed") concurrency
                     ``floor(kv_blocks / mean per-request peak blocks)``, peaks read right after
                     ``schedule()`` (so a chunk's blocks count before its eviction frees them); plus the
                     closed-loop tokens/s. Vanilla and vToken H2O 0.5 run the trace in LOCKSTEP for
                     ``throughput_rounds`` rounds (their tokens/s are compared: ``throughput``); the other
                     rows run it once (their counts do not depend on timing)
(b) goodput          DistServe's definition: the highest Poisson arrival rate at which at least
                     ``slo_attainment`` of the requests meet BOTH the TTFT and the TPOT SLO. SLOs are
                     multiples of vanilla's unloaded (one request at a time) mean TTFT and TPOT. Found by a
                     geometric ladder that brackets the goodput, then bisection (:func:`search_goodput`); a
                     rate's run stops as soon as it has missed more requests than the attainment allows.
                     Times are read on :class:`ServingClock` (default ``cpu``: this process's CPU time, idle
                     gaps skipped, so other jobs on the machine do not decide the figure)
(c) overhead         plugin with policy ``none`` vs vanilla, and ``stats_cost``: H2O vs policy ``none``
                     (same eviction ratio setting): closed-loop end-to-end time of the trace's first requests
                     that fit the KV budget together (so only the per-step work differs, not the batch),
                     run INTERLEAVED: each round runs the trace on the statistics-free engines in lockstep,
                     one engine step each in turn (:func:`run_lockstep`; the order rotating per round), each
                     engine's time summed over its own steps, and H2O / policy none alone in ABBA order;
                     reported as medians with [min, max] and ratios with the [min, max] of the per-round
                     ratios, on the wall clock and on CPU time, with an A/A control (a second vanilla engine)

TTFT = first output token seen by the step loop - scheduled arrival; TPOT = (finish - first token) /
(output tokens - 1). Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0). The closed loop of (a), (b),
(c) and (a)'s other rows are independent parts, each building its own engines, run side by side in
``workers`` processes (:func:`run_parts`): one core each, and every compared timing interleaved inside its part.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
       "VLLM_USE_V2_MODEL_RUNNER": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "VLLM_LOGGING_LEVEL": "WARNING"}

WHEN = ("prefill", "chunks")
DTYPES = {"float32": 4, "bfloat16": 2}  # dtype -> bytes per element
ONLY = ("all", "stats-cost", "goodput")  # ServeConfig.only: the whole report, (c)'s statistics cost or (b) alone
MODES = {"naive": "naive", "vtoken": "compact"}  # row label -> plugin mode
Trace = list[tuple[list[int], int]]  # [(prompt ids, max_tokens)]


@dataclass
class ServeConfig:
    policies: tuple[str, ...] = ("h2o", "scissorhands", "streaming_llm")
    ratios: tuple[float, ...] = (0.3, 0.5, 0.7)
    modes: tuple[str, ...] = ("naive", "vtoken")
    num_requests: int = 16  # > 3 x vanilla's running peak (5): the 0.7 rows' peak is not capped by the trace
    prompt_tokens: tuple[int, int] = (1024, 1536)  # inclusive range of prompt lengths
    output_tokens: tuple[int, int] = (128, 192)  # inclusive range of output lengths
    block_size: int = 32
    # the model's and KV cache's dtype: "auto" (resolve_dtype: bfloat16, the model's own dtype and what `vtoken-cli
    # serve` runs, on a CPU with AMX tiles, every engine on vLLM's amx attention, whose KV layout the statistics
    # kernel reads in place, ~2.3x the closed loop of float32; float32 elsewhere), "float32" or "bfloat16"
    dtype: str = "auto"
    chunk_tokens: int = 128  # a request's prefill chunk (long_prefill_token_threshold): peaks at budget + chunk
    # max_num_batched_tokens (None: chunk_tokens). Larger lets several requests prefill in one step, but then
    # vLLM admits more requests than the KV budget holds and preempts them later: vanilla's running peak
    # (6 with 512 on the quick trace, whose budget holds 3 whole requests) stops meaning capacity
    step_tokens: int | None = None
    kv_blocks: int | None = None  # None: (vanilla_target + 0.5) x the trace's mean whole-request footprint
    vanilla_target: float = 4.0
    # the vToken / Naive rows' budget slack: "block" (the blocks of 0, fewer evictions) or tokens (0: evict every
    # step that exceeds the budget)
    slack: int | str = "block"
    max_model_len: int | None = None  # None: longest prompt + longest output, rounded up to a block
    when: str = "chunks"
    clock: str = "cpu"  # TTFT / TPOT / arrivals of the goodput runs: "cpu" (see ServingClock) or "wall"
    # rows whose goodput is searched besides vanilla's: "all", "none", or "POLICY@RATIO[,...]" (vToken rows;
    # "naive:POLICY@RATIO" for a Naive-Evict row)
    goodput_rows: str = "h2o@0.5"
    goodput_requests: int = 12
    # max_num_seqs of the goodput engines, vanilla's included (None: the trace size, no cap). On a compute-bound
    # machine a cap keeps the prompts an evicting engine admits from stretching every running request's TPOT
    goodput_max_seqs: int | None = None
    unloaded_requests: int = 3
    ttft_slo_factor: float = 5.0
    tpot_slo_factor: float = 3.0
    slo_attainment: float = 0.9
    rate_factor: float = 2.0
    max_ladder: int = 4
    bisect_steps: int = 2
    rounds: int = 4  # interleaved rounds of (c) (6 balances the orders of interleaved_order for 3 engines)
    throughput_rounds: int = 3  # lockstep rounds of vanilla vs vToken H2O 0.5 (closed loop)
    throughput_requests: int | None = 8  # the trace's first requests those rounds run (None: the whole trace)
    workers: int = 2  # processes running the report's parts side by side (1: one after another in this process)
    rebuild: bool = True  # build the engines of (c) afresh every round (see run_serve_benchmark)
    overhead_requests: int = 1
    seed: int = 0
    model: str | None = None
    # "stats-cost": only (c)'s H2O 0.5 vs policy none runs (the same engines, trace, rounds and report fields as
    # the full benchmark's ``stats_cost``), without (a), (b) and the overhead trio: minutes, not the whole run.
    # "goodput": only (b): vanilla's SLOs and goodput, then the goodput rows' (``goodput_rows``), e.g. to see
    # how the comparison moves with the SLO multiples or the prefill chunk
    only: str = "all"

    def goodput_keys(self) -> set[tuple[str, str, float]] | None:
        """``goodput_rows`` as ``{(mode, policy, ratio)}`` (None: every row)."""
        g = self.goodput_rows.strip()
        if g == "all":
            return None
        if g in ("none", ""):
            return set()
        out = set()
        for item in g.split(","):
            mode, _, rest = item.strip().rpartition(":")
            pol, at, ratio = rest.partition("@")
            try:
                r = float(ratio)
            except ValueError:
                r = -1.0
            if not at or not pol or (mode or "vtoken") not in MODES or not 0.0 <= r < 1.0:
                raise ValueError(f"goodput_rows item {item!r}; expected POLICY@RATIO or naive:POLICY@RATIO "
                                 "(or all / none)")
            out.add((mode or "vtoken", pol, round(r, 6)))
        return out

    @classmethod
    def quick(cls) -> ServeConfig:
        return cls(policies=("h2o",), ratios=(0.5, 0.7), modes=("vtoken",), num_requests=11,
                   prompt_tokens=(1024, 1152), output_tokens=(64, 96), vanilla_target=3.0,
                   goodput_rows="h2o@0.5", goodput_requests=6, unloaded_requests=2, max_ladder=3, bisect_steps=0,
                   rounds=3, rebuild=False, overhead_requests=1, throughput_rounds=3, throughput_requests=None)

    def validate(self) -> None:
        if self.only not in ONLY:
            raise ValueError(f"only={self.only!r}; expected one of {ONLY}")
        if self.when not in WHEN:
            raise ValueError(f"when={self.when!r}; expected one of {WHEN}")
        if bad := [m for m in self.modes if m not in MODES]:
            raise ValueError(f"modes {bad}; expected some of {sorted(MODES)}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; expected auto or one of {tuple(DTYPES)}")
        if self.clock not in ("cpu", "wall"):
            raise ValueError(f"clock={self.clock!r}; expected cpu or wall")
        self.goodput_keys()  # raises on a malformed list
        if self.goodput_max_seqs is not None and self.goodput_max_seqs < 1:
            raise ValueError(f"goodput_max_seqs={self.goodput_max_seqs}; expected >= 1 (or None: no cap)")
        if self.workers < 1:
            raise ValueError(f"workers={self.workers}; expected >= 1")
        for name, (lo, hi) in (("prompt_tokens", self.prompt_tokens), ("output_tokens", self.output_tokens)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}=({lo}, {hi}); expected 1 <= min <= max")
        if not 0.0 < self.slo_attainment <= 1.0:
            raise ValueError(f"slo_attainment={self.slo_attainment}; expected (0, 1]")
        if self.rate_factor <= 1.0:
            raise ValueError(f"rate_factor={self.rate_factor}; expected > 1")
        if any(not 0.0 <= r < 1.0 for r in self.ratios):
            raise ValueError(f"ratios {self.ratios}; expected values in [0, 1)")
        if self.chunk_tokens < 1 or (self.step_tokens is not None and self.step_tokens < self.chunk_tokens):
            raise ValueError(f"chunk_tokens={self.chunk_tokens}, step_tokens={self.step_tokens}; expected "
                             "1 <= chunk_tokens <= step_tokens")
        from vtoken_sdk.budget import parse_slack

        self.slack = parse_slack(self.slack)
        if self.rounds < 1 or self.throughput_rounds < 1:
            raise ValueError(f"rounds={self.rounds}, throughput_rounds={self.throughput_rounds}; expected >= 1")


# ============================================================================ engine-free helpers (unit-tested)
def spread(xs: Sequence[float]) -> dict[str, float]:
    """``{"median", "min", "max"}`` of a non-empty sample."""
    if not xs:
        raise ValueError("spread of an empty sample")
    return {"median": float(statistics.median(xs)), "min": float(min(xs)), "max": float(max(xs))}


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    """Ratio of medians ``median(num) / median(den)`` and ``[min, max]`` of the per-round ratios
    ``num[i] / den[i]`` (rounds are paired: both ran in the same interleaved round)."""
    if len(num) != len(den) or not num:
        raise ValueError(f"paired samples of lengths {len(num)} and {len(den)}")
    per = [a / b for a, b in zip(num, den, strict=True)]
    return {"ratio": float(statistics.median(num) / statistics.median(den)), "min": min(per), "max": max(per)}


def _r(d: dict[str, float], k: int = 2) -> dict[str, float]:
    return {a: round(b, k) for a, b in d.items()}


def summarize_interleaved(wall: dict[str, list[float]], cpu: dict[str, list[float]],
                          tokens: int, stats_ref: str = "none") -> tuple[dict[str, Any], dict[str, Any]]:
    """``(overhead, stats_cost)`` from per-round seconds of the engines ``vanilla``, ``none`` and ``h2o``
    (round ``i`` of every engine ran in the same interleaved round; ``tokens`` output tokens per run), and
    of ``vanilla_b`` if present: a second vanilla engine, the A/A control (``aa_pct``: its "overhead").
    ``stats_cost`` compares ``h2o`` with ``stats_ref`` (policy none's runs measured alongside H2O's).
    Wall-clock figures are the end-to-end ones; ``_cpu`` figures use this process's CPU time, which
    another job sharing the machine does not inflate."""
    def tok_s(xs: list[float]) -> list[float]:
        return [tokens / x for x in xs]

    def pct(pr: dict[str, float]) -> tuple[float, dict[str, float]]:  # overhead % = 1 - none / vanilla tok/s
        return round(100.0 * (1.0 - pr["ratio"]), 2), {"min": round(100.0 * (1.0 - pr["max"]), 2),
                                                      "max": round(100.0 * (1.0 - pr["min"]), 2)}

    ov, ov_spread = pct(paired_ratio(tok_s(wall["none"]), tok_s(wall["vanilla"])))
    ovc, ovc_spread = pct(paired_ratio(tok_s(cpu["none"]), tok_s(cpu["vanilla"])))
    overhead = {"vanilla_tok_s": round(statistics.median(tok_s(wall["vanilla"])), 2),
                "plugin_none_tok_s": round(statistics.median(tok_s(wall["none"])), 2),
                "vanilla_tok_s_spread": _r(spread(tok_s(wall["vanilla"]))),
                "plugin_none_tok_s_spread": _r(spread(tok_s(wall["none"]))),
                "overhead_pct": ov, "overhead_pct_spread": ov_spread,
                "overhead_pct_cpu": ovc, "overhead_pct_cpu_spread": ovc_spread,
                # noise only ever adds time: the fastest run of each is the least disturbed estimate
                "overhead_pct_cpu_fastest": round(100.0 * (1.0 - min(cpu["vanilla"]) / min(cpu["none"])), 2)}
    if "vanilla_b" in wall:  # A/A control: a second vanilla engine, measured the same way
        aa, aa_spread = pct(paired_ratio(tok_s(wall["vanilla_b"]), tok_s(wall["vanilla"])))
        aac, aac_spread = pct(paired_ratio(tok_s(cpu["vanilla_b"]), tok_s(cpu["vanilla"])))
        overhead.update(aa_pct=aa, aa_pct_spread=aa_spread, aa_pct_cpu=aac, aa_pct_cpu_spread=aac_spread)
        # vanilla engines built before and after the plugin's: their per-round geometric mean cancels a
        # build-order trend (the reference the plugin engine is compared with, "bracketed")
        for key, xs in (("overhead_pct_bracketed", wall), ("overhead_pct_bracketed_cpu", cpu)):
            ref = [math.sqrt(a * b) for a, b in zip(xs["vanilla"], xs["vanilla_b"], strict=True)]
            v, sp = pct(paired_ratio(tok_s(xs["none"]), tok_s(ref)))
            overhead.update({key: v, f"{key}_spread": sp})
    return overhead, summarize_stats_cost(wall, cpu, stats_ref)


def summarize_stats_cost(wall: dict[str, list[float]], cpu: dict[str, list[float]],
                         stats_ref: str = "none") -> dict[str, Any]:
    """H2O's per-round seconds (``h2o``) against ``stats_ref``'s (policy none's runs, paired by round):
    medians, spreads and the ratio with the ``[min, max]`` of the per-round ratios, wall and CPU time."""
    nw, nc = wall[stats_ref], cpu[stats_ref]
    sr = paired_ratio(wall["h2o"], nw)
    sc = paired_ratio(cpu["h2o"], nc)
    return {"none_s": round(statistics.median(nw), 3),
            "h2o_s": round(statistics.median(wall["h2o"]), 3),
            "none_s_spread": _r(spread(nw), 3), "h2o_s_spread": _r(spread(wall["h2o"]), 3),
            "ratio": round(sr["ratio"], 3),
            "ratio_spread": {"min": round(sr["min"], 3), "max": round(sr["max"], 3)},
            "none_cpu_s": round(statistics.median(nc), 3),
            "h2o_cpu_s": round(statistics.median(cpu["h2o"]), 3),
            "ratio_cpu": round(sc["ratio"], 3),
            "ratio_cpu_spread": {"min": round(sc["min"], 3), "max": round(sc["max"], 3)},
            "ratio_cpu_fastest": round(min(cpu["h2o"]) / min(nc), 3)}


def summarize_throughput(vanilla: Sequence[RunResult], vtoken: Sequence[RunResult]) -> dict[str, Any]:
    """Closed-loop tokens/s of vanilla and vToken over paired lockstep rounds: medians with ``[min, max]``
    and the ratio ``vtoken / vanilla`` with the ``[min, max]`` of the per-round ratios (wall and CPU time)."""
    vw = [r.tok_s for r in vanilla]
    tw = [r.tok_s for r in vtoken]
    vc = [r.output_tokens / r.cpu_seconds for r in vanilla]
    tc = [r.output_tokens / r.cpu_seconds for r in vtoken]
    pr, pc = paired_ratio(tw, vw), paired_ratio(tc, vc)
    return {"vanilla_tok_s": round(statistics.median(vw), 2), "vanilla_tok_s_spread": _r(spread(vw)),
            "vtoken_tok_s": round(statistics.median(tw), 2), "vtoken_tok_s_spread": _r(spread(tw)),
            "ratio": round(pr["ratio"], 3), "ratio_spread": {"min": round(pr["min"], 3), "max": round(pr["max"], 3)},
            "ratio_cpu": round(pc["ratio"], 3),
            "ratio_cpu_spread": {"min": round(pc["min"], 3), "max": round(pc["max"], 3)}}


def interleaved_order(names: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of each round: every name once, the cycle alternating direction each round and rotating
    (A B C, B A C, B C A, A C B, C A B, C B A for three names). Run in lockstep (one
    step each in turn, cyclically) every name follows every other equally often over each pair of rounds
    for three names: a step that leaves the caches cold for its successor (H2O's statistics) cannot
    always hit the same engine, and every name takes every position."""
    n = len(names)
    out = []
    for i in range(rounds):
        base = list(names) if i % 2 == 0 else list(names)[::-1]
        j = i // 2 + (i % 2)
        out.append([base[(j + k) % n] for k in range(n)])
    return out


def pair_order(a: str, b: str, rounds: int) -> list[list[str]]:
    """A B, B A, B A, A B, A B, B A, ... (ABBA): each first equally often and a linear drift cancels."""
    return [[a, b] if i % 4 in (0, 3) else [b, a] for i in range(rounds)]


def allowed_misses(n_requests: int, attainment: float) -> int:
    """How many of ``n_requests`` may miss their SLO with the attainment still ``>= attainment``."""
    return int(math.floor((1.0 - attainment) * n_requests + 1e-9))


def meets_slo(ttft: float | None, tpot: float | None, ttft_slo: float, tpot_slo: float) -> bool:
    """A request meets the SLO when it has a first token within ``ttft_slo`` and a TPOT within
    ``tpot_slo`` (None: never produced / never finished = a miss)."""
    return ttft is not None and tpot is not None and ttft <= ttft_slo and tpot <= tpot_slo


def attainment(ttfts: Sequence[float | None], tpots: Sequence[float | None], ttft_slo: float,
               tpot_slo: float) -> float:
    """Fraction of the requests meeting BOTH SLOs (DistServe's SLO attainment)."""
    if len(ttfts) != len(tpots):
        raise ValueError("one TTFT and one TPOT per request")
    if not ttfts:
        return 0.0
    return sum(meets_slo(a, b, ttft_slo, tpot_slo) for a, b in zip(ttfts, tpots, strict=True)) / len(ttfts)


def miss_counts(ttfts: Sequence[float | None], tpots: Sequence[float | None], ttft_slo: float,
                tpot_slo: float) -> dict[str, int]:
    """What the misses of a run missed: ``ttft`` counts the requests with no first token within
    ``ttft_slo`` (None included), ``tpot`` those with a first token whose TPOT is over ``tpot_slo`` or
    that never finished. A request late on both counts in both."""
    if len(ttfts) != len(tpots):
        raise ValueError("one TTFT and one TPOT per request")
    return {"ttft": int(sum(bool(a is None or a > ttft_slo) for a in ttfts)),
            "tpot": int(sum(bool(a is not None and (b is None or b > tpot_slo))
                            for a, b in zip(ttfts, tpots, strict=True)))}


def tpot_of(first: float, finish: float, n_out: int) -> float:
    """Time per output token after the first: ``(finish - first) / (n_out - 1)`` (0 for one token)."""
    return (finish - first) / (n_out - 1) if n_out > 1 else 0.0


@dataclass
class GoodputSearch:
    goodput: float
    probes: list[tuple[float, float]]  # (rate, attainment) in the order run
    bracket: tuple[float, float | None]  # highest passing rate, lowest failing rate above it (None: unbounded)

    @property
    def saturated(self) -> bool:
        """True when the ladder never found a failing rate (the goodput is a lower bound)."""
        return self.bracket[1] is None and self.goodput > 0


def search_goodput(run: Callable[[float], float], start: float, target: float, *, factor: float = 2.0,
                   max_ladder: int = 4, bisect_steps: int = 2, min_rate: float = 0.0) -> GoodputSearch:
    """Highest rate whose ``run(rate) -> attainment`` is ``>= target``, assuming attainment falls with the
    rate. A geometric ladder from ``start`` (``x factor`` up while passing, ``/ factor`` down while
    failing, at most ``max_ladder`` steps and never below ``min_rate``) brackets it; ``bisect_steps``
    geometric bisections narrow the bracket. Returns 0 when the lowest rate probed fails."""
    if start <= 0 or factor <= 1:
        raise ValueError(f"start={start}, factor={factor}; expected start > 0, factor > 1")
    probes: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        a = float(run(rate))
        probes.append((rate, a))
        return a >= target - 1e-12

    lo: float | None = None
    hi: float | None = None
    r = start
    if ok(r):
        lo = r
        for _ in range(max_ladder):
            r *= factor
            if not ok(r):
                hi = r
                break
            lo = r
    else:
        hi = r
        for _ in range(max_ladder):
            r /= factor
            if r < min_rate:
                break
            if ok(r):
                lo = r
                break
            hi = r
    if lo is None:
        return GoodputSearch(0.0, probes, (0.0, hi))
    if hi is not None:
        for _ in range(bisect_steps):
            mid = math.sqrt(lo * hi)
            if ok(mid):
                lo = mid
            else:
                hi = mid
    return GoodputSearch(lo, probes, (lo, hi))


def poisson_arrivals(n: int, rate: float | None, seed: int = 1) -> np.ndarray:
    """Arrival times (s) of ``n`` requests, the first at 0: Poisson at ``rate`` req/s, or all at 0 for
    ``rate=None``. The same seed gives the same pattern scaled by ``1 / rate`` (rates compare alike)."""
    if not rate:
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0, size=n) / rate
    return np.cumsum(gaps) - gaps[0]


def trace_lengths(cfg: ServeConfig) -> tuple[list[int], list[int]]:
    """Prompt and output lengths of the trace: seeded uniform draws in the configured ranges."""
    g = np.random.default_rng(cfg.seed)
    p = g.integers(cfg.prompt_tokens[0], cfg.prompt_tokens[1] + 1, size=cfg.num_requests)
    o = g.integers(cfg.output_tokens[0], cfg.output_tokens[1] + 1, size=cfg.num_requests)
    return [int(x) for x in p], [int(x) for x in o]


def footprint_blocks(prompt: int, output: int, block_size: int) -> int:
    """KV blocks a request holds at its end without eviction."""
    return -(-(prompt + output) // block_size)


def default_kv_blocks(trace: Trace, block_size: int, vanilla_target: float) -> int:
    """A KV budget holding ``vanilla_target + 0.5`` mean whole requests of the trace (no eviction): vanilla
    fits ``vanilla_target`` of them, and the budget sits half a request away from the next integer, so that
    neither vanilla's count nor an evicting engine's lands on a rounding edge (with exactly
    ``vanilla_target`` requests, a policy needing 1% over half the blocks would fit one request fewer)."""
    mean = sum(footprint_blocks(len(p), m, block_size) for p, m in trace) / len(trace)
    return int(math.ceil((vanilla_target + 0.5) * mean))


def fitting_prefix(trace: Trace, block_size: int, kv_blocks: int, want: int) -> int:
    """The largest ``n <= want`` such that the first ``n`` requests fit the budget together, whole."""
    n, used = 0, 0
    for p, m in trace[:want]:
        used += footprint_blocks(len(p), m, block_size)
        if used > kv_blocks:
            break
        n += 1
    return max(1, n)


# ============================================================================ engines
def _set_env() -> None:
    for k, v in ENV.items():
        os.environ.setdefault(k, v)


def resolve_dtype(dtype: str) -> str:
    """``"auto"`` -> ``"bfloat16"`` on a CPU with AMX tiles (SmolLM2's own dtype, the one the server runs; vLLM's
    amx attention), else ``"float32"`` (bf16 without AMX runs vLLM's slower vec kernels); any other value as it is."""
    if dtype != "auto":
        return dtype
    import torch

    return "bfloat16" if torch.cpu._is_amx_tile_supported() else "float32"


def kv_bytes(model_dir: str, blocks: int, block_size: int, dtype: str = "float32") -> int:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return blocks * 2 * c.num_hidden_layers * c.num_key_value_heads * hd * block_size * DTYPES[dtype]


def make_trace(model_dir: str, cfg: ServeConfig) -> Trace:
    """``[(prompt ids, max_tokens)]``: consecutive essay windows of the drawn lengths."""
    from transformers import AutoTokenizer

    from vtoken_bench.essays import essay_token_requests

    tok = AutoTokenizer.from_pretrained(model_dir)
    plens, olens = trace_lengths(cfg)
    prompts = essay_token_requests(tok, plens, 1, offset=cfg.seed * 7919)
    return list(zip(prompts, olens, strict=True))


class ServingClock:
    """The time line of a serving run, in seconds from its start.

    ``wall``: ``time.perf_counter``; waiting for the next arrival sleeps. ``cpu``: this process's CPU time
    (the engine runs in-process on one thread), and waiting for the next arrival with nothing in flight
    jumps the clock there instead of sleeping. On a machine shared with other jobs, ``cpu`` measures the
    run as if it had its core to itself: time another process takes from it is not counted (cache and
    memory-bandwidth contention still is), and idle gaps cost no real time."""

    def __init__(self, kind: str = "wall", wall: Callable[[], float] = time.perf_counter,
                 cpu: Callable[[], float] = time.process_time) -> None:
        if kind not in ("wall", "cpu"):
            raise ValueError(f"clock {kind!r}; expected wall or cpu")
        self.kind = kind
        self._f = cpu if kind == "cpu" else wall
        self._t0 = self._f()
        self._skipped = 0.0

    def now(self) -> float:
        return self._f() - self._t0 + self._skipped

    def wait_until(self, t: float) -> None:
        d = t - self.now()
        if d <= 0:
            return
        if self.kind == "wall":
            time.sleep(d)
        else:
            self._skipped += d


@dataclass
class Probe:
    """Filled by the scheduler wrapper after every ``schedule()`` (so chunk allocations that the step's
    eviction frees again are counted)."""
    max_running: int = 0
    peak_blocks: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    steps: int = 0


def _sched(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def _runner(llm: Any) -> Any:
    w = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
    return getattr(w, "worker", w).model_runner


def _instrument(llm: Any) -> None:
    sched = _sched(llm)
    sched._bench_probe = Probe()
    orig = sched.schedule
    mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]

    def schedule(*a: Any, **kw: Any) -> Any:
        out = orig(*a, **kw)
        p: Probe = sched._bench_probe
        p.steps += 1
        p.max_running = max(p.max_running, len(sched.running))
        p.preemptions += len(getattr(out, "preempted_req_ids", None) or ())
        for req in sched.running:
            held = len(mgr.req_to_blocks.get(req.request_id, ()))
            if held > p.peak_blocks.get(req.request_id, 0):
                p.peak_blocks[req.request_id] = held
        return out

    sched.schedule = schedule


def build_engine(model_dir: str, cfg: ServeConfig, plugin: dict[str, Any] | None, max_num_seqs: int) -> Any:
    _set_env()
    from vllm import LLM

    from vtoken_runtime.vllm_plugin import vllm_engine_args

    assert cfg.kv_blocks is not None and cfg.max_model_len is not None
    args: dict[str, Any] = dict(model=model_dir, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                                block_size=cfg.block_size, enforce_eager=True, seed=0,
                                kv_cache_memory_bytes=kv_bytes(model_dir, cfg.kv_blocks, cfg.block_size, cfg.dtype),
                                max_num_seqs=max_num_seqs, enable_prefix_caching=False,
                                enable_chunked_prefill=True,
                                max_num_batched_tokens=max(cfg.step_tokens or cfg.chunk_tokens, cfg.chunk_tokens),
                                long_prefill_token_threshold=cfg.chunk_tokens)
    if plugin is not None:
        args.update(vllm_engine_args(**plugin))
    llm = LLM(**args)
    _instrument(llm)
    return llm


def _free(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


@dataclass
class RunResult:
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time: what another job on the machine cannot inflate
    output_tokens: int = 0
    ttft: list[float | None] = field(default_factory=list)  # per request in trace order (None: no token)
    tpot: list[float | None] = field(default_factory=list)  # None: not finished
    probe: Probe = field(default_factory=Probe)
    blocks_freed: int = 0
    aborted: bool = False

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_peak_blocks(self) -> float:
        pk = self.probe.peak_blocks
        return sum(pk.values()) / len(pk) if pk else 0.0

    def guaranteed_concurrency(self, kv_blocks: int) -> int:
        """Requests like these that fit together for their whole lives, with no preemption:
        ``floor(kv_blocks / mean per-request peak blocks)``."""
        m = self.mean_peak_blocks
        return int(kv_blocks // m) if m > 0 else 0


_RUN_IDS = iter(range(10**9))


def run_trace(llm: Any, trace: Trace, arrivals: np.ndarray | None = None,
              slo: tuple[float, float] | None = None, max_misses: int | None = None,
              clock: str = "wall") -> RunResult:
    """Drive ``llm.llm_engine.step()`` over ``trace``: request ``i`` is added once ``arrivals[i]`` has passed
    on ``clock`` (see :class:`ServingClock`; None: everything at t=0, a closed loop). TTFT and TPOT are
    read on the same clock. With ``slo=(ttft_s, tpot_s)`` and ``max_misses``, the run stops (aborting what
    is left) as soon as more than ``max_misses`` requests have certainly missed."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = llm.llm_engine
    sched = _sched(llm)
    sched._bench_probe = probe = Probe()
    run_id = next(_RUN_IDS)
    n = len(trace)
    arr = np.zeros(n) if arrivals is None else np.asarray(arrivals, dtype=float)
    res = RunResult(probe=probe, ttft=[None] * n, tpot=[None] * n)
    first: list[float | None] = [None] * n
    index: dict[str, int] = {}
    missed: set[int] = set()
    freed0 = int((getattr(sched, "vtoken_stats", None) or {}).get("blocks_freed", 0))
    nxt = 0
    c0 = time.process_time()
    t0 = time.perf_counter()
    clk = ServingClock(clock)
    while nxt < n or eng.has_unfinished_requests():
        now = clk.now()
        while nxt < n and arr[nxt] <= now:
            p, m = trace[nxt]
            rid = f"r{run_id}-{nxt}"
            index[rid] = nxt
            eng.add_request(rid, TokensPrompt(prompt_token_ids=p),
                            SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
            nxt += 1
        if not eng.has_unfinished_requests():
            clk.wait_until(float(arr[nxt]))
            continue
        outs = eng.step()
        t = clk.now()
        for o in outs:
            i = index.get(o.request_id)
            if i is None:
                continue
            k = len(o.outputs[0].token_ids) if o.outputs else 0
            if k and first[i] is None:
                first[i] = t
                res.ttft[i] = t - arr[i]
            if o.finished:
                res.output_tokens += k
                if first[i] is not None:
                    res.tpot[i] = tpot_of(first[i], t, k)
        if slo is not None and max_misses is not None:
            for i in range(nxt):
                if i in missed:
                    continue
                if first[i] is None:
                    late = t - arr[i] > slo[0]
                else:
                    late = res.tpot[i] is None and t - first[i] > slo[1] * max(1, trace[i][1] - 1)
                    late = late or (res.tpot[i] is not None and not meets_slo(res.ttft[i], res.tpot[i], *slo))
                if late:
                    missed.add(i)
            if len(missed) > max_misses:
                eng.abort_request([r for r, i in index.items() if res.tpot[i] is None])
                res.aborted = True
                while eng.has_unfinished_requests():  # nothing should be left; never leak into the next run
                    eng.step()
                break
    res.seconds = time.perf_counter() - t0
    res.cpu_seconds = time.process_time() - c0
    res.blocks_freed = int((getattr(sched, "vtoken_stats", None) or {}).get("blocks_freed", 0)) - freed0
    return res


def run_lockstep(llms: dict[str, Any], trace: Trace) -> dict[str, RunResult]:
    """The closed loop ``trace`` on every engine of ``llms`` at once, one ``step()`` of each in turn (in the
    dict's order): A B C A B C ... at step granularity, so a change of load on the machine hits every
    engine alike. Per engine a :class:`RunResult` whose ``seconds`` / ``cpu_seconds`` are summed over its
    own steps (its end-to-end time had it run alone), with its scheduler probe (running peak, per-request
    peak blocks) and the blocks its eviction freed."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    run_id = next(_RUN_IDS)
    res: dict[str, RunResult] = {}
    freed0: dict[str, int] = {}
    for k, llm in llms.items():
        sched = _sched(llm)
        sched._bench_probe = probe = Probe()
        res[k] = RunResult(probe=probe)
        freed0[k] = int((getattr(sched, "vtoken_stats", None) or {}).get("blocks_freed", 0))
        for i, (p, m) in enumerate(trace):
            llm.llm_engine.add_request(f"l{run_id}-{k}-{i}", TokensPrompt(prompt_token_ids=p),
                                       SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
    live = list(llms)
    while live:
        for k in list(live):
            eng = llms[k].llm_engine
            if not eng.has_unfinished_requests():
                live.remove(k)
                continue
            c0, t0 = time.process_time(), time.perf_counter()
            outs = eng.step()
            r = res[k]
            r.seconds += time.perf_counter() - t0
            r.cpu_seconds += time.process_time() - c0
            r.output_tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished and o.outputs)
    for k, llm in llms.items():
        sched = _sched(llm)
        res[k].blocks_freed = int((getattr(sched, "vtoken_stats", None) or {}).get("blocks_freed", 0)) - freed0[k]
    return res


def stats_seconds(llm: Any) -> float | None:
    """Seconds the plugin's statistics collector has spent so far (None: vanilla / no statistics)."""
    try:
        col = _runner(llm)._vt_collector
    except AttributeError:
        return None
    return None if col is None else float(col.seconds)


def stats_backend(llm: Any) -> str | None:
    try:
        col = _runner(llm)._vt_collector
    except AttributeError:
        return None
    return None if col is None else str(getattr(col, "backend", "torch"))


def _warm(llm: Any, trace: Trace) -> None:
    run_trace(llm, [(trace[0][0][:64], 2)])


def stats_cost_specs(cfg: ServeConfig) -> tuple[dict[str, dict[str, Any]], tuple[str, ...]]:
    """The engines of the statistics cost (plugin args by name) and the names run alone each round: policy
    none and H2O 0.5, plus H2O with the other of slack 0 and ``"block"`` when the rows use one of them
    (:func:`slack_variant`: the same statistics every step, the policy and the compaction every step or once
    per several)."""
    specs = {"none": {"policy": "none", "eviction_ratio": 0.5, "when": cfg.when}, "h2o": plugin_args(cfg, "h2o", 0.5)}
    if slack_variant(cfg) is not None:
        specs["h2o_slack"] = {**plugin_args(cfg, "h2o", 0.5), "slack": slack_variant(cfg)}
    return specs, tuple(specs)


def slack_variant(cfg: ServeConfig) -> int | str | None:
    """The statistics cost's second H2O: slack 0 for rows with ``"block"``, ``"block"`` for rows with 0."""
    return {"block": 0, 0: "block"}.get(cfg.slack)


H2O_PARTS = ("statistics_s", "policy_s", "reclaim_s", "evictions")  # where H2O's extra time goes (stats_cost.h2o_parts)


def alone_key(name: str) -> str:
    """Where an engine's alone runs are recorded: policy none's under ``none_alone`` (in (c) its ``none``
    entry holds its lockstep runs), every other engine under its name."""
    return "none_alone" if name == "none" else name


def run_alone(keep: dict[str, Any], order: Sequence[str], trace: Trace, wall: dict[str, list[float]],
              cpu: dict[str, list[float]], h2o_parts: dict[str, list[float]]) -> None:
    """One round of the statistics cost: each engine of ``order`` runs ``trace`` alone; its seconds are
    appended (policy none's under ``none_alone``), and for H2O where its extra time went (``h2o_parts``: the
    statistics collector, the policy, the compaction, the evictions)."""
    for name in order:
        s0, c0 = stats_seconds(keep[name]), _runner(keep[name]).vtoken_counters
        res = run_trace(keep[name], trace)
        if name == "h2o":
            s1, c1 = stats_seconds(keep[name]), _runner(keep[name]).vtoken_counters
            h2o_parts["statistics_s"].append((s1 or 0.0) - (s0 or 0.0))
            for k, c in (("policy_s", "policy_seconds"), ("reclaim_s", "reclaim_seconds"), ("evictions", "evictions")):
                h2o_parts[k].append(float(c1.get(c, 0.0) - c0.get(c, 0.0)))
        wall[alone_key(name)].append(res.seconds)
        cpu[alone_key(name)].append(res.cpu_seconds)


def finish_stats_cost(stats_cost: dict[str, Any], cfg: ServeConfig, wall: dict[str, list[float]],
                      cpu: dict[str, list[float]], h2o_parts: dict[str, list[float]], alone: Sequence[str],
                      requests: int) -> dict[str, Any]:
    """``stats_cost`` with the settings, H2O's parts (medians over the rounds) and the slack variant."""
    stats_cost.update(policy="h2o", eviction_ratio=0.5, mode="vtoken", when=cfg.when, slack=cfg.slack,
                      rounds=cfg.rounds, requests=requests)
    if h2o_parts["evictions"]:  # medians over the rounds of H2O's alone runs
        stats_cost["h2o_parts"] = {k: round(statistics.median(v), 3) for k, v in h2o_parts.items()}
    if "h2o_slack" in alone:
        pr, pc = paired_ratio(wall["h2o_slack"], wall["none_alone"]), paired_ratio(cpu["h2o_slack"], cpu["none_alone"])
        stats_cost.update(slack_variant=slack_variant(cfg), h2o_slack_s=round(statistics.median(wall["h2o_slack"]), 3),
                          h2o_slack_s_spread=_r(spread(wall["h2o_slack"]), 3), ratio_slack=round(pr["ratio"], 3),
                          ratio_slack_spread={"min": round(pr["min"], 3), "max": round(pr["max"], 3)},
                          ratio_slack_cpu=round(pc["ratio"], 3),
                          ratio_slack_cpu_spread={"min": round(pc["min"], 3), "max": round(pc["max"], 3)})
    return stats_cost


def round_engines(keep: dict[str, Any], build: Sequence[str], specs: Mapping[str, dict[str, Any] | None],
                  model_dir: str, cfg: ServeConfig, max_num_seqs: int, trace: Trace) -> dict[str, Any]:
    """The engines of an interleaved round: ``keep`` as it is, or (``cfg.rebuild``, or none built yet) the
    old ones freed and ``specs`` built afresh and warmed in the round's rotated ``build`` order."""
    if keep and not cfg.rebuild:
        return keep
    for llm in keep.values():
        _free(llm)
    fresh: dict[str, Any] = {}
    for name in build:
        fresh[name] = build_engine(model_dir, cfg, specs[name], max_num_seqs=max_num_seqs)
        _warm(fresh[name], trace)
    return fresh


def alone_orders(alone: Sequence[str], rounds: int) -> list[list[str]]:
    """ABBA for two engines, the rotating cycle of :func:`interleaved_order` for more."""
    return pair_order(*alone, rounds) if len(alone) == 2 else interleaved_order(alone, rounds)


def run_stats_cost_only(cfg: ServeConfig, model_dir: str, trace: Trace, n_oh: int, max_num_seqs: int,
                        log: Callable[[str], None], el: Callable[[], str]) -> dict[str, Any]:
    """``--only stats-cost``: (c)'s statistics cost alone (H2O 0.5 vs policy none, and the slack variant,
    each running the trace's first ``n_oh`` requests alone, the order rotating per round; engines rebuilt
    every round in a rotated order when ``cfg.rebuild``)."""
    specs, alone = stats_cost_specs(cfg)
    wall: dict[str, list[float]] = {k: [] for k in (*alone, "none_alone")}
    cpu: dict[str, list[float]] = {k: [] for k in (*alone, "none_alone")}
    h2o_parts: dict[str, list[float]] = {k: [] for k in H2O_PARTS}
    keep: dict[str, Any] = {}
    for rnd, (order, build) in enumerate(zip(alone_orders(alone, cfg.rounds), interleaved_order(alone, cfg.rounds),
                                             strict=True)):
        keep = round_engines(keep, build, specs, model_dir, cfg, max_num_seqs, trace)
        run_alone(keep, order, trace[:n_oh], wall, cpu, h2o_parts)
        log(f"round {rnd + 1}: " + ", ".join(f"{k} {wall[alone_key(k)][-1]:.2f}s (cpu {cpu[alone_key(k)][-1]:.2f}s)"
                                             for k in order) + f" {el()}")
    backend = stats_backend(keep["h2o"])
    for llm in keep.values():
        _free(llm)
    return {**finish_stats_cost(summarize_stats_cost(wall, cpu, "none_alone"), cfg, wall, cpu, h2o_parts, alone, n_oh),
            "stats_backend": backend}


def report_config(cfg: ServeConfig, trace: Trace) -> dict[str, Any]:
    """The report's ``config``: every setting (tuples as lists) and the mean prompt / output tokens of
    ``trace`` (the requests the report's figures ran)."""
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()}
    config.update(prompt_tokens_mean=round(float(np.mean([len(p) for p, _ in trace])), 1),
                  output_tokens_mean=round(float(np.mean([m for _, m in trace])), 1))
    return config


# ============================================================================ the benchmark
def unloaded(llm: Any, trace: Trace, clock: str = "wall") -> tuple[list[float], list[float]]:
    """TTFTs and TPOTs of the requests run one at a time."""
    tt: list[float] = []
    tp: list[float] = []
    for item in trace:
        r = run_trace(llm, [item], clock=clock)
        assert r.ttft[0] is not None and r.tpot[0] is not None
        tt.append(r.ttft[0])
        tp.append(r.tpot[0])
    return tt, tp


def goodput_for(llm: Any, cfg: ServeConfig, trace: Trace, unloaded_trace: Trace, slo: tuple[float, float],
                start: float, log: Callable[[str], None], label: str,
                unloaded_runs: tuple[list[float], list[float]] | None = None,
                ref: float | None = None) -> dict[str, Any]:
    """Unloaded attainment first (below the target: goodput 0, no search), then :func:`search_goodput`.
    ``unloaded_runs``: this engine's unloaded TTFTs and TPOTs if already measured; ``ref``: vanilla's
    goodput, where the ladder then starts (every rate vanilla probed lies on the row's grid too, so
    vanilla and the rows are compared at identical rates and arrival times)."""
    tt, tp = unloaded_runs or unloaded(llm, unloaded_trace, cfg.clock)
    a0 = attainment(tt, tp, *slo)
    e2e = float(np.mean(tt)) + (float(np.mean([m for _, m in trace])) - 1.0) * float(np.mean(tp))
    out: dict[str, Any] = {"unloaded_attainment": round(a0, 3), "unloaded_ttft_s": round(float(np.mean(tt)), 3),
                           "unloaded_tpot_s": round(float(np.mean(tp)), 4), "unloaded_e2e_s": round(e2e, 3),
                           "start_rps": round(start, 4), "probes": []}
    if a0 < cfg.slo_attainment:
        log(f"  {label}: misses the SLOs unloaded (attainment {a0:.2f}, TTFT {np.mean(tt):.2f}s, "
            f"TPOT {1e3 * np.mean(tp):.0f}ms): goodput 0")
        out.update(goodput_rps=0.0, bracket=[0.0, None], saturated=False)
        return out
    arrivals = poisson_arrivals(len(trace), 1.0)
    misses = allowed_misses(len(trace), cfg.slo_attainment)
    # below this rate requests rarely overlap (offered load rate x unloaded latency < 0.25): a miss there
    # is the engine's own latency, and the run would take longer than it tells
    floor = 0.25 / e2e
    out["floor_rps"] = round(floor, 4)
    if ref:  # start at vanilla's goodput: rows are probed on vanilla's grid of rates (same arrivals)
        start = ref
        out["start_rps"] = round(start, 4)

    def run(rate: float) -> float:
        r = run_trace(llm, trace, arrivals / rate, slo=slo, max_misses=misses, clock=cfg.clock)
        a = attainment(r.ttft, r.tpot, *slo)
        miss = miss_counts(r.ttft, r.tpot, *slo)
        done_tt = [x for x in r.ttft if x is not None]
        done_tp = [x for x in r.tpot if x is not None]
        out["probes"].append({"rate_rps": round(rate, 4), "attainment": round(a, 3), "aborted": r.aborted,
                              "missed_ttft": miss["ttft"], "missed_tpot": miss["tpot"],
                              "running_peak": r.probe.max_running,
                              "seconds": round(r.seconds, 1),
                              "ttft_p90_s": round(float(np.percentile(done_tt, 90)), 3) if done_tt else None,
                              "tpot_p90_s": round(float(np.percentile(done_tp, 90)), 4) if done_tp else None})
        log(f"  {label}: rate {rate:.3f} rps -> attainment {a:.2f} (missed TTFT {miss['ttft']}, TPOT "
            f"{miss['tpot']} of {len(trace)}){' (stopped early)' if r.aborted else ''} [{r.seconds:.0f}s]")
        return a

    s = search_goodput(run, start, cfg.slo_attainment, factor=cfg.rate_factor, max_ladder=cfg.max_ladder,
                       bisect_steps=cfg.bisect_steps, min_rate=floor)
    out.update(goodput_rps=round(s.goodput, 4), bracket=[round(s.bracket[0], 4),
               None if s.bracket[1] is None else round(s.bracket[1], 4)], saturated=s.saturated)
    return out


def vanilla_goodput(van: Any, cfg: ServeConfig, gp_trace: Trace, un_trace: Trace, log: Callable[[str], None],
                    el: Callable[[], str]) -> tuple[dict[str, Any], dict[str, float]]:
    """Vanilla's unloaded TTFT / TPOT, the SLOs they set, and vanilla's goodput search (its ladder starts at
    the prefill-bound capacity ``1 / unloaded TTFT``): ``(search, {ttft_slo_s, tpot_slo_s, unloaded_ttft_s,
    unloaded_tpot_s})``."""
    tt, tp = unloaded(van, un_trace, cfg.clock)
    ref_ttft, ref_tpot = float(np.mean(tt)), float(np.mean(tp))
    slo = (cfg.ttft_slo_factor * ref_ttft, cfg.tpot_slo_factor * ref_tpot)
    log(f"SLOs: TTFT {slo[0]:.2f}s ({cfg.ttft_slo_factor}x {ref_ttft:.2f}s), TPOT {1e3 * slo[1]:.0f}ms "
        f"({cfg.tpot_slo_factor}x {1e3 * ref_tpot:.1f}ms) {el()}")
    g = goodput_for(van, cfg, gp_trace, un_trace, slo, 1.0 / ref_ttft, log, "vanilla", unloaded_runs=(tt, tp))
    log(f"vanilla: goodput {g['goodput_rps']} rps {el()}")
    return g, {"ttft_slo_s": slo[0], "tpot_slo_s": slo[1], "unloaded_ttft_s": ref_ttft, "unloaded_tpot_s": ref_tpot}


def _rounded_slos(slo_cfg: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3 if "ttft" in k else 4) for k, v in slo_cfg.items()}


def goodput_on_new_engine(cfg: ServeConfig, model_dir: str, trace: Trace, key: tuple[str, str, float],
                          gp_trace: Trace, un_trace: Trace, slo: tuple[float, float], start: float,
                          van_gp: float | None, max_num_seqs: int, log: Callable[[str], None],
                          el: Callable[[], str]) -> dict[str, Any]:
    """The goodput search of row ``key = (mode, policy, ratio)`` on an engine built, searched on vanilla's grid
    of rates (``ref=van_gp``) and freed here."""
    mode, pol, r = key
    llm = build_engine(model_dir, cfg, plugin_args(cfg, pol, r, mode), max_num_seqs=max_num_seqs)
    _warm(llm, trace)
    gs = goodput_for(llm, cfg, gp_trace, un_trace, slo, start, log, f"{mode} {pol} {r}", ref=van_gp)
    log(f"{mode} {pol} {r}: goodput {gs['goodput_rps']} rps {el()}")
    _free(llm)
    return gs


def run_goodput_only(cfg: ServeConfig, model_dir: str, trace: Trace, gp_trace: Trace, un_trace: Trace,
                     log: Callable[[str], None], el: Callable[[], str]
                     ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """(b), and all of ``--only goodput``: vanilla's SLOs and goodput, then
    each goodput row's on an engine built, searched on vanilla's grid of rates and freed in turn (vanilla is
    not used after the first of them); every engine capped at ``goodput_max_seqs`` running requests. Returns
    the rows ``{mode, policy, eviction_ratio, goodput_rps, goodput_gain, goodput_search}`` (vanilla first)
    and the SLOs."""
    n = cfg.goodput_max_seqs or len(trace)
    van = build_engine(model_dir, cfg, None, max_num_seqs=n)
    _warm(van, trace)
    g, slo_cfg = vanilla_goodput(van, cfg, gp_trace, un_trace, log, el)
    slo, van_gp = (slo_cfg["ttft_slo_s"], slo_cfg["tpot_slo_s"]), g["goodput_rps"]
    rows = [{"mode": "vanilla", "policy": "none", "eviction_ratio": 0.0, "goodput_rps": van_gp, "goodput_search": g}]
    keys = cfg.goodput_keys()  # None ("all"): every configured row
    for mode, pol, r in ([(m, p, r) for p in cfg.policies for r in cfg.ratios for m in cfg.modes] if keys is None
                         else sorted(keys)):
        gs = goodput_on_new_engine(cfg, model_dir, trace, (mode, pol, r), gp_trace, un_trace, slo,
                                   1.0 / slo_cfg["unloaded_ttft_s"], van_gp, n, log, el)
        rows.append({"mode": mode, "policy": pol, "eviction_ratio": r, "goodput_rps": gs["goodput_rps"],
                     "goodput_search": gs})
    _free(van)
    for row in rows:
        row["goodput_gain"] = round(row["goodput_rps"] / van_gp, 3) if van_gp else None
    return rows, slo_cfg


def _row(mode: str, policy: str, ratio: float, res: RunResult, kv_blocks: int,
         stats_s: float | None) -> dict[str, Any]:
    return {"mode": mode, "policy": policy, "eviction_ratio": ratio, "max_concurrency": res.probe.max_running,
            "guaranteed_concurrency": res.guaranteed_concurrency(kv_blocks),
            "mean_peak_blocks": round(res.mean_peak_blocks, 2), "preemptions": res.probe.preemptions,
            "closed_loop_tok_s": round(res.tok_s, 2), "closed_loop_s": round(res.seconds, 1),
            "closed_loop_tok_s_cpu": round(res.output_tokens / res.cpu_seconds, 2) if res.cpu_seconds > 0 else None,
            "blocks_freed": res.blocks_freed, "stats_s": None if stats_s is None else round(stats_s, 1),
            "goodput_rps": None}


def plugin_args(cfg: ServeConfig, pol: str, r: float, mode: str = "vtoken") -> dict[str, Any]:
    """The plugin settings of an evicting row: policy, mode, ratio, and the config's ``when`` / ``slack``."""
    return {"policy": pol, "mode": MODES[mode], "eviction_ratio": r, "when": cfg.when, "slack": cfg.slack}


def _single_row(model_dir: str, cfg: ServeConfig, trace: Trace, key: tuple[str, str, float]
                ) -> tuple[dict[str, Any], str | None]:
    """One configuration's row from one closed-loop run of ``trace`` on an engine built and freed here."""
    mode, pol, r = key
    llm = build_engine(model_dir, cfg, None if mode == "vanilla" else plugin_args(cfg, pol, r, mode),
                       max_num_seqs=len(trace))
    _warm(llm, trace)
    s0 = stats_seconds(llm)
    res = run_trace(llm, trace)
    s1 = stats_seconds(llm)
    backend = stats_backend(llm)
    _free(llm)
    return _row(mode, pol, r, res, cfg.kv_blocks or 0, None if s0 is None or s1 is None else s1 - s0), backend


def lockstep_trace(cfg: ServeConfig, trace: Trace) -> Trace:
    """The requests the closed loop's lockstep rounds run: the trace's first ``throughput_requests`` (None: all).
    When that is the whole trace, those rounds also give vanilla's and H2O 0.5's rows."""
    return trace[: cfg.throughput_requests] if cfg.throughput_requests else trace


def run_closed_loop(cfg: ServeConfig, model_dir: str, trace: Trace, log: Callable[[str], None],
                    el: Callable[[], str]) -> dict[str, Any]:
    """(a)'s compared timing: vanilla and vToken H2O 0.5 (uncapped: ``max_num_seqs`` = the trace) run the trace's
    first ``throughput_requests`` in lockstep for ``throughput_rounds`` rounds (ABBA). Returns ``{"throughput",
    "rows", "backend"}``: when those requests are the whole trace, the first round's probes give vanilla's and
    H2O 0.5's rows (with the lockstep medians as their tokens/s); ``rows`` is empty otherwise."""
    n = len(trace)
    tp_trace = lockstep_trace(cfg, trace)
    pair = ("vtoken", "h2o", 0.5)
    van = build_engine(model_dir, cfg, None, max_num_seqs=n)
    _warm(van, trace)
    pair_llm = build_engine(model_dir, cfg, plugin_args(cfg, "h2o", 0.5), max_num_seqs=n)
    _warm(pair_llm, trace)
    runs: dict[str, list[RunResult]] = {"vanilla": [], "h2o": []}
    s0 = stats_seconds(pair_llm)
    for rnd, order in enumerate(pair_order("vanilla", "h2o", cfg.throughput_rounds)):
        got = run_lockstep({k: {"vanilla": van, "h2o": pair_llm}[k] for k in order}, tp_trace)
        for k in order:
            runs[k].append(got[k])
        log(f"closed loop, round {rnd + 1}: vanilla {got['vanilla'].tok_s:.1f} tok/s (running peak "
            f"{got['vanilla'].probe.max_running}), vToken H2O 0.5 {got['h2o'].tok_s:.1f} tok/s (running peak "
            f"{got['h2o'].probe.max_running}) {el()}")
    s1 = stats_seconds(pair_llm)
    backend = stats_backend(pair_llm)
    _free(pair_llm)
    _free(van)
    throughput = summarize_throughput(runs["vanilla"], runs["h2o"])
    throughput.update(rounds=cfg.throughput_rounds, requests=len(tp_trace), policy="h2o", eviction_ratio=0.5,
                      mode="vtoken", slack=cfg.slack)
    log(f"throughput: vToken H2O 0.5 / vanilla = {throughput['ratio']}x {throughput['ratio_spread']} {el()}")
    rows: dict[tuple[str, str, float], dict[str, Any]] = {}
    if len(tp_trace) == n:
        rows[("vanilla", "none", 0.0)] = _row("vanilla", "none", 0.0, runs["vanilla"][0], cfg.kv_blocks or 0, None)
        rows[pair] = _row(*pair, runs["h2o"][0], cfg.kv_blocks or 0,
                          None if s0 is None or s1 is None else (s1 - s0) / cfg.throughput_rounds)
        for key, name in ((("vanilla", "none", 0.0), "vanilla"), (pair, "vtoken")):
            rows[key].update(closed_loop_tok_s=throughput[f"{name}_tok_s"],
                             closed_loop_tok_s_spread=throughput[f"{name}_tok_s_spread"])
    return {"throughput": throughput, "rows": rows, "backend": backend}


def run_interleaved(cfg: ServeConfig, model_dir: str, trace: Trace, log: Callable[[str], None],
                    el: Callable[[], str]) -> dict[str, Any]:
    """(c): ``cfg.rounds`` interleaved rounds over the trace's first requests that fit the KV budget together.
    Each round runs the statistics-free engines (vanilla, policy none, a second vanilla for the A/A control) in
    lockstep, then policy none, H2O 0.5 (and H2O with a one-block slack) alone in a rotating order; the engines
    are rebuilt every round in a rotated order when ``cfg.rebuild``. Returns ``{"overhead", "stats_cost"}``."""
    n = len(trace)
    n_oh = fitting_prefix(trace, cfg.block_size, cfg.kv_blocks or 0, cfg.overhead_requests)
    oh_trace = trace[:n_oh]
    keep: dict[str, Any] = {}
    sc_specs, alone = stats_cost_specs(cfg)  # built in this order: vanilla, none, vanilla_b, h2o[, h2o_slack]
    specs: dict[str, dict[str, Any] | None] = {"vanilla": None, "none": sc_specs.pop("none"), "vanilla_b": None,
                                               **sc_specs}
    wall: dict[str, list[float]] = {k: [] for k in (*specs, "none_alone")}
    cpu: dict[str, list[float]] = {k: [] for k in (*specs, "none_alone")}
    none_steps, tokens, ind_s, ind_steps = 0, 0, 0.0, 0
    h2o_parts: dict[str, list[float]] = {k: [] for k in H2O_PARTS}
    trio = ("vanilla", "none", "vanilla_b")
    for rnd, (order, pair, build) in enumerate(zip(interleaved_order(trio, cfg.rounds),
                                                   alone_orders(alone, cfg.rounds),
                                                   interleaved_order(tuple(specs), cfg.rounds), strict=True)):
        keep = round_engines(keep, build, specs, model_dir, cfg, n, trace)
        # overhead: the three statistics-free engines in lockstep (similar steps, so none of them leaves
        # the caches colder for its successor than the others do)
        c0 = _runner(keep["none"]).vtoken_counters
        got = run_lockstep({k: keep[k] for k in order}, oh_trace)
        c1 = _runner(keep["none"]).vtoken_counters
        ind_s += c1["prepare_seconds"] - c0["prepare_seconds"]
        ind_steps += int(c1["steps"] - c0["steps"])
        for name in order:
            g = got[name]
            wall[name].append(g.seconds)
            cpu[name].append(g.cpu_seconds)
            tokens = g.output_tokens
            if name == "none":
                none_steps += g.probe.steps
        # statistics cost: policy none and H2O (and H2O with slack), each running the trace alone, the order
        # rotating over rounds
        run_alone(keep, pair, oh_trace, wall, cpu, h2o_parts)
        log(f"round {rnd + 1}: " + ", ".join(f"{k} {wall[k][-1]:.2f}s (cpu {cpu[k][-1]:.2f}s)"
                                             for k in (*order, "none_alone", *alone[1:])) + f" {el()}")
    for llm in keep.values():
        _free(llm)
    overhead, stats_cost = summarize_interleaved(wall, cpu, tokens, stats_ref="none_alone")
    ind_ms = 1e3 * ind_s / max(1, ind_steps)
    step_ms = 1e3 * sum(wall["none"]) / max(1, none_steps)
    overhead.update(indirection_ms_per_step=round(ind_ms, 4), step_ms=round(step_ms, 2),
                    indirection_pct_of_step=round(100.0 * ind_ms / step_ms, 3) if step_ms else None,
                    rounds=cfg.rounds, rebuilt_per_round=cfg.rebuild, requests=n_oh, output_tokens=tokens)
    finish_stats_cost(stats_cost, cfg, wall, cpu, h2o_parts, alone, n_oh)
    log(f"overhead {overhead['overhead_pct']}% {overhead['overhead_pct_spread']}; H2O/none "
        f"{stats_cost['ratio']}x {stats_cost['ratio_spread']} {el()}")
    return {"overhead": overhead, "stats_cost": stats_cost}


def goodput_traces(cfg: ServeConfig, trace: Trace) -> tuple[Trace, Trace]:
    """``(goodput trace, unloaded trace)``: ``goodput_requests`` requests cycling over the trace, and its first
    ``unloaded_requests`` (vanilla's unloaded TTFT / TPOT set the SLOs)."""
    n = len(trace)
    return [trace[i % n] for i in range(cfg.goodput_requests)], trace[: cfg.unloaded_requests]


# The whole report's independent parts. Each builds, uses and frees its own engines, and whatever one part
# compares runs interleaved inside it, so parts can run side by side (one process and one core each): another
# part's load then hits both sides of a comparison alike. With ``workers`` > 1 they run in that many spawned
# processes, longest first, one fresh process per part (an in-process vLLM engine cannot be freed while another
# lives, and a fresh process starts each part alike); with 1, one after another in this process.
#   closed_loop   (a) vanilla vs vToken H2O 0.5 in lockstep, and their rows       run_closed_loop
#   interleaved   (c) the overhead trio and the statistics cost                   run_interleaved
#   goodput       (b) vanilla's SLOs and goodput, then the goodput rows'          run_goodput_only
#   row           (a) one other configuration, one closed-loop run                _single_row
PARTS_ORDER = ("closed_loop", "interleaved", "goodput", "row")


def run_part(cfg: ServeConfig, model_dir: str, trace: Trace, part: str, key: tuple[str, str, float] | None,
             log: Callable[[str], None], el: Callable[[], str]) -> Any:
    """One part of the report (see :data:`PARTS_ORDER`); ``key`` = ``(mode, policy, ratio)`` of a ``row``."""
    if part == "closed_loop":
        return run_closed_loop(cfg, model_dir, trace, log, el)
    if part == "interleaved":
        return run_interleaved(cfg, model_dir, trace, log, el)
    if part == "goodput":
        return run_goodput_only(cfg, model_dir, trace, *goodput_traces(cfg, trace), log, el)
    if part == "row" and key is not None:
        row, backend = _single_row(model_dir, cfg, trace, key)
        log(f"{key[0]} {key[1]} {key[2]}: running peak {row['max_concurrency']}, guaranteed "
            f"{row['guaranteed_concurrency']}, {row['closed_loop_tok_s']:.1f} tok/s closed loop {el()}")
        return row, backend
    raise ValueError(f"part {part!r} (key {key}); expected one of {PARTS_ORDER} (a row with its key)")


def _part_job(cfg: ServeConfig, model_dir: str, part: str, key: tuple[str, str, float] | None,
              t_start: float) -> Any:
    """Worker-process entry: the trace (tokenised again: deterministic) and one part; log lines go to stderr
    prefixed with the part (``t_start`` is the parent's ``perf_counter``, a clock every process shares)."""
    import sys

    _set_env()
    label = part if key is None else f"row {key[0]} {key[1]} {key[2]}"

    def log(m: str) -> None:
        print(f"[{label}] {m}", file=sys.stderr, flush=True)

    return run_part(cfg, model_dir, make_trace(model_dir, cfg), part, key, log,
                    lambda: f"[{time.perf_counter() - t_start:.0f}s]")


def run_parts(cfg: ServeConfig, model_dir: str, trace: Trace, jobs: Sequence[tuple[str, tuple[str, str, float] | None]],
              log: Callable[[str], None], el: Callable[[], str], t_start: float) -> list[Any]:
    """The results of ``jobs`` (``(part, key)``, in that order): side by side in ``cfg.workers`` spawned processes,
    or one after another in this process when ``cfg.workers`` is 1 (see :data:`PARTS_ORDER`)."""
    if cfg.workers <= 1 or len(jobs) <= 1:
        return [run_part(cfg, model_dir, trace, part, key, log, el) for part, key in jobs]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    log(f"{len(jobs)} parts ({', '.join(sorted({p for p, _ in jobs}))}), {cfg.workers} worker processes side by "
        f"side {el()}")
    with ProcessPoolExecutor(max_workers=cfg.workers, mp_context=mp.get_context("spawn"),
                             max_tasks_per_child=1) as ex:
        futs = [ex.submit(_part_job, cfg, model_dir, part, key, t_start) for part, key in jobs]
        return [f.result() for f in futs]


def run_serve_benchmark(cfg: ServeConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Everything the CLI prints (the JSON report)."""
    cfg.validate()
    cfg.dtype = resolve_dtype(cfg.dtype)
    _set_env()
    from vtoken_bench.models import smollm2_path

    t_start, c_start = time.perf_counter(), time.process_time()
    model_dir = cfg.model or str(smollm2_path())
    trace = make_trace(model_dir, cfg)
    n = len(trace)
    if cfg.kv_blocks is None:
        cfg.kv_blocks = default_kv_blocks(trace, cfg.block_size, cfg.vanilla_target)
    if cfg.max_model_len is None:
        longest = max(len(p) + m for p, m in trace)
        cfg.max_model_len = -(-longest // cfg.block_size) * cfg.block_size
    gp_trace, un_trace = goodput_traces(cfg, trace)
    n_oh = fitting_prefix(trace, cfg.block_size, cfg.kv_blocks, cfg.overhead_requests)
    oh_trace = trace[:n_oh]
    el = lambda: f"[{time.perf_counter() - t_start:.0f}s]"  # noqa: E731
    log(f"trace: {n} requests, prompts {cfg.prompt_tokens} (mean {np.mean([len(p) for p, _ in trace]):.0f}), "
        f"outputs {cfg.output_tokens}; KV budget {cfg.kv_blocks} blocks of {cfg.block_size}; when={cfg.when}")
    if cfg.only == "goodput":
        rows, slo_cfg = run_goodput_only(cfg, model_dir, trace, gp_trace, un_trace, log, el)
        config = report_config(cfg, gp_trace)
        config.update(**_rounded_slos(slo_cfg))
        return {"goodput": rows, "config": config, "seconds": round(time.perf_counter() - t_start, 1),
                "cpu_seconds": round(time.process_time() - c_start, 1)}
    if cfg.only == "stats-cost":
        stats_cost = run_stats_cost_only(cfg, model_dir, trace, n_oh, n, log, el)
        log(f"H2O/none {stats_cost['ratio']}x {stats_cost['ratio_spread']} wall, {stats_cost['ratio_cpu']}x "
            f"{stats_cost['ratio_cpu_spread']} CPU {el()}")
        config = report_config(cfg, oh_trace)
        config.update(stats_backend=stats_cost.pop("stats_backend"))
        return {"stats_cost": stats_cost, "config": config, "seconds": round(time.perf_counter() - t_start, 1),
                "cpu_seconds": round(time.process_time() - c_start, 1)}

    # (a) the closed loop (vanilla vs vToken H2O 0.5 in lockstep; their rows too when it runs the whole trace),
    # (b) goodput, (c) overhead and statistics cost, and (a)'s other rows (one closed-loop run each: their
    # counts do not depend on timing): independent parts, side by side in ``workers`` processes
    pair = ("vtoken", "h2o", 0.5)
    has_pair = "vtoken" in cfg.modes and "h2o" in cfg.policies and any(math.isclose(r, 0.5) for r in cfg.ratios)
    whole = has_pair and len(lockstep_trace(cfg, trace)) == n  # the closed loop gives vanilla's and H2O 0.5's rows
    todo = [k for k in [("vanilla", "none", 0.0)] + [(m, p, r) for p in cfg.policies for r in cfg.ratios
                                                      for m in cfg.modes]
            if not (whole and k in (("vanilla", "none", 0.0), pair))]
    jobs: list[tuple[str, tuple[str, str, float] | None]] = [
        *((("closed_loop", None),) if has_pair else ()), ("interleaved", None), ("goodput", None),
        *(("row", k) for k in todo)]
    got = dict(zip(jobs, run_parts(cfg, model_dir, trace, jobs, log, el, t_start), strict=True))
    throughput: dict[str, Any] | None = None
    backend = None
    rows_by: dict[tuple[str, str, float], dict[str, Any]] = {}
    if has_pair:
        cl = got[("closed_loop", None)]
        throughput, backend = cl["throughput"], cl["backend"]
        rows_by.update(cl["rows"])
    for key in todo:
        rows_by[key], bk = got[("row", key)]
        backend = backend or bk
    gp_rows, slo_cfg = got[("goodput", None)]
    goodput_done = {(r["mode"], r["policy"], r["eviction_ratio"]): r["goodput_search"] for r in gp_rows}
    van_gp: float | None = goodput_done[("vanilla", "none", 0.0)]["goodput_rps"]
    overhead, stats_cost = got[("interleaved", None)]["overhead"], got[("interleaved", None)]["stats_cost"]
    rows = [rows_by[("vanilla", "none", 0.0)]] + [rows_by[(m, p, r)] for p in cfg.policies for r in cfg.ratios
                                                  for m in cfg.modes]
    for row in rows:
        row["closed_loop_measure"] = ("lockstep median" if "closed_loop_tok_s_spread" in row
                                      else f"single run{', worker process' if cfg.workers > 1 else ''}")
        key = (row["mode"], row["policy"], row["eviction_ratio"])
        if key in goodput_done:
            row.update(goodput_rps=goodput_done[key]["goodput_rps"], goodput_search=goodput_done[key])

    van_row = rows[0]
    for row in rows:
        row["concurrency_gain"] = (round(row["max_concurrency"] / van_row["max_concurrency"], 3)
                                   if van_row["max_concurrency"] else None)
        row["guaranteed_gain"] = (round(row["guaranteed_concurrency"] / van_row["guaranteed_concurrency"], 3)
                                  if van_row["guaranteed_concurrency"] else None)
        row["goodput_gain"] = (round(row["goodput_rps"] / van_gp, 3) if van_gp and row["goodput_rps"] is not None
                               else None)
    config = report_config(cfg, trace)
    config.update(**_rounded_slos(slo_cfg), stats_backend=backend,
                  stats_backend_env=os.environ.get("VTOKEN_STATS_BACKEND"), kv_cache_memory_bytes=kv_bytes(model_dir, cfg.kv_blocks, cfg.block_size, cfg.dtype))
    return {"rows": rows, "throughput": throughput, "overhead": overhead, "stats_cost": stats_cost, "config": config,
            "kv_cache_memory_bytes": config["kv_cache_memory_bytes"],
            "seconds": round(time.perf_counter() - t_start, 1),
            "cpu_seconds": round(time.process_time() - c_start, 1)}


def find_row(result: dict[str, Any], mode: str, policy: str, ratio: float) -> dict[str, Any] | None:
    return next((r for r in result["rows"] if r["mode"] == mode and r["policy"] == policy
                 and math.isclose(r["eviction_ratio"], ratio)), None)


def concurrency_gain(result: dict[str, Any], policy: str, ratio: float) -> float | None:
    van = find_row(result, "vanilla", "none", 0.0)
    row = find_row(result, "vtoken", policy, ratio)
    if not van or not row or not van["max_concurrency"]:
        return None
    return row["max_concurrency"] / van["max_concurrency"]
