"""The serving benchmark's engine-free parts: SLO attainment, the goodput search, interleaving and the
statistics of interleaved rounds, the trace and KV-budget sizing (no vLLM engine, fast)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from vtoken_bench.serve_config import ServeConfig, resolve_dtype
from vtoken_bench.serve_slo import (
    allowed_misses,
    attainment,
    meets_slo,
    miss_counts,
    poisson_arrivals,
    search_goodput,
    search_goodput_paired,
    tpot_of,
)
from vtoken_bench.serve_summary import interleaved_order, paired_ratio, spread
from vtoken_bench.serve_traces import default_kv_blocks, fitting_prefix, footprint_blocks, trace_lengths

# ----------------------------------------------------------------------------- attainment


def test_meets_slo_needs_both_and_a_finished_request() -> None:
    assert meets_slo(1.0, 0.05, 2.0, 0.1)
    assert not meets_slo(2.5, 0.05, 2.0, 0.1)  # TTFT missed
    assert not meets_slo(1.0, 0.2, 2.0, 0.1)  # TPOT missed
    assert not meets_slo(None, 0.05, 2.0, 0.1)  # never produced a token
    assert not meets_slo(1.0, None, 2.0, 0.1)  # never finished (aborted)
    assert meets_slo(2.0, 0.1, 2.0, 0.1)  # the bound itself meets it


def test_attainment_counts_requests_meeting_both() -> None:
    ttft = [1.0, 1.0, 3.0, 1.0, None]
    tpot = [0.05, 0.2, 0.05, 0.1, None]
    assert attainment(ttft, tpot, 2.0, 0.1) == pytest.approx(2 / 5)
    assert attainment([], [], 1.0, 1.0) == 0.0
    with pytest.raises(ValueError):
        attainment([1.0], [], 1.0, 1.0)


def test_miss_counts_split_the_misses_by_slo() -> None:
    ttft = [1.0, 1.0, 3.0, 1.0, None, 3.0, 1.0]
    tpot = [0.05, 0.2, 0.05, 0.1, None, 0.3, None]
    # TTFT: 3.0, None, 3.0; TPOT: 0.2, 0.3 (late on both), and the started request that never finished
    assert miss_counts(ttft, tpot, 2.0, 0.1) == {"ttft": 3, "tpot": 3}
    got = miss_counts(list(np.asarray(ttft[:4])), list(np.asarray(tpot[:4])), 2.0, 0.1)  # numpy scalars, as runs give
    assert got == {"ttft": 1, "tpot": 1} and all(type(v) is int for v in got.values())  # JSON-serialisable
    met = attainment(ttft, tpot, 2.0, 0.1) * len(ttft)
    assert met == 2 and len(ttft) - met <= sum(miss_counts(ttft, tpot, 2.0, 0.1).values())
    assert miss_counts([], [], 1.0, 1.0) == {"ttft": 0, "tpot": 0}
    with pytest.raises(ValueError):
        miss_counts([1.0], [], 1.0, 1.0)


def test_tpot_and_allowed_misses() -> None:
    assert tpot_of(2.0, 5.0, 4) == pytest.approx(1.0)
    assert tpot_of(2.0, 2.0, 1) == 0.0
    assert allowed_misses(10, 0.9) == 1  # 9/10 = 0.9 still meets 90%
    assert allowed_misses(8, 0.9) == 0  # 7/8 < 0.9
    assert allowed_misses(20, 0.9) == 2
    assert allowed_misses(5, 1.0) == 0
    for n in range(1, 40):
        for a in (0.5, 0.8, 0.9, 0.95, 1.0):
            k = allowed_misses(n, a)
            assert (n - k) / n >= a - 1e-12 and (k + 1 > n or (n - k - 1) / n < a)


# ----------------------------------------------------------------------------- goodput search


def _fake(capacity: float, calls: list[float]):
    """Monotone attainment: 1 up to ``capacity``, then falling fast."""
    def run(rate: float) -> float:
        calls.append(rate)
        return 1.0 if rate <= capacity else max(0.0, 1.0 - 4.0 * (rate / capacity - 1.0))
    return run


@pytest.mark.parametrize("capacity", [0.05, 0.13, 0.3, 0.5, 0.9, 1.7])
def test_search_brackets_and_bisects_to_the_capacity(capacity: float) -> None:
    calls: list[float] = []
    s = search_goodput(_fake(capacity, calls), start=0.4, target=0.9, factor=2.0, max_ladder=4, bisect_steps=3)
    lo, hi = s.bracket
    assert hi is not None and lo <= capacity * 1.025 + 1e-12 < hi  # attainment 0.9 at 1.025x capacity
    assert s.goodput == lo
    assert hi / lo <= 2.0 ** (1 / 2**3) + 1e-9  # three bisections of a factor-2 bracket
    assert [r for r, _ in s.probes] == calls  # every probe reported, in order
    assert all(a >= 0.9 for r, a in s.probes if r <= lo) and all(a < 0.9 for r, a in s.probes if r >= hi)


def test_search_zero_when_even_the_lowest_rung_fails() -> None:
    calls: list[float] = []
    s = search_goodput(_fake(0.001, calls), start=1.0, target=0.9, factor=2.0, max_ladder=3, bisect_steps=2)
    assert s.goodput == 0.0 and not s.saturated
    assert calls == [1.0, 0.5, 0.25, 0.125]  # the ladder down, no bisection without a passing rate


def test_search_saturates_when_no_rate_fails() -> None:
    s = search_goodput(lambda r: 1.0, start=1.0, target=0.9, factor=2.0, max_ladder=3, bisect_steps=2)
    assert s.goodput == 8.0 and s.saturated and s.bracket == (8.0, None)
    assert [r for r, _ in s.probes] == [1.0, 2.0, 4.0, 8.0]


def test_search_probe_count_is_small() -> None:
    calls: list[float] = []
    search_goodput(_fake(0.3, calls), start=0.25, target=0.9, factor=2.0, max_ladder=4, bisect_steps=2)
    assert calls == [0.25, 0.5, math.sqrt(0.125), pytest.approx(math.sqrt(0.25 * math.sqrt(0.125)))]


def test_paired_search_finds_each_capacity_probing_in_turn() -> None:
    """Two engines searched together: each gets the goodput its own search gets alone, and every round runs the
    open searches one after the other in a rotated order (A B, B A, ...)."""
    caps = {"vanilla": 0.3, "row": 0.13}
    calls: list[tuple[str, float]] = []

    def run(label: str, rate: float) -> float:
        calls.append((label, rate))
        return _fake(caps[label], [])(rate)

    got = search_goodput_paired(run, ["vanilla", "row"], start=0.4, target=0.9, factor=2.0, max_ladder=4,
                                bisect_steps=2)
    for k, cap in caps.items():
        alone = search_goodput(_fake(cap, []), start=0.4, target=0.9, factor=2.0, max_ladder=4, bisect_steps=2)
        assert got[k].goodput == alone.goodput and got[k].probes == alone.probes
    assert calls[:4] == [("vanilla", 0.4), ("row", 0.4), ("row", 0.2), ("vanilla", 0.2)]  # rotated rounds
    with pytest.raises(ValueError, match="distinct"):
        search_goodput_paired(run, ["a", "a"], start=1.0, target=0.9)


def test_paired_search_continues_the_open_search_alone() -> None:
    """When one search closes (its bracket found), the other goes on alone."""
    calls: list[str] = []
    got = search_goodput_paired(lambda k, r: (calls.append(k), 1.0 if k == "up" else 0.0)[1], ["up", "down"],
                                start=1.0, target=0.9, factor=2.0, max_ladder=3, bisect_steps=0, min_rate=0.3)
    assert got["up"].saturated and got["up"].goodput == 8.0
    assert got["down"].goodput == 0.0 and [r for r, _ in got["down"].probes] == [1.0, 0.5]
    assert calls == ["up", "down", "down", "up", "up", "up"]


def test_search_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        search_goodput(lambda r: 1.0, start=0.0, target=0.9)
    with pytest.raises(ValueError):
        search_goodput(lambda r: 1.0, start=1.0, target=0.9, factor=1.0)


def test_poisson_arrivals_scale_with_the_rate() -> None:
    a1 = poisson_arrivals(10, 1.0, seed=3)
    a4 = poisson_arrivals(10, 4.0, seed=3)
    assert a1[0] == 0.0 and np.all(np.diff(a1) >= 0)
    np.testing.assert_allclose(a4, a1 / 4.0)
    assert np.all(poisson_arrivals(5, None) == 0.0)


# ----------------------------------------------------------------------------- interleaving and statistics


def test_interleaved_order_balances_positions_and_successors() -> None:
    from collections import Counter

    from vtoken_bench.serve_summary import pair_order

    order = interleaved_order(("a", "b", "c"), 6)
    for rnd in order:
        assert sorted(rnd) == ["a", "b", "c"]
    assert Counter(r[0] for r in order) == {"a": 2, "b": 2, "c": 2}  # every engine starts as often
    for i in range(0, 6, 2):  # in lockstep (cyclic), every engine follows every other once per two rounds
        follows = Counter((r[k], r[(k + 1) % 3]) for r in order[i:i + 2] for k in range(3))
        assert set(follows) == {(x, y) for x in "abc" for y in "abc" if x != y} and set(follows.values()) == {1}
    assert pair_order("n", "h", 4) == [["n", "h"], ["h", "n"], ["h", "n"], ["n", "h"]]  # ABBA


def test_spread_and_paired_ratio() -> None:
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    with pytest.raises(ValueError):
        spread([])
    r = paired_ratio([11.0, 9.0, 10.0], [10.0, 10.0, 10.0])
    assert r["ratio"] == pytest.approx(1.0) and r["min"] == pytest.approx(0.9) and r["max"] == pytest.approx(1.1)
    # a slow round slows both engines: pairing keeps the per-round ratio tight
    r = paired_ratio([2.2, 1.1, 1.1], [2.0, 1.0, 1.0])
    assert r["min"] == pytest.approx(1.1) and r["max"] == pytest.approx(1.1)
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])


# ----------------------------------------------------------------------------- trace and budget


def test_trace_lengths_stay_in_range_and_are_seeded() -> None:
    cfg = ServeConfig(num_requests=50)
    p, o = trace_lengths(cfg)
    assert len(p) == len(o) == 50
    assert all(1024 <= x <= 2048 for x in p) and all(128 <= x <= 256 for x in o)
    assert len(set(p)) > 10  # varied
    assert trace_lengths(cfg) == (p, o)
    q = ServeConfig.quick()
    qp, qo = trace_lengths(q)
    assert min(qp) >= 1024 and len(qp) == q.num_requests


def test_kv_budget_holds_the_vanilla_target() -> None:
    trace = [([0] * 1000, 200), ([0] * 1500, 100), ([0] * 2000, 48)]
    fp = [footprint_blocks(len(p), m, 32) for p, m in trace]
    assert fp == [38, 50, 64]
    kv = default_kv_blocks(trace, 32, 4.0)
    assert kv == math.ceil(4.5 * sum(fp) / 3)  # half a request over the target: off the rounding edge
    mean = sum(fp) / 3
    assert int(kv // mean) == 4  # vanilla holds the target
    assert fitting_prefix(trace, 32, 90, 3) == 2
    assert fitting_prefix(trace, 32, 10, 3) == 1  # at least one
    assert fitting_prefix(trace, 32, 10**6, 2) == 2


def test_config_validation() -> None:
    ServeConfig().validate()
    ServeConfig.quick().validate()
    for bad in (dict(when="decode"), dict(modes=("compact",)), dict(goodput_rows="some"),
                dict(prompt_tokens=(10, 5)), dict(slo_attainment=0.0), dict(rate_factor=1.0), dict(ratios=(1.0,)),
                dict(goodput_max_seqs=0), dict(only="rows"), dict(dtype="float16")):
        with pytest.raises(ValueError):
            ServeConfig(**bad).validate()  # type: ignore[arg-type]
    ServeConfig(dtype="bfloat16").validate()
    assert ServeConfig().dtype == "auto"
    assert resolve_dtype("float32") == "float32" and resolve_dtype("bfloat16") == "bfloat16"
    assert resolve_dtype("auto") == ("bfloat16" if torch.cpu._is_amx_tile_supported() else "float32")


def test_kv_bytes_follow_the_dtype(tmp_path: Path) -> None:
    """The KV budget is counted in blocks: bf16 gets half the bytes of fp32 for the same blocks (SmolLM2-like
    config: 30 layers x 3 KV heads x head 64)."""
    import json

    from vtoken_bench.serve_engine import kv_bytes

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "num_hidden_layers": 30, "intermediate_size": 1536, "vocab_size": 49152}))
    fp32 = kv_bytes(str(tmp_path), 10, 32)
    assert fp32 == 10 * 2 * 30 * 3 * 64 * 32 * 4
    assert kv_bytes(str(tmp_path), 10, 32, "bfloat16") * 2 == fp32


def test_summarize_interleaved_reports_medians_spreads_and_paired_ratios() -> None:
    from vtoken_bench.serve_summary import summarize_interleaved

    # round 2 is slowed for everyone (another job on the machine): paired ratios stay tight
    wall = {"vanilla": [10.0, 20.0, 10.0], "none": [10.1, 20.2, 10.1], "h2o": [12.0, 24.0, 12.6]}
    cpu = {"vanilla": [9.0, 9.0, 9.0], "none": [9.09, 9.09, 9.09], "h2o": [10.8, 10.8, 11.7]}
    ov, st = summarize_interleaved(wall, cpu, tokens=100)
    assert ov["vanilla_tok_s"] == 10.0 and ov["plugin_none_tok_s"] == pytest.approx(9.9, abs=0.01)
    assert ov["vanilla_tok_s_spread"] == {"median": 10.0, "min": 5.0, "max": 10.0}
    assert ov["overhead_pct"] == pytest.approx(0.99, abs=0.01)  # 1 - 10 / 10.1
    assert ov["overhead_pct_spread"]["min"] == pytest.approx(0.99, abs=0.01)
    assert ov["overhead_pct_spread"]["max"] == pytest.approx(0.99, abs=0.01)
    assert ov["overhead_pct_cpu"] == pytest.approx(0.99, abs=0.01)
    assert st["none_s"] == 10.1 and st["h2o_s"] == 12.6
    assert st["ratio"] == pytest.approx(12.6 / 10.1, abs=1e-3)
    assert st["ratio_spread"]["min"] == pytest.approx(12.0 / 10.1, abs=1e-3)
    assert st["ratio_spread"]["max"] == pytest.approx(12.6 / 10.1, abs=1e-3)
    assert st["ratio_cpu"] == pytest.approx(1.188, abs=1e-3)
    assert ov["overhead_pct_cpu_fastest"] == pytest.approx(0.99, abs=0.01)  # fastest runs: 9.0 vs 9.09 s
    assert st["ratio_cpu_fastest"] == pytest.approx(10.8 / 9.09, abs=1e-3)
    assert "aa_pct" not in ov
    wall["vanilla_b"], cpu["vanilla_b"] = [9.5, 19.0, 9.5], [8.55, 8.55, 8.55]  # a 5% faster twin
    wall["none_alone"], cpu["none_alone"] = [12.0, 24.0, 12.0], [10.8, 10.8, 10.8]
    ov, st2 = summarize_interleaved(wall, cpu, tokens=100, stats_ref="none_alone")
    assert st2["none_s"] == 12.0 and st2["ratio_cpu"] == pytest.approx(1.0)  # medians 10.8 / 10.8
    assert ov["aa_pct"] == pytest.approx(-5.26, abs=0.01) and ov["aa_pct_cpu"] == pytest.approx(-5.26, abs=0.01)
    assert ov["aa_pct_spread"] == {"min": -5.26, "max": -5.26}
    # the plugin engine against the geometric mean of the vanilla engines built before and after it
    ref = math.sqrt(9.0 * 8.55)
    assert ov["overhead_pct_bracketed_cpu"] == pytest.approx(100 * (1 - ref / 9.09), abs=0.01)


def test_search_stops_at_the_floor_rate() -> None:
    calls: list[float] = []
    s = search_goodput(_fake(0.001, calls), start=1.0, target=0.9, factor=2.0, max_ladder=6, min_rate=0.2)
    assert s.goodput == 0.0 and calls == [1.0, 0.5, 0.25]  # 0.125 < floor: not run
    calls.clear()
    s = search_goodput(_fake(0.3, calls), start=1.0, target=0.9, factor=2.0, max_ladder=6, bisect_steps=0,
                       min_rate=0.2)
    assert s.goodput == 0.25 and calls == [1.0, 0.5, 0.25]


def test_serving_clock_cpu_skips_idle_gaps_and_ignores_stolen_time() -> None:
    from vtoken_bench.serve_engine import ServingClock

    t = {"wall": 100.0, "cpu": 5.0}
    c = ServingClock("cpu", wall=lambda: t["wall"], cpu=lambda: t["cpu"])
    t["wall"] += 3.0  # descheduled for 3 s: another job ran
    t["cpu"] += 1.0
    assert c.now() == pytest.approx(1.0)
    c.wait_until(10.0)  # nothing in flight: jump to the next arrival
    assert c.now() == pytest.approx(10.0)
    c.wait_until(4.0)  # already past: no-op
    assert c.now() == pytest.approx(10.0)
    w = ServingClock("wall", wall=lambda: t["wall"], cpu=lambda: t["cpu"])
    t["wall"] += 2.0
    assert w.now() == pytest.approx(2.0)
    with pytest.raises(ValueError):
        ServingClock("gpu")


def test_throughput_summary_pairs_rounds() -> None:
    from vtoken_bench.serve_engine import Probe, RunResult
    from vtoken_bench.serve_summary import summarize_throughput

    def rr(tok: int, s: float, c: float) -> RunResult:
        return RunResult(seconds=s, cpu_seconds=c, output_tokens=tok, probe=Probe())

    van = [rr(100, 10.0, 9.0), rr(100, 12.0, 9.5), rr(100, 11.0, 9.2)]
    vt = [rr(100, 8.0, 7.0), rr(100, 8.0, 7.6), rr(100, 9.0, 7.1)]
    t = summarize_throughput(van, vt)
    assert t["vanilla_tok_s"] == pytest.approx(100 / 11.0, abs=0.01)
    assert t["vtoken_tok_s"] == pytest.approx(100 / 8.0, abs=0.01)
    per = [a.seconds / b.seconds for a, b in zip(van, vt, strict=True)]  # vtoken tok/s / vanilla tok/s per round
    assert t["ratio_spread"] == {"min": round(min(per), 3), "max": round(max(per), 3)}
    assert t["ratio"] == pytest.approx((100 / 8.0) / (100 / 11.0), abs=1e-3)
    assert t["ratio_spread"]["min"] <= t["ratio"] <= t["ratio_spread"]["max"]
    assert t["ratio_cpu"] == pytest.approx(9.2 / 7.1, abs=1e-3)
    with pytest.raises(ValueError):
        summarize_throughput(van, vt[:2])


def test_goodput_rows_parse() -> None:
    assert ServeConfig(goodput_rows="all").goodput_keys() is None
    assert ServeConfig(goodput_rows="none").goodput_keys() == set()
    assert ServeConfig(goodput_rows="h2o@0.5, naive:tova@0.7").goodput_keys() == {
        ("vtoken", "h2o", 0.5), ("naive", "tova", 0.7)}
    for bad in ("h2o", "h2o@x", "h2o@1.5", "weird:h2o@0.5", "@0.5"):
        with pytest.raises(ValueError, match="goodput_rows"):
            ServeConfig(goodput_rows=bad).validate()


def test_unequal_policies_evict_once_after_the_prompt_and_have_no_naive_rows() -> None:
    """A row of a policy with unequal budgets runs in per-row pages (issue 39): ``when="prefill"`` whatever the
    trace's ``when`` (the only eviction point per-row pages take), and no Naive-Evict row (no per-row pages);
    its statistics cost can run beside H2O's (``stats_extra``)."""
    from vtoken_bench.serve_config import ServeConfig, plugin_args, row_keys, row_when
    from vtoken_bench.serve_overhead import stats_cost_specs

    cfg = ServeConfig(policies=("h2o", "ada_snapkv"), ratios=(0.5,), modes=("naive", "vtoken"), when="chunks",
                      stats_extra=("ada_snapkv",))
    assert row_when(cfg, "h2o") == "chunks" and row_when(cfg, "ada_snapkv") == "prefill"
    assert row_keys(cfg) == [("naive", "h2o", 0.5), ("vtoken", "h2o", 0.5), ("vtoken", "ada_snapkv", 0.5)]
    assert plugin_args(cfg, "ada_snapkv", 0.5)["when"] == "prefill"
    specs, alone = stats_cost_specs(cfg)
    assert specs["ada_snapkv"]["when"] == "prefill" and "ada_snapkv" in alone
