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
                     geometric ladder that brackets the goodput, then bisection (:func:`serve_slo.search_goodput`); a
                     rate's run stops as soon as it has missed more requests than the attainment allows.
                     Times are read on :class:`serve_engine.ServingClock` (default ``cpu``: this process's CPU time, idle
                     gaps skipped, so other jobs on the machine do not decide the figure)
(c) overhead         plugin with policy ``none`` vs vanilla, and ``stats_cost``: H2O vs policy ``none``
                     (same eviction ratio setting): closed-loop end-to-end time of the trace's first requests
                     that fit the KV budget together (so only the per-step work differs, not the batch),
                     run INTERLEAVED: each round runs the trace on the statistics-free engines in lockstep,
                     one engine step each in turn (:func:`serve_engine.run_lockstep`; the order rotating per round), each
                     engine's time summed over its own steps, and H2O / policy none alone in ABBA order;
                     reported as medians with [min, max] and ratios with the [min, max] of the per-round
                     ratios, on the wall clock and on CPU time, with an A/A control (a second vanilla engine)

TTFT = first output token seen by the step loop - scheduled arrival; TPOT = (finish - first token) /
(output tokens - 1). Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0). The closed loop of (a), (b),
(c) and (a)'s other rows are independent parts, each building its own engines, run side by side in
``workers`` processes (:func:`serve_parts.run_parts`): one core each, and every compared timing interleaved inside its part.

Modules, one stage each: ``serve_config`` (settings), ``serve_traces`` (trace, KV budget), ``serve_engine``
(engines, probes, the step loops), ``serve_slo`` (SLOs, goodput search), ``serve_summary`` (paired-round
statistics), ``serve_concurrency`` (a), ``serve_goodput`` (b), ``serve_overhead`` (c), ``serve_parts`` (the
parts side by side); this module runs them and assembles the report (:func:`run_serve_benchmark`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .serve_config import ServeConfig, Trace, resolve_dtype, row_keys, row_when, set_env
from .serve_engine import kv_bytes
from .serve_goodput import rounded_slos, run_goodput_only
from .serve_overhead import run_stats_cost_only
from .serve_parts import run_parts
from .serve_traces import default_kv_blocks, fitting_prefix, goodput_traces, lockstep_trace, make_trace


def report_config(cfg: ServeConfig, trace: Trace) -> dict[str, Any]:
    """The report's ``config``: every setting (tuples as lists) and the mean prompt / output tokens of
    ``trace`` (the requests the report's figures ran)."""
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()}
    config.update(prompt_tokens_mean=round(float(np.mean([len(p) for p, _ in trace])), 1),
                  output_tokens_mean=round(float(np.mean([m for _, m in trace])), 1))
    return config


def run_serve_benchmark(cfg: ServeConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Everything the CLI prints (the JSON report)."""
    cfg.validate()
    cfg.dtype = resolve_dtype(cfg.dtype)
    set_env()
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
        config.update(**rounded_slos(slo_cfg))
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
    todo = [k for k in [("vanilla", "none", 0.0), *row_keys(cfg)] if not (whole and k in (("vanilla", "none", 0.0), pair))]
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
    goodput_done = {(r["mode"], r["policy"], r["eviction_ratio"]): r for r in gp_rows}
    overhead, stats_cost = got[("interleaved", None)]["overhead"], got[("interleaved", None)]["stats_cost"]
    rows = [rows_by[("vanilla", "none", 0.0)]] + [rows_by[k] for k in row_keys(cfg)]
    for row in rows:
        row["when"] = row_when(cfg, row["policy"]) if row["mode"] != "vanilla" else None
        row["closed_loop_measure"] = ("lockstep median" if "closed_loop_tok_s_spread" in row
                                      else f"single run{', worker process' if cfg.workers > 1 else ''}")
        key = (row["mode"], row["policy"], row["eviction_ratio"])
        if key in goodput_done:  # its gain: over the vanilla search it ran in turn with
            row.update({k: goodput_done[key][k] for k in ("goodput_rps", "goodput_gain", "goodput_search")})

    van_row = rows[0]
    for row in rows:
        row["concurrency_gain"] = (round(row["max_concurrency"] / van_row["max_concurrency"], 3)
                                   if van_row["max_concurrency"] else None)
        row["guaranteed_gain"] = (round(row["guaranteed_concurrency"] / van_row["guaranteed_concurrency"], 3)
                                  if van_row["guaranteed_concurrency"] else None)
        row.setdefault("goodput_gain", None)
    config = report_config(cfg, trace)
    config.update(**rounded_slos(slo_cfg), stats_backend=backend,
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
