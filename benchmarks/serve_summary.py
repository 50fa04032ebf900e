"""Statistics of paired, interleaved rounds (medians, spreads, ratios) and the orders the rounds run in.
Engine-free: unit-tested in ``tests/bench/test_serve_bench.py``."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .serve_engine import RunResult


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


def rounded(d: dict[str, float], k: int = 2) -> dict[str, float]:
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
                "vanilla_tok_s_spread": rounded(spread(tok_s(wall["vanilla"]))),
                "plugin_none_tok_s_spread": rounded(spread(tok_s(wall["none"]))),
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
            "none_s_spread": rounded(spread(nw), 3), "h2o_s_spread": rounded(spread(wall["h2o"]), 3),
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
    return {"vanilla_tok_s": round(statistics.median(vw), 2), "vanilla_tok_s_spread": rounded(spread(vw)),
            "vtoken_tok_s": round(statistics.median(tw), 2), "vtoken_tok_s_spread": rounded(spread(tw)),
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


def alone_orders(alone: Sequence[str], rounds: int) -> list[list[str]]:
    """ABBA for two engines, the rotating cycle of :func:`interleaved_order` for more."""
    return pair_order(*alone, rounds) if len(alone) == 2 else interleaved_order(alone, rounds)
