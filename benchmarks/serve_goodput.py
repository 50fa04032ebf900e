"""(b) goodput: vanilla's unloaded TTFT / TPOT set the SLOs, then each row's goodput is searched together with
vanilla's, the two engines probing in turn at each rate (:func:`run_goodput_only`).

    vanilla engine ---- built once, kept ----------------------------------------------
    row engine     ---- built, paired search with vanilla, confirmation, freed; the next row ...

    paired search (serve_slo.search_goodput_paired): rate r0: V R, r1: R V, r2: V R ...  (same arrivals)
    confirmation: both engines again at both goodput rates, ``confirm_rounds`` rotated rounds, with every
                  engine step recorded: the attainment's spread at each goodput, and where the decoding
                  requests' time goes at each of those rates (tpot_parts_by_rate, serve_steps)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .serve_config import ServeConfig, Trace, plugin_args, row_keys
from .serve_engine import build_engine, free_engine, run_trace, warm_engine
from .serve_slo import allowed_misses, attainment, miss_counts, poisson_arrivals, search_goodput_paired
from .serve_steps import Step, compare_tpot_parts, tpot_parts

VANILLA = "vanilla"


def unloaded(llm: Any, trace: Trace, clock: str = "wall") -> tuple[list[float], list[float]]:
    """TTFTs and TPOTs of the requests run one at a time."""
    tt: list[float] = []
    tp: list[float] = []
    for item in trace:
        r = run_trace(llm, [item], clock=clock)
        if r.ttft[0] is None or r.tpot[0] is None:
            raise RuntimeError("a request run alone produced no token")
        tt.append(r.ttft[0])
        tp.append(r.tpot[0])
    return tt, tp


def unloaded_summary(tt: list[float], tp: list[float], trace: Trace, slo: tuple[float, float]) -> dict[str, Any]:
    """An engine's requests run alone: attainment, mean TTFT / TPOT, and the end-to-end time they imply."""
    e2e = float(np.mean(tt)) + (float(np.mean([m for _, m in trace])) - 1.0) * float(np.mean(tp))
    return {"unloaded_attainment": round(attainment(tt, tp, *slo), 3), "unloaded_ttft_s": round(float(np.mean(tt)), 3),
            "unloaded_tpot_s": round(float(np.mean(tp)), 4), "unloaded_e2e_s": round(e2e, 3)}


def probe(llm: Any, cfg: ServeConfig, trace: Trace, slo: tuple[float, float], rate: float,
          record_steps: bool = False) -> tuple[dict[str, Any], list[Step]]:
    """``trace`` at Poisson ``rate`` (the same arrival pattern at every rate), stopped once more requests
    missed than the attainment target allows: the probe's record and, with ``record_steps``, its steps."""
    arrivals = poisson_arrivals(len(trace), 1.0)
    r = run_trace(llm, trace, arrivals / rate, slo=slo, max_misses=allowed_misses(len(trace), cfg.slo_attainment),
                  clock=cfg.clock, record_steps=record_steps)
    miss = miss_counts(r.ttft, r.tpot, *slo)
    done_tt = [x for x in r.ttft if x is not None]
    done_tp = [x for x in r.tpot if x is not None]
    rec = {"rate_rps": round(rate, 4), "attainment": round(attainment(r.ttft, r.tpot, *slo), 3), "aborted": r.aborted,
           "missed_ttft": miss["ttft"], "missed_tpot": miss["tpot"], "running_peak": r.probe.max_running,
           "seconds": round(r.seconds, 1),
           "ttft_p90_s": round(float(np.percentile(done_tt, 90)), 3) if done_tt else None,
           "tpot_mean_s": round(float(np.mean(done_tp)), 4) if done_tp else None,
           "tpot_p90_s": round(float(np.percentile(done_tp, 90)), 4) if done_tp else None}
    return rec, r.steps


def _probe_line(label: str, rec: dict[str, Any], n: int) -> str:
    return (f"  {label}: rate {rec['rate_rps']:.3f} rps -> attainment {rec['attainment']:.2f} (missed TTFT "
            f"{rec['missed_ttft']}, TPOT {rec['missed_tpot']} of {n}; running peak {rec['running_peak']})"
            f"{' (stopped early)' if rec['aborted'] else ''} [{rec['seconds']:.0f}s]")


def paired_goodput(engines: dict[str, Any], cfg: ServeConfig, trace: Trace, slo: tuple[float, float], start: float,
                   floor: float, log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """The goodput searches of ``engines`` (label -> engine) run in turn (:func:`search_goodput_paired`), then
    ``cfg.confirm_rounds`` rotated rounds of every engine at every goodput found (steps recorded). Per label:
    ``{goodput_rps, bracket, saturated, probes, confirm: {rate: [attainment, ...]}}`` and, under
    ``"tpot_parts"``, where the decoding time went at each goodput found (:func:`tpot_parts_by_rate`)."""
    probes: dict[str, list[dict[str, Any]]] = {k: [] for k in engines}

    def run(label: str, rate: float) -> float:
        rec, _ = probe(engines[label], cfg, trace, slo, rate)
        probes[label].append(rec)
        log(_probe_line(label, rec, len(trace)))
        return rec["attainment"]

    found = search_goodput_paired(run, list(engines), start, cfg.slo_attainment, factor=cfg.rate_factor,
                                  max_ladder=cfg.max_ladder, bisect_steps=cfg.bisect_steps, min_rate=floor)
    out: dict[str, dict[str, Any]] = {
        k: {"goodput_rps": round(s.goodput, 4), "bracket": [round(s.bracket[0], 4),
            None if s.bracket[1] is None else round(s.bracket[1], 4)], "saturated": s.saturated,
            "probes": probes[k], "confirm": {}} for k, s in found.items()}
    rates = sorted({s.goodput for s in found.values() if s.goodput > 0})
    steps: dict[float, dict[str, list[Step]]] = {r: {k: [] for k in engines} for r in rates}
    order = list(engines)
    for _ in range(cfg.confirm_rounds if rates else 0):
        for k in order:
            for rate in rates:
                rec, st = probe(engines[k], cfg, trace, slo, rate, record_steps=True)
                log(_probe_line(f"{k} (confirm)", rec, len(trace)))
                out[k]["confirm"].setdefault(f"{rate:.4f}", []).append(rec["attainment"])
                steps[rate][k].extend(st)
        order = order[1:] + order[:1]
    parts = tpot_parts_by_rate(steps)
    for k in out:
        out[k]["tpot_parts"] = parts
    return out


def tpot_parts_by_rate(steps: dict[float, dict[str, list[Step]]]) -> list[dict[str, Any]]:
    """Where the decoding time went, per confirmed rate (ascending) and engine: one step-cost model fitted over
    every step recorded (same machine, model and dtype), each run's :func:`~.serve_steps.tpot_parts` under it
    (``[]`` when too few steps were recorded). The steps of a probe stopped early are its steps until then."""
    every = {f"{k}@{r}": v for r, runs in steps.items() for k, v in runs.items()}
    fit = compare_tpot_parts(every)
    if not fit:
        return []
    c = fit["cost"]
    cost = (c["base_s"], c["per_request_s"], c["per_prefill_token_s"])
    return [{"rate_rps": round(r, 4), "cost": c, "runs": {k: tpot_parts(v, cost) for k, v in runs.items()}}
            for r, runs in sorted(steps.items())]


def goodput_spread(search: dict[str, Any], cfg: ServeConfig) -> dict[str, Any]:
    """The attainments measured at a search's goodput rate (the search's passing probe and its confirmations):
    ``{runs, attainment_min, attainment_max, held}`` (``held``: how many of them met the target)."""
    gp = search["goodput_rps"]
    got = [p["attainment"] for p in search["probes"] if gp and abs(p["rate_rps"] - gp) <= 1e-4 * gp]
    got += search["confirm"].get(f"{gp:.4f}", []) if gp else []
    if not got:
        return {"runs": 0}
    return {"runs": len(got), "attainment_min": min(got), "attainment_max": max(got),
            "held": int(sum(bool(a >= cfg.slo_attainment - 1e-12) for a in got))}


def gain_range(row: dict[str, Any], van: dict[str, Any]) -> list[float | None] | None:
    """What the two searches' brackets allow for ``row / vanilla``: ``[row lo / vanilla hi, row hi / vanilla lo]``
    (None ends: an unbounded or zero end)."""
    (rl, rh), (vl, vh) = row["bracket"], van["bracket"]
    if not vl:
        return None
    return [round(rl / vh, 3) if vh else None, round(rh / vl, 3) if rh else None]


def run_goodput_only(cfg: ServeConfig, model_dir: str, trace: Trace, gp_trace: Trace, un_trace: Trace,
                     log: Callable[[str], None], el: Callable[[], str]
                     ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """(b), and all of ``--only goodput``: vanilla's SLOs, then for each goodput row an engine built, its goodput
    searched in turn with vanilla's (:func:`paired_goodput`) and freed; every engine capped at
    ``goodput_max_seqs`` running requests. Returns the rows ``{mode, policy, eviction_ratio, goodput_rps,
    goodput_gain, goodput_search}`` (vanilla first: its search of the first pairing; each row's gain is over
    the vanilla search it was paired with, ``goodput_search.vanilla``) and the SLOs."""
    n = cfg.goodput_max_seqs or len(trace)
    van = build_engine(model_dir, cfg, None, max_num_seqs=n)
    warm_engine(van, trace)
    tt, tp = unloaded(van, un_trace, cfg.clock)
    ref_ttft, ref_tpot = float(np.mean(tt)), float(np.mean(tp))
    slo = (cfg.ttft_slo_factor * ref_ttft, cfg.tpot_slo_factor * ref_tpot)
    log(f"SLOs: TTFT {slo[0]:.2f}s ({cfg.ttft_slo_factor}x {ref_ttft:.2f}s), TPOT {1e3 * slo[1]:.0f}ms "
        f"({cfg.tpot_slo_factor}x {1e3 * ref_tpot:.1f}ms) {el()}")
    van_un = unloaded_summary(tt, tp, un_trace, slo)
    # below this rate requests rarely overlap (offered load x unloaded latency < 0.25): a miss there is the
    # engine's own latency, and the run would take longer than it tells
    floor = 0.25 / van_un["unloaded_e2e_s"]
    start = 1.0 / ref_ttft  # the prefill-bound capacity
    slo_cfg = {"ttft_slo_s": slo[0], "tpot_slo_s": slo[1], "unloaded_ttft_s": ref_ttft, "unloaded_tpot_s": ref_tpot}
    keys = cfg.goodput_keys()  # None ("all"): every configured row
    todo = row_keys(cfg) if keys is None else sorted(keys)
    rows: list[dict[str, Any]] = []
    van_search: dict[str, Any] | None = None
    for mode, pol, r in todo:
        label = f"{mode} {pol} {r}"
        llm = build_engine(model_dir, cfg, plugin_args(cfg, pol, r, mode), max_num_seqs=n)
        warm_engine(llm, trace)
        row_un = unloaded_summary(*unloaded(llm, un_trace, cfg.clock), un_trace, slo)
        engines = {VANILLA: van}
        if row_un["unloaded_attainment"] >= cfg.slo_attainment:
            engines[label] = llm
        else:
            log(f"  {label}: misses the SLOs unloaded (attainment {row_un['unloaded_attainment']:.2f}): goodput 0")
        got = paired_goodput(engines, cfg, gp_trace, slo, start, floor, log)
        v = {**van_un, "start_rps": round(start, 4), "floor_rps": round(floor, 4), **got[VANILLA]}
        v["spread"] = goodput_spread(v, cfg)
        van_search = van_search or v
        g = got.get(label) or {"goodput_rps": 0.0, "bracket": [0.0, None], "saturated": False, "probes": [],
                               "confirm": {}, "tpot_parts": []}
        g = {**row_un, "start_rps": round(start, 4), "floor_rps": round(floor, 4), **g, "vanilla": v}
        g["spread"] = goodput_spread(g, cfg)
        g["gain_range"] = gain_range(g, v)
        log(f"{label}: goodput {g['goodput_rps']} rps, vanilla beside it {v['goodput_rps']} rps {el()}")
        rows.append({"mode": mode, "policy": pol, "eviction_ratio": r, "goodput_rps": g["goodput_rps"],
                     "goodput_gain": round(g["goodput_rps"] / v["goodput_rps"], 3) if v["goodput_rps"] else None,
                     "goodput_search": g})
        free_engine(llm)
    if van_search is None:  # no goodput row: vanilla alone
        van_search = {**van_un, "start_rps": round(start, 4), "floor_rps": round(floor, 4),
                      **paired_goodput({VANILLA: van}, cfg, gp_trace, slo, start, floor, log)[VANILLA]}
        van_search["spread"] = goodput_spread(van_search, cfg)
    free_engine(van)
    van_row = {"mode": "vanilla", "policy": "none", "eviction_ratio": 0.0, "goodput_rps": van_search["goodput_rps"],
               "goodput_gain": 1.0 if van_search["goodput_rps"] else None, "goodput_search": van_search}
    return [van_row, *rows], slo_cfg


def rounded_slos(slo_cfg: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3 if "ttft" in k else 4) for k, v in slo_cfg.items()}
