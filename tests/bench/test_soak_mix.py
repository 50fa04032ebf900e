"""The soak's pure logic (``vtoken_bench.soak_mix``): mix proportions, request specs, aggregation and the
checks' verdicts on synthetic results, passing and failing."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from vtoken_bench.soak_mix import (
    BAD,
    GOOD,
    MIX,
    Result,
    aggregate,
    build_spec,
    counter_verdicts,
    eviction_bounds,
    kinds_sequence,
    p99,
    verdicts,
)


def test_every_kind_appears_in_the_first_cycle_and_proportions_follow_the_weights() -> None:
    first = kinds_sequence(len(MIX))
    assert sorted(first) == sorted(MIX)
    n = 2000
    counts = Counter(kinds_sequence(n))
    total = sum(MIX.values())
    for k, w in MIX.items():
        assert abs(counts[k] / n - w / total) < 0.01, (k, counts[k])


def test_a_short_run_is_a_prefix_and_bad_weights_are_refused() -> None:
    assert kinds_sequence(3) == list(MIX)[:3]
    assert kinds_sequence(50)[:20] == kinds_sequence(20)
    with pytest.raises(ValueError, match="weights"):
        kinds_sequence(5, {"evict": 0.0})


def _spec(kind: str, index: int = 0, max_model_len: int = 3200):
    return build_spec(index, kind, random.Random(0), list(range(2000)), model="m", max_model_len=max_model_len,
                      output_tokens=(16, 64), chat_text="hello there")


def test_specs_carry_the_options_of_their_kind() -> None:
    assert _spec("opt_out").body["vllm_xargs"] == {"vtoken_enabled": False}
    assert "vtoken_eviction_ratio" in _spec("own_ratio").body["vllm_xargs"]
    assert "vtoken_budget_tokens" in _spec("own_budget").body["vllm_xargs"]
    pins = _spec("pinned").body["vllm_xargs"]["vtoken_pinned_spans"]
    assert len(pins) == 4 and pins[0] == 0 and pins[3] == 2000
    assert "vllm_xargs" not in _spec("evict").body and _spec("evict").stream
    chat = _spec("chat_n")
    assert chat.path == "/v1/chat/completions" and chat.n in (2, 3) and not chat.replayable
    for i in range(len(BAD)):
        bad = _spec("invalid_stream", i)
        assert bad.body["stream"] and bad.expect_key == BAD[i][1] and bad.body["vllm_xargs"] == BAD[i][0]


def test_a_context_limit_request_fills_the_model_length_exactly() -> None:
    s = _spec("context_limit", max_model_len=1500)
    assert len(s.body["prompt"]) + s.body["max_tokens"] == 1500 and s.body["ignore_eos"]


def test_p99() -> None:
    assert p99([]) is None
    assert p99([1.0]) == 1.0
    assert p99([float(i) for i in range(101)]) == pytest.approx(99.0)


def _results(**over: object) -> list[Result]:
    rs = [Result(0, "evict", 200, ok=True, text="a", ttft_s=0.5, tpot_s=0.1, prompt_tokens=1000, max_tokens=20,
                 replayable=True),
          Result(1, "opt_out", 200, ok=True, text="b", prompt_tokens=1000, max_tokens=20),
          Result(2, "invalid", 400, ok=True, error="vtoken_bogus: unknown"),
          Result(3, "disconnect_mid", 200, ok=True, prompt_tokens=1000, max_tokens=200),
          Result(4, "chat_n", 200, ok=True, prompt_tokens=10, max_tokens=16, n=3)]
    for k, v in over.items():
        setattr(rs[0], k, v)
    return rs


def _summary(results: list[Result], **over: object) -> dict:
    s = aggregate(results)
    s.update({"mismatched_outputs": 0, "replayed": 1, "kv_usage_end": 0.0,
              "kv_blocks": {"total": 255, "free": 255, "held": 0}, "rss_growth_pct": 1.0,
              "vtoken_counters_checks": {"a": True, "b": True}})
    s.update(over)
    return s


def test_aggregate_counts_kinds_and_statuses() -> None:
    s = aggregate(_results())
    assert s["requests"] == 5 and s["good"] == 3 and s["completed"] == 3
    assert s["invalid_sent"] == 1 and s["rejected_400"] == 1 and s["rejected_400_naming_key"] == 1
    assert s["disconnects"] == 1 and s["status_5xx"] == 0 and s["p99_ttft_s"] == 0.5
    assert s["per_kind"]["evict"] == {"sent": 1, "ok": 1}
    assert set(s["per_kind"]) <= set(MIX) and set(GOOD) & set(s["per_kind"])


def test_every_check_passes_on_a_clean_run() -> None:
    assert set(verdicts(_summary(_results())).values()) == {"PASS"}


@pytest.mark.parametrize("over, failing", [
    ({"kv_usage_end": 0.02}, "kv_usage_zero_at_end"),
    ({"kv_blocks": {"total": 255, "free": 250, "held": 0}}, "block_pool_free_equals_total"),
    ({"kv_blocks": {"total": 255, "free": 250, "held": 5}}, "block_pool_free_equals_total"),
    ({"mismatched_outputs": 1}, "outputs_match_alone"),
    ({"rss_growth_pct": 7.5}, "rss_growth_below_5pct"),
    ({"status_5xx": 1}, "no_5xx"),
    ({"vtoken_counters_checks": {"a": True, "b": False}}, "vtoken_counters_consistent"),
])
def test_each_failing_figure_fails_its_own_check(over: dict, failing: str) -> None:
    v = verdicts(_summary(_results(), **over))
    assert v[failing] == "FAIL" and all(x == "PASS" for k, x in v.items() if k != failing), v


def test_an_incomplete_request_or_a_wrong_400_fails() -> None:
    rs = _results(ok=False, status=200)
    assert verdicts(_summary(rs))["every_good_request_completed"] == "FAIL"
    rs = _results()
    rs[2] = Result(2, "invalid", 400, ok=False, error="something else")
    assert verdicts(_summary(rs))["invalid_rejected_400_naming_key"] == "FAIL"
    rs[2] = Result(2, "invalid", 500, ok=False)
    v = verdicts(_summary(rs))
    assert v["no_5xx"] == "FAIL" and v["invalid_rejected_400_naming_key"] == "FAIL"


def test_missing_figures_are_skip_never_pass() -> None:
    v = verdicts(_summary(_results(), replayed=0, kv_usage_end=None, kv_blocks={}, rss_growth_pct=None,
                          vtoken_counters_checks={"a": True, "x": None}))
    for k in ("outputs_match_alone", "kv_usage_zero_at_end", "block_pool_free_equals_total", "rss_growth_below_5pct",
              "vtoken_counters_consistent"):
        assert v[k] == "SKIP", (k, v)


def test_counter_verdicts_bound_evictions_by_the_evicting_requests() -> None:
    rs = _results()
    b = eviction_bounds(rs, layers=30, kv_heads=3)
    assert b["evictions_max"] == (1000 + 20) + (1000 + 200) + 3 * (10 + 16)  # opted out and invalid add none
    assert b["tokens_evicted_max"] == b["evictions_max"] * 90 and b["evicting_requests"] == 5
    ok = {"vtoken_evictions_total": 10, "vtoken_tokens_evicted_total": 1e4, "vtoken_policy_failures_total": 0,
          "vtoken_rejected_requests_total": 1}
    assert all(counter_verdicts(ok, b, 1, {"vtoken_evictions_total": 0}).values())
    assert counter_verdicts(ok, b, 1, None)["opt_out_phase_evicts_nothing"] is None
    cases = [({**ok, "vtoken_evictions_total": 0}, "evictions_positive"),
             ({**ok, "vtoken_evictions_total": b["evictions_max"] + 1}, "evictions_bounded"),
             ({**ok, "vtoken_tokens_evicted_total": b["tokens_evicted_max"] + 1}, "tokens_evicted_bounded"),
             ({**ok, "vtoken_policy_failures_total": 1}, "policy_failures_zero"),
             ({**ok, "vtoken_rejected_requests_total": 2}, "rejected_equals_invalid_sent")]
    for delta, name in cases:
        v = counter_verdicts(delta, b, 1, {"vtoken_evictions_total": 0})
        assert v[name] is False and sum(x is False for x in v.values()) == 1, (name, v)
    assert counter_verdicts(ok, b, 1, {"vtoken_evictions_total": 3})["opt_out_phase_evicts_nothing"] is False


def test_last_errors_gives_the_root_cause_lines_of_a_dead_servers_log(tmp_path: Path) -> None:
    from vtoken_bench.serve_soak import last_errors

    log = tmp_path / "server.log"
    log.write_text("INFO start\n(Worker) ERROR Traceback\n(Worker) RuntimeError: CPU Generator does not use offset\n"
                   "INFO: 500 Internal Server Error\nINFO shutting down\n")
    got = last_errors(log).splitlines()
    assert got == ["(Worker) RuntimeError: CPU Generator does not use offset", "INFO: 500 Internal Server Error"]
    assert last_errors(log, n=1) == "INFO: 500 Internal Server Error"
    (tmp_path / "quiet.log").write_text("a\nb\n")
    assert last_errors(tmp_path / "quiet.log") == "a\nb"  # no error line: the tail
    assert "unreadable" in last_errors(tmp_path / "missing.log")
