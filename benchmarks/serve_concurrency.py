"""(a) concurrency: a row per configuration from one closed-loop run (running peak, per-request peak blocks,
guaranteed concurrency), and the closed loop of vanilla vs vToken H2O 0.5 in lockstep (:func:`run_closed_loop`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .serve_config import ServeConfig, Trace, plugin_args
from .serve_engine import (
    RunResult,
    build_engine,
    free_engine,
    run_lockstep,
    run_trace,
    stats_backend,
    stats_seconds,
    warm_engine,
)
from .serve_summary import pair_order, summarize_throughput
from .serve_traces import lockstep_trace


def concurrency_row(mode: str, policy: str, ratio: float, res: RunResult, kv_blocks: int,
         stats_s: float | None) -> dict[str, Any]:
    return {"mode": mode, "policy": policy, "eviction_ratio": ratio, "max_concurrency": res.probe.max_running,
            "guaranteed_concurrency": res.guaranteed_concurrency(kv_blocks),
            "mean_peak_blocks": round(res.mean_peak_blocks, 2), "preemptions": res.probe.preemptions,
            "closed_loop_tok_s": round(res.tok_s, 2), "closed_loop_s": round(res.seconds, 1),
            "closed_loop_tok_s_cpu": round(res.output_tokens / res.cpu_seconds, 2) if res.cpu_seconds > 0 else None,
            "blocks_freed": res.blocks_freed, "stats_s": None if stats_s is None else round(stats_s, 1),
            "goodput_rps": None}


def single_row(model_dir: str, cfg: ServeConfig, trace: Trace, key: tuple[str, str, float]
                ) -> tuple[dict[str, Any], str | None]:
    """One configuration's row from one closed-loop run of ``trace`` on an engine built and freed here."""
    mode, pol, r = key
    llm = build_engine(model_dir, cfg, None if mode == "vanilla" else plugin_args(cfg, pol, r, mode),
                       max_num_seqs=len(trace))
    warm_engine(llm, trace)
    s0 = stats_seconds(llm)
    res = run_trace(llm, trace)
    s1 = stats_seconds(llm)
    backend = stats_backend(llm)
    free_engine(llm)
    return concurrency_row(mode, pol, r, res, cfg.kv_blocks or 0, None if s0 is None or s1 is None else s1 - s0), backend


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
    warm_engine(van, trace)
    pair_llm = build_engine(model_dir, cfg, plugin_args(cfg, "h2o", 0.5), max_num_seqs=n)
    warm_engine(pair_llm, trace)
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
    free_engine(pair_llm)
    free_engine(van)
    throughput = summarize_throughput(runs["vanilla"], runs["h2o"])
    throughput.update(rounds=cfg.throughput_rounds, requests=len(tp_trace), policy="h2o", eviction_ratio=0.5,
                      mode="vtoken", slack=cfg.slack)
    log(f"throughput: vToken H2O 0.5 / vanilla = {throughput['ratio']}x {throughput['ratio_spread']} {el()}")
    rows: dict[tuple[str, str, float], dict[str, Any]] = {}
    if len(tp_trace) == n:
        rows[("vanilla", "none", 0.0)] = concurrency_row("vanilla", "none", 0.0, runs["vanilla"][0], cfg.kv_blocks or 0, None)
        rows[pair] = concurrency_row(*pair, runs["h2o"][0], cfg.kv_blocks or 0,
                          None if s0 is None or s1 is None else (s1 - s0) / cfg.throughput_rounds)
        for key, name in ((("vanilla", "none", 0.0), "vanilla"), (pair, "vtoken")):
            rows[key].update(closed_loop_tok_s=throughput[f"{name}_tok_s"],
                             closed_loop_tok_s_spread=throughput[f"{name}_tok_s_spread"])
    return {"throughput": throughput, "rows": rows, "backend": backend}
