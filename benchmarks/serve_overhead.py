"""(c) overhead and statistics cost: the statistics-free engines (vanilla, policy none, a second vanilla for
the A/A control) in lockstep, and policy none vs H2O 0.5 each running alone, interleaved over rounds
(:func:`run_interleaved`; ``--only stats-cost``: :func:`run_stats_cost_only`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .serve_config import ServeConfig, Trace, plugin_args
from .serve_engine import (
    build_engine,
    free_engine,
    model_runner_of,
    run_lockstep,
    run_trace,
    stats_backend,
    stats_seconds,
    warm_engine,
)
from .serve_summary import (
    alone_orders,
    interleaved_order,
    paired_ratio,
    rounded,
    spread,
    summarize_interleaved,
    summarize_stats_cost,
)
from .serve_traces import fitting_prefix


def stats_cost_specs(cfg: ServeConfig) -> tuple[dict[str, dict[str, Any]], tuple[str, ...]]:
    """The engines of the statistics cost (plugin args by name) and the names run alone each round: policy
    none and H2O 0.5, plus H2O with the other of slack 0 and ``"block"`` when the rows use one of them
    (:func:`slack_variant`: the same statistics every step, the policy and the compaction every step or once
    per several)."""
    specs = {"none": {"policy": "none", "eviction_ratio": 0.5, "when": cfg.when}, "h2o": plugin_args(cfg, "h2o", 0.5)}
    if slack_variant(cfg) is not None:
        specs["h2o_slack"] = {**plugin_args(cfg, "h2o", 0.5), "slack": slack_variant(cfg)}
    for pol in cfg.stats_extra:  # more policies at 0.5, each against policy none (stats_cost.extra)
        if pol not in specs:
            specs[pol] = plugin_args(cfg, pol, 0.5)
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
        s0, c0 = stats_seconds(keep[name]), model_runner_of(keep[name]).vtoken_counters
        res = run_trace(keep[name], trace)
        if name == "h2o":
            s1, c1 = stats_seconds(keep[name]), model_runner_of(keep[name]).vtoken_counters
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
    extra = [k for k in alone if k in cfg.stats_extra and k not in ("none", "h2o", "h2o_slack")]
    if extra:  # each against policy none's alone runs of the same rounds
        stats_cost["extra"] = {}
        for k in extra:
            pr, pc = paired_ratio(wall[k], wall["none_alone"]), paired_ratio(cpu[k], cpu["none_alone"])
            stats_cost["extra"][k] = {
                "eviction_ratio": 0.5, "when": plugin_args(cfg, k, 0.5)["when"], "seconds": round(statistics.median(wall[k]), 3),
                "seconds_spread": rounded(spread(wall[k]), 3), "ratio": round(pr["ratio"], 3),
                "ratio_spread": {"min": round(pr["min"], 3), "max": round(pr["max"], 3)},
                "ratio_cpu": round(pc["ratio"], 3), "ratio_cpu_spread": {"min": round(pc["min"], 3), "max": round(pc["max"], 3)}}
    if "h2o_slack" in alone:
        pr, pc = paired_ratio(wall["h2o_slack"], wall["none_alone"]), paired_ratio(cpu["h2o_slack"], cpu["none_alone"])
        stats_cost.update(slack_variant=slack_variant(cfg), h2o_slack_s=round(statistics.median(wall["h2o_slack"]), 3),
                          h2o_slack_s_spread=rounded(spread(wall["h2o_slack"]), 3), ratio_slack=round(pr["ratio"], 3),
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
        free_engine(llm)
    fresh: dict[str, Any] = {}
    for name in build:
        fresh[name] = build_engine(model_dir, cfg, specs[name], max_num_seqs=max_num_seqs)
        warm_engine(fresh[name], trace)
    return fresh


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
        free_engine(llm)
    return {**finish_stats_cost(summarize_stats_cost(wall, cpu, "none_alone"), cfg, wall, cpu, h2o_parts, alone, n_oh),
            "stats_backend": backend}


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
        c0 = model_runner_of(keep["none"]).vtoken_counters
        got = run_lockstep({k: keep[k] for k in order}, oh_trace)
        c1 = model_runner_of(keep["none"]).vtoken_counters
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
        free_engine(llm)
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
