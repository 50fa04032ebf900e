"""(b) goodput: vanilla's unloaded TTFT / TPOT set the SLOs, then each row's goodput is searched on an engine of
its own, on vanilla's grid of rates (:func:`run_goodput_only`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .serve_config import ServeConfig, Trace, plugin_args
from .serve_engine import build_engine, free_engine, run_trace, warm_engine
from .serve_slo import allowed_misses, attainment, miss_counts, poisson_arrivals, search_goodput


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


def rounded_slos(slo_cfg: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3 if "ttft" in k else 4) for k, v in slo_cfg.items()}


def goodput_on_new_engine(cfg: ServeConfig, model_dir: str, trace: Trace, key: tuple[str, str, float],
                          gp_trace: Trace, un_trace: Trace, slo: tuple[float, float], start: float,
                          van_gp: float | None, max_num_seqs: int, log: Callable[[str], None],
                          el: Callable[[], str]) -> dict[str, Any]:
    """The goodput search of row ``key = (mode, policy, ratio)`` on an engine built, searched on vanilla's grid
    of rates (``ref=van_gp``) and freed here."""
    mode, pol, r = key
    llm = build_engine(model_dir, cfg, plugin_args(cfg, pol, r, mode), max_num_seqs=max_num_seqs)
    warm_engine(llm, trace)
    gs = goodput_for(llm, cfg, gp_trace, un_trace, slo, start, log, f"{mode} {pol} {r}", ref=van_gp)
    log(f"{mode} {pol} {r}: goodput {gs['goodput_rps']} rps {el()}")
    free_engine(llm)
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
    warm_engine(van, trace)
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
    free_engine(van)
    for row in rows:
        row["goodput_gain"] = round(row["goodput_rps"] / van_gp, 3) if van_gp else None
    return rows, slo_cfg
