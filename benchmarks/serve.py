"""Serving benchmark of the vLLM plugin (``vtoken-cli bench serve``): SmolLM2 under a fixed KV budget.

One run measures, on a trace of essay prompts with mixed output lengths:

(a) max concurrency   all requests submitted at once (closed loop, ``max_num_seqs`` = trace size); the
                      peak number of requests running at the same step under the fixed
                      ``kv_cache_memory_bytes``; for vanilla, Naive-Evict and vToken at each eviction
                      ratio and policy
(b) SLA throughput    Poisson arrivals at increasing rates; the highest rate whose p95 latency stays
                      <= 1.05x the vanilla engine's p95 at low load (the seed paper's definition; low
                      load = the same requests one at a time)
(c) overhead          closed-loop output tokens/s with the plugin on and policy ``none`` vs vanilla
                      (interleaved repeats, best of each)

Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), one after another.
"""

from __future__ import annotations

import gc
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
       "VLLM_USE_V2_MODEL_RUNNER": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class ServeConfig:
    policies: tuple[str, ...] = ("h2o", "scissorhands")
    ratios: tuple[float, ...] = (0.3, 0.5, 0.7)
    num_requests: int = 24
    prompt_len: int = 256
    output_lens: tuple[int, ...] = (32, 64, 96)
    kv_blocks: int = 48
    block_size: int = 32
    max_model_len: int = 512
    sla_rates: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)
    sla_requests: int = 12
    sla_modes: str = "all"  # "all" rows, or "h2o0.5" (vanilla + the H2O 0.5 rows only)
    slo_factor: float = 1.05
    overhead_repeats: int = 2
    seed: int = 0
    model: str | None = None

    @classmethod
    def quick(cls) -> ServeConfig:
        return cls(policies=("h2o", "scissorhands"), num_requests=14, prompt_len=128, output_lens=(32, 64, 96),
                   kv_blocks=32, sla_rates=(0.5, 1.0, 2.0), sla_requests=4, sla_modes="h2o0.5", overhead_repeats=1)


@dataclass
class RunResult:
    max_running: int = 0
    peak_blocks: dict[str, int] = field(default_factory=dict)  # request -> most KV blocks it ever held
    preemptions: int = 0
    seconds: float = 0.0
    output_tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    blocks_freed: int = 0

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def p95(self) -> float:
        return float(np.percentile(self.latencies, 95)) if self.latencies else float("nan")


def _set_env() -> None:
    for k, v in ENV.items():
        os.environ.setdefault(k, v)


def kv_bytes(model_dir: str, blocks: int, block_size: int) -> int:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return blocks * 2 * c.num_hidden_layers * c.num_key_value_heads * hd * block_size * 4


def make_trace(model_dir: str, cfg: ServeConfig) -> list[tuple[list[int], int]]:
    """``[(prompt ids, max_tokens)]``: consecutive essay windows, output lengths cycling."""
    from transformers import AutoTokenizer

    from vtoken_bench.essays import essay_token_requests

    tok = AutoTokenizer.from_pretrained(model_dir)
    reqs = essay_token_requests(tok, [cfg.prompt_len], cfg.num_requests, offset=cfg.seed * 7919)
    return [(p, cfg.output_lens[i % len(cfg.output_lens)]) for i, p in enumerate(reqs)]


def build_engine(model_dir: str, cfg: ServeConfig, plugin: dict[str, Any] | None, max_num_seqs: int) -> Any:
    _set_env()
    from vllm import LLM

    from vtoken_runtime.vllm_plugin import vllm_engine_args

    args: dict[str, Any] = dict(model=model_dir, dtype="float32", max_model_len=cfg.max_model_len,
                                block_size=cfg.block_size, enforce_eager=True, seed=0,
                                kv_cache_memory_bytes=kv_bytes(model_dir, cfg.kv_blocks, cfg.block_size),
                                max_num_seqs=max_num_seqs, enable_prefix_caching=False,
                                max_num_batched_tokens=max(512, cfg.prompt_len))
    if plugin is not None:
        args.update(vllm_engine_args(**plugin))
    return LLM(**args)


def _sched(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def _runner(llm: Any) -> Any:
    w = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
    return getattr(w, "worker", w).model_runner


def run_trace(llm: Any, trace: list[tuple[list[int], int]], rate: float | None = None, seed: int = 0) -> RunResult:
    """Closed loop (``rate=None``: everything at t=0) or Poisson arrivals at ``rate`` req/s. Latency =
    finish - arrival (wall clock)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = llm.llm_engine
    sched = _sched(llm)
    g = np.random.default_rng(seed)
    gaps = g.exponential(1.0 / rate, size=len(trace)) if rate else np.zeros(len(trace))
    arrivals = np.cumsum(gaps) - (gaps[0] if len(gaps) else 0.0)
    res = RunResult()
    t0 = time.perf_counter()
    arrived: dict[str, float] = {}
    nxt = 0
    stats0 = dict(getattr(sched, "vtoken_stats", {}) or {})
    while nxt < len(trace) or eng.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < len(trace) and arrivals[nxt] <= now:
            p, m = trace[nxt]
            rid = f"t{nxt}"
            eng.add_request(rid, TokensPrompt(prompt_token_ids=p),
                            SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
            arrived[rid] = t0 + arrivals[nxt]
            nxt += 1
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - t0)))
            continue
        outs = eng.step()
        res.max_running = max(res.max_running, len(sched.running))
        mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]
        for req in sched.running:
            held = len(mgr.req_to_blocks.get(req.request_id, ()))
            res.peak_blocks[req.request_id] = max(res.peak_blocks.get(req.request_id, 0), held)
        t = time.perf_counter()
        for o in outs:
            if o.finished:
                res.latencies.append(t - arrived[o.request_id])
                res.output_tokens += len(o.outputs[0].token_ids)
    res.seconds = time.perf_counter() - t0
    res.preemptions = int(getattr(sched, "num_preemptions", 0) or 0)
    st = getattr(sched, "vtoken_stats", None)
    if st:
        res.blocks_freed = int(st.get("blocks_freed", 0)) - int(stats0.get("blocks_freed", 0))
    return res


def guaranteed_concurrency(res: RunResult, kv_blocks: int) -> int:
    """Requests of the trace that fit together with no preemption at any point of their lives:
    ``floor(KV blocks / mean per-request peak held blocks)`` (the footprint the scheduler must plan for)."""
    if not res.peak_blocks:
        return 0
    mean_peak = sum(res.peak_blocks.values()) / len(res.peak_blocks)
    return int(kv_blocks // mean_peak)


def _free(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def sla_throughput(llm: Any, trace: list[tuple[list[int], int]], rates: tuple[float, ...], slo: float) -> tuple[float, float]:
    """``(highest rate meeting p95 <= slo, p95 at that rate)``; 0 if even the lowest rate misses it."""
    best, best_p95 = 0.0, float("nan")
    for r in rates:
        res = run_trace(llm, trace, rate=r, seed=1)
        if res.p95 <= slo:
            best, best_p95 = r, res.p95
        else:
            break
    return best, best_p95


def run_serve_benchmark(cfg: ServeConfig, log: Any = print) -> dict[str, Any]:
    """Everything the CLI prints; the JSON schema of the issue plus details."""
    _set_env()
    from vtoken_bench.models import smollm2_path

    model_dir = cfg.model or str(smollm2_path())
    trace = make_trace(model_dir, cfg)
    sla_trace = trace[: cfg.sla_requests]
    n = len(trace)
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()

    # vanilla: concurrency, low-load p95 (the SLO reference), SLA throughput
    llm = build_engine(model_dir, cfg, None, max_num_seqs=n)
    run_trace(llm, trace[:2])  # warm-up
    van = run_trace(llm, trace)
    low = RunResult()  # low load: one request at a time
    for item in sla_trace:
        low.latencies += run_trace(llm, [item]).latencies
    slo = cfg.slo_factor * low.p95
    van_sla, van_sla_p95 = sla_throughput(llm, sla_trace, cfg.sla_rates, slo)
    _free(llm)
    log(f"vanilla: max_concurrency={van.max_running} tok/s={van.tok_s:.1f} low-load p95={low.p95:.2f}s "
        f"SLA={van_sla} rps  [{time.perf_counter() - t_start:.0f}s]")
    rows.append({"mode": "vanilla", "policy": "none", "eviction_ratio": 0.0, "max_concurrency": van.max_running,
                 "guaranteed_concurrency": guaranteed_concurrency(van, cfg.kv_blocks),
                 "mean_peak_blocks": round(sum(van.peak_blocks.values()) / max(1, len(van.peak_blocks)), 2),
                 "sla_throughput_rps": van_sla, "p95_latency_s": round(van_sla_p95, 3) if van_sla else None,
                 "closed_loop_tok_s": round(van.tok_s, 2), "blocks_freed": 0})

    for pol in cfg.policies:
        for r in cfg.ratios:
            for mode, label in (("naive", "naive"), ("compact", "vtoken")):
                llm = build_engine(model_dir, cfg, {"policy": pol, "mode": mode, "eviction_ratio": r}, max_num_seqs=n)
                res = run_trace(llm, trace)
                sla, p95 = None, None
                if cfg.sla_modes == "all" or (abs(r - 0.5) < 1e-9 and pol == "h2o"):
                    sla, p95 = sla_throughput(llm, sla_trace, cfg.sla_rates, slo)
                _free(llm)
                rows.append({"mode": label, "policy": pol, "eviction_ratio": r, "max_concurrency": res.max_running,
                             "guaranteed_concurrency": guaranteed_concurrency(res, cfg.kv_blocks),
                             "mean_peak_blocks": round(sum(res.peak_blocks.values()) / max(1, len(res.peak_blocks)), 2),
                             "sla_throughput_rps": sla,
                             "p95_latency_s": round(p95, 3) if sla else None,
                             "closed_loop_tok_s": round(res.tok_s, 2), "blocks_freed": res.blocks_freed})
                log(f"{label:7s} {pol:12s} r={r}: max_concurrency={res.max_running} tok/s={res.tok_s:.1f} "
                    f"SLA={sla} [{time.perf_counter() - t_start:.0f}s]")

    # overhead: plugin with policy none vs vanilla, interleaved, best of each
    van_best = plug_best = 0.0
    ind_ms = step_ms = None
    for _ in range(cfg.overhead_repeats):
        for plugin in (None, {"policy": "none"}):
            llm = build_engine(model_dir, cfg, plugin, max_num_seqs=n)
            run_trace(llm, trace[:2])
            if plugin is not None:
                c = _runner(llm).vtoken_counters  # a snapshot: read again after the run
                s0, p0 = c["steps"], c["prepare_seconds"]
            res = run_trace(llm, trace)
            if plugin is not None:
                c = _runner(llm).vtoken_counters
            if plugin is not None and c["steps"] > s0:
                ind_ms = round(1e3 * (c["prepare_seconds"] - p0) / (c["steps"] - s0), 4)
                step_ms = round(1e3 * res.seconds / (c["steps"] - s0), 2)
            _free(llm)
            if plugin is None:
                van_best = max(van_best, res.tok_s)
            else:
                plug_best = max(plug_best, res.tok_s)
    overhead = {"vanilla_tok_s": round(van_best, 2), "plugin_none_tok_s": round(plug_best, 2),
                "overhead_pct": round(100.0 * (1.0 - plug_best / van_best), 2) if van_best else None,
                "indirection_ms_per_step": ind_ms, "step_ms": step_ms,
                "indirection_pct_of_step": round(100.0 * ind_ms / step_ms, 3) if ind_ms and step_ms else None}
    log(f"overhead: vanilla {van_best:.1f} tok/s, plugin+none {plug_best:.1f} tok/s")
    return {"rows": rows, "overhead": overhead,
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()},
            "kv_cache_memory_bytes": kv_bytes(model_dir, cfg.kv_blocks, cfg.block_size),
            "slo_p95_s": round(slo, 3), "seconds": round(time.perf_counter() - t_start, 1)}


def concurrency_gain(result: dict[str, Any], policy: str, ratio: float) -> float | None:
    van = next((r for r in result["rows"] if r["mode"] == "vanilla"), None)
    row = next((r for r in result["rows"] if r["mode"] == "vtoken" and r["policy"] == policy
                and math.isclose(r["eviction_ratio"], ratio)), None)
    if not van or not row or not van["max_concurrency"]:
        return None
    return row["max_concurrency"] / van["max_concurrency"]
