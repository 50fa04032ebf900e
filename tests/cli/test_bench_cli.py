"""bench blocks / eval / list through the CLI on SmolLM2 with tiny sizes (slow: real model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vtoken_cli.main import app

runner = CliRunner()
pytestmark = pytest.mark.slow


def test_bench_blocks_json_schema_and_exact_compaction(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    res = runner.invoke(app, ["bench", "blocks", "--policies", "h2o,streaming_llm", "--ratios", "0.5",
                              "--lengths", "160", "--decode", "6", "--json", str(out), "--plot",
                              str(tmp_path / "b.png")])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert d["model"].startswith("SmolLM2")
    keys = {"policy", "eviction_ratio", "block_size", "requests", "blocks_full", "blocks_naive", "blocks_vtoken",
            "blocks_ideal", "tokens_moved", "blocks_reclaimed"}
    assert len(d["rows"]) == 2 * 3
    for r in d["rows"]:
        assert keys <= set(r)
        assert r["max_vtoken_minus_ideal"] == 0  # compaction reaches ceil(live / bs) after every step
        assert r["blocks_ideal"] <= r["blocks_vtoken"] <= r["blocks_naive"] <= r["blocks_full"]
    h2o16 = next(r for r in d["rows"] if r["policy"] == "h2o" and r["block_size"] == 16)
    assert h2o16["reduction_vs_naive"] > 0.3  # scattered per-head eviction: naive frees ~nothing
    assert (tmp_path / "b.png").stat().st_size > 10_000
    assert "reduction vs Naive-Evict at eviction ratio 0.5, block size 16" in res.stdout


def test_bench_blocks_runs_unequal_budgets_in_per_row_pages(tmp_path: Path) -> None:
    """ada_snapkv / duo_attention move to per-row pages at their eviction: their rows carry the designs' bounds,
    the request holds the page bound (never above issue 38's per-layer ideal), and they appear at the first
    block size only."""
    out = tmp_path / "b.json"
    res = runner.invoke(app, ["bench", "blocks", "--policies", "ada_snapkv,duo_attention,snapkv", "--ratios", "0.5",
                              "--lengths", "400", "--decode", "4", "--json", str(out), "--plot",
                              str(tmp_path / "b.png")])
    assert res.exit_code == 0, res.output
    rows = {(r["policy"], r["block_size"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("ada_snapkv", 16), ("duo_attention", 16), ("snapkv", 16), ("snapkv", 32), ("snapkv", 48)}
    for name in ("ada_snapkv", "duo_attention"):
        r = rows[(name, 16)]
        assert r["blocks_vtoken"] == r["blocks_ideal_pages"] <= r["blocks_ideal"] <= r["blocks_full"]
        assert r["rows_live_min"] < r["rows_live_max"]
        assert r["blocks_vtoken"] < r["blocks_max_row"]
    assert "blocks_max_row" not in rows[("snapkv", 16)]
    assert "unequal budgets in per-row pages" in res.stdout


def test_bench_blocks_when_both_keeps_duo_attentions_streaming_rows_bounded_during_decode(tmp_path: Path) -> None:
    """``--when both``: duo_attention's streaming rows are cut back to sinks + recent (68 tokens) after every
    decode step, so over 80 decode steps the request holds fewer blocks (mean and peak) than the prefill-only
    run, whose streaming rows grow by one token a step. A policy that cannot evict
    rows during decode is refused with its reason, exit 1."""
    got = {}
    for when in ("prefill", "both"):
        out = tmp_path / f"{when}.json"
        res = runner.invoke(app, ["bench", "blocks", "--policies", "duo_attention", "--ratios", "0.5", "--lengths",
                                  "300", "--decode", "80", "--block-sizes", "16", "--when", when, "--json", str(out),
                                  "--plot", str(tmp_path / "b.png")])
        assert res.exit_code == 0, res.output
        d = json.loads(out.read_text())
        assert d["when"] == when
        (got[when],) = d["rows"]
    print({w: {k: v for k, v in r.items() if k.startswith(("blocks", "peak", "rows"))} for w, r in got.items()})
    assert got["both"]["rows_live_min"] == got["prefill"]["rows_live_min"] == 68  # the handoff: sinks + recent
    assert got["both"]["rows_live_max"] == got["prefill"]["rows_live_max"]  # retrieval rows keep everything
    assert got["both"]["blocks_vtoken"] < got["prefill"]["blocks_vtoken"]
    assert got["both"]["peak_vtoken"] < got["prefill"]["peak_vtoken"]
    res = runner.invoke(app, ["bench", "blocks", "--policies", "ada_snapkv", "--ratios", "0.5", "--lengths", "64",
                              "--decode", "1", "--when", "both"])
    assert res.exit_code == 1 and "per-row pages take a request once" in res.output


def test_eval_runs_and_full_cache_is_the_reference(tmp_path: Path) -> None:
    out = tmp_path / "e.json"
    res = runner.invoke(app, ["eval", "--policies", "knorm", "--ratios", "0.5", "--context", "128",
                              "--continuation", "8", "--requests", "1", "--passkey-lengths", "400", "--depths", "0.5",
                              "--json", str(out), "--plot", str(tmp_path / "e.png")])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    rows = {(r["policy"], r["eviction_ratio"]): r for r in d["rows"]}
    assert set(rows) == {("full", 0.0), ("knorm", 0.5)}
    full = rows[("full", 0.0)]
    assert 1.0 < full["perplexity"] < 200.0
    assert full["passkey_in_prompt"] == 1.0 and full["passkey_after_eviction"] == 1.0
    # two perplexity protocols: with no eviction they score the same tokens the same way
    assert abs(full["perplexity_once"] - full["perplexity_decode"]) < 1e-3 * full["perplexity_decode"]
    kn = rows[("knorm", 0.5)]
    assert kn["perplexity_decode"] == kn["perplexity"] and kn["perplexity_once"] != kn["perplexity_decode"]
    # one window: the per-window perplexities (for paired comparisons) are the pooled ones
    assert kn["perplexity_decode_windows"] == [kn["perplexity_decode"]]
    assert kn["perplexity_once_windows"] == [kn["perplexity_once"]]
    assert "ppl (evict once)" in res.stdout and "ppl (evict every step)" in res.stdout


def test_eval_runs_unequal_budgets_and_its_two_protocols_agree(tmp_path: Path) -> None:
    """Policies evicting once after prefill score the continuation the same whether it runs as one forward
    (a fork in per-row pages, causal by row order) or token by token: per-row pages are exact both ways."""
    out = tmp_path / "e.json"
    res = runner.invoke(app, ["eval", "--policies", "ada_snapkv,duo_attention", "--ratios", "0.5", "--context", "200",
                              "--continuation", "8", "--requests", "1", "--passkey-lengths", "400", "--depths", "0.5",
                              "--json", str(out), "--plot", str(tmp_path / "e.png")])
    assert res.exit_code == 0, res.output
    rows = {(r["policy"], r["eviction_ratio"]): r for r in json.loads(out.read_text())["rows"]}
    full = rows[("full", 0.0)]["perplexity"]
    for name in ("ada_snapkv", "duo_attention"):
        r = rows[(name, 0.5)]
        assert abs(r["perplexity_once"] - r["perplexity_decode"]) < 1e-3 * r["perplexity_decode"], r
        assert r["perplexity_decode"] != full  # it evicted


def test_eval_takes_a_policy_file_and_held_out_offsets(tmp_path: Path) -> None:
    """A researcher's own file runs next to a shipped policy (same rows, its path as the label) on text at
    other offsets; a broken file stops the run before the model loads: file:line, exit 1, no traceback."""
    mine = tmp_path / "mine.py"
    mine.write_text("import vtoken_sdk as vt\n\n\n@vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(4)])\n"
                    "def mine(s: vt.TokenStats):\n    return s.attn_sum / (s.age + 1.0)\n")
    out = tmp_path / "e.json"
    args = ["eval", "--ratios", "0.5", "--context", "96", "--continuation", "4", "--requests", "1",
            "--passkey-lengths", "300", "--depths", "0.5", "--plot", str(tmp_path / "e.png")]
    res = runner.invoke(app, [*args, "--policies", f"observed_attention,{mine}", "--window-offset", "100000",
                              "--filler-offset", "125000", "--json", str(out)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert (d["window_offset"], d["filler_offset"]) == (100_000, 125_000)
    rows = {r["policy"]: r for r in d["rows"]}
    assert set(rows) == {"full", "observed_attention", str(mine)}
    # the file's score is ObservedAttention's (attention sum over age + 1) without its protection: not the
    # same keep sets, but a valid evicted perplexity
    assert 1.0 < rows[str(mine)]["perplexity_decode"] < 500.0
    bad = tmp_path / "bad.py"
    bad.write_text("import vtoken_sdk as vt\n\n\n@vt.policy(budget=vt.Budget(ratio=2.0))\n"
                   "def bad(s: vt.TokenStats):\n    return s.attn_sum\n")
    res = runner.invoke(app, [*args, "--policies", str(bad)])
    assert res.exit_code == 1
    assert f"{bad}:4" in res.output and "Traceback" not in res.output


def test_eval_once_protocol_alone_and_paired_windows(tmp_path: Path) -> None:
    """``--protocols once`` skips the token-by-token continuation and gives the evict-once figures of a run
    with both protocols; ``--paired-with`` compares every row with a reference window by window."""
    args = ["eval", "--policies", "streaming_llm,snapkv", "--ratios", "0.5", "--context", "96", "--continuation",
            "6", "--requests", "2", "--passkey-lengths", "300", "--depths", "0.5", "--plot", str(tmp_path / "e.png")]
    res = runner.invoke(app, [*args, "--protocols", "once", "--paired-with", "snapkv", "--json", str(tmp_path / "1.json")])
    assert res.exit_code == 0, res.output
    assert "window by window against snapkv (once; 2 windows)" in " ".join(res.stdout.split())
    one = json.loads((tmp_path / "1.json").read_text())
    assert one["protocols"] == ["once"]
    res = runner.invoke(app, [*args, "--json", str(tmp_path / "2.json")])
    assert res.exit_code == 0, res.output
    both = {r["policy"]: r for r in json.loads((tmp_path / "2.json").read_text())["rows"]}
    for r in one["rows"]:
        assert r["perplexity_decode"] is None and r["perplexity_decode_windows"] == []
        assert r["perplexity"] == r["perplexity_once"] == both[r["policy"]]["perplexity_once"]
        assert r["perplexity_once_windows"] == both[r["policy"]]["perplexity_once_windows"]
        assert len(r["perplexity_once_windows"]) == 2
    pr = {q["policy"]: q for q in one["paired"]}
    assert pr["snapkv"]["mean_dlogppl"] == 0.0 and pr["snapkv"]["lower"] == 0
    assert pr["streaming_llm"]["windows"] == 2 and pr["streaming_llm"]["reference"] == "snapkv"
    for bad, why in ((["--protocols", "twice"], "--protocols 'twice'"), (["--paired-with", "h2o"], "not among")):
        res = runner.invoke(app, [*args, *bad])
        assert res.exit_code == 2 and why in res.output and "Traceback" not in res.output


@pytest.mark.vllm
def test_bench_serve_tiny_trace_json_schema_and_gains(tmp_path: Path) -> None:
    """A tiny configuration of `bench serve` (short prompts, chunk 64, three requests per goodput probe):
    every section of the report is produced and vToken at 0.5 holds fewer blocks per request."""
    out = tmp_path / "s.json"
    res = runner.invoke(app, ["bench", "serve", "--policies", "h2o", "--ratios", "0.5,0.7", "--modes", "naive,vtoken",
                              "--requests", "6", "--prompt-tokens", "96,128", "--output-tokens", "8,12",
                              "--vanilla-target", "2", "--chunk", "64", "--step-tokens", "128", "--goodput-rows", "h2o@0.5",
                              "--goodput-requests", "3", "--bisect-steps", "0", "--rounds", "2",
                              "--throughput-rounds", "2",
                              "--json", str(out), "--plot", str(tmp_path / "s.png")])
    assert res.exit_code == 0, res.output
    # the report's parts ran side by side in two worker processes
    assert "6 parts (closed_loop, goodput, interleaved, row), 2 worker processes side by side" in " ".join(
        res.output.split())
    d = json.loads(out.read_text())
    rows = {(r["mode"], r["policy"], r["eviction_ratio"]): r for r in d["rows"]}
    assert set(rows) == {("vanilla", "none", 0.0), *((m, "h2o", r) for m in ("naive", "vtoken") for r in (0.5, 0.7))}
    # the rows the lockstep rounds did not measure ran once each, in the worker processes
    assert {k for k, r in rows.items() if r["closed_loop_measure"].startswith("single run, worker")} == {
        ("naive", "h2o", 0.5), ("naive", "h2o", 0.7), ("vtoken", "h2o", 0.7)}
    assert rows[("vtoken", "h2o", 0.7)]["mean_peak_blocks"] <= rows[("vtoken", "h2o", 0.5)]["mean_peak_blocks"]
    assert all(rows[k]["goodput_rps"] is None for k in rows if k not in (("vanilla", "none", 0.0), ("vtoken", "h2o", 0.5)))
    keys = {"max_concurrency", "guaranteed_concurrency", "closed_loop_tok_s", "goodput_rps", "mean_peak_blocks",
            "preemptions", "concurrency_gain"}
    van, vt = rows[("vanilla", "none", 0.0)], rows[("vtoken", "h2o", 0.5)]
    for r in (van, vt):
        assert keys <= set(r)
        assert r["closed_loop_tok_s"] > 0 and r["goodput_rps"] >= 0
        g = r["goodput_search"]
        assert 0 <= g["unloaded_attainment"] <= 1 and all(0 <= p["attainment"] <= 1 for p in g["probes"])
    assert 1 <= van["max_concurrency"] <= vt["max_concurrency"]
    assert vt["mean_peak_blocks"] < van["mean_peak_blocks"] and vt["blocks_freed"] > 0
    c = d["config"]
    assert c["when"] == "chunks" and 96 <= c["prompt_tokens_mean"] <= 128 and 8 <= c["output_tokens_mean"] <= 12
    assert c["ttft_slo_s"] == pytest.approx(5.0 * c["unloaded_ttft_s"], rel=1e-2)
    assert c["tpot_slo_s"] == pytest.approx(3.0 * c["unloaded_tpot_s"], rel=1e-2)
    o, s = d["overhead"], d["stats_cost"]
    assert o["rounds"] == 2 and o["vanilla_tok_s"] > 0 and o["plugin_none_tok_s"] > 0
    assert o["overhead_pct_spread"]["min"] <= o["overhead_pct_spread"]["max"]
    for k in ("overhead_pct", "overhead_pct_cpu", "aa_pct", "aa_pct_cpu"):  # the A/A control is reported too
        assert o[f"{k}_spread"]["min"] - 0.01 <= o[k] <= o[f"{k}_spread"]["max"] + 0.01
    assert s["none_s"] > 0 and s["ratio_spread"]["min"] <= s["ratio"] <= s["ratio_spread"]["max"]
    hp = s["h2o_parts"]  # where H2O's time goes: statistics every step, the policy and compaction per eviction
    assert hp["evictions"] >= 1 and hp["statistics_s"] > 0 and hp["policy_s"] > 0 and hp["reclaim_s"] >= 0
    assert hp["statistics_s"] + hp["policy_s"] + hp["reclaim_s"] < s["h2o_s_spread"]["max"]
    assert "H2O's extra time" in res.stdout
    t = d["throughput"]  # vanilla vs vToken H2O 0.5, lockstep rounds: the rows carry its medians
    assert t["rounds"] == 2 and t["ratio_spread"]["min"] <= t["ratio"] <= t["ratio_spread"]["max"]
    assert van["closed_loop_tok_s"] == t["vanilla_tok_s"] and vt["closed_loop_tok_s"] == t["vtoken_tok_s"]
    assert c["slack"] == "block" and s["slack"] == "block"  # the default; the variant evicts every step
    assert s["slack_variant"] == 0 and s["ratio_slack_spread"]["min"] <= s["ratio_slack"] <= s["ratio_slack_spread"]["max"]
    assert (tmp_path / "s.png").stat().st_size > 10_000
    assert "goodput" in res.stdout and "stats cost" in res.stdout and "closed-loop throughput" in res.stdout
    assert "goodput of vanilla none 0.0:" in res.stdout and "goodput of vtoken h2o 0.5:" in res.stdout
    assert "probes, rps -> attainment" in res.stdout


@pytest.mark.vllm
def test_bench_serve_goodput_max_seqs_caps_only_the_goodput_engines(tmp_path: Path) -> None:
    """The whole report with --goodput-max-seqs: the goodput searches run on capped engines of their own,
    the concurrency rows and the closed loop on the uncapped ones. With --workers 1 the report's parts (closed
    loop, overhead and statistics cost, goodput) run one after another in this process, each on engines of its
    own built after the previous part freed its."""
    out = tmp_path / "s.json"
    res = runner.invoke(app, ["bench", "serve", "--policies", "h2o", "--ratios", "0.5", "--modes", "vtoken",
                              "--requests", "5", "--prompt-tokens", "96,128", "--output-tokens", "8,12",
                              "--vanilla-target", "2", "--chunk", "64", "--step-tokens", "128", "--goodput-requests", "3",
                              "--bisect-steps", "0", "--rounds", "1", "--throughput-rounds", "1", "--goodput-max-seqs",
                              "2", "--workers", "1", "--json", str(out), "--plot", str(tmp_path / "s.png")])
    assert res.exit_code == 0, res.output
    assert "worker processes" not in res.output  # nothing spawned
    d = json.loads(out.read_text())
    rows = {(r["mode"], r["eviction_ratio"]): r for r in d["rows"]}
    assert {r["closed_loop_measure"] for r in rows.values()} == {"lockstep median"}
    assert d["overhead"]["rounds"] == 1 and d["stats_cost"]["h2o_parts"]["evictions"] >= 1
    assert d["config"]["goodput_max_seqs"] == 2 and set(rows) == {("vanilla", 0.0), ("vtoken", 0.5)}
    for r in rows.values():
        assert r["goodput_rps"] == r["goodput_search"]["goodput_rps"] >= 0
        assert all(p["running_peak"] <= 2 for p in r["goodput_search"]["probes"])
    assert rows[("vtoken", 0.5)]["max_concurrency"] >= 3  # the uncapped engine held more than the cap


@pytest.mark.vllm
def test_bench_serve_only_stats_cost_runs_the_paired_rounds_alone(tmp_path: Path) -> None:
    """`--only stats-cost`: H2O 0.5, policy none and H2O with the other slack (here ``--slack 0``: the variant
    is ``block``) run the first request alone, interleaved; the report is the full benchmark's `stats_cost`
    object (no rows, no plot)."""
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    res = runner.invoke(app, ["bench", "serve", "--only", "stats-cost", "--requests", "2", "--prompt-tokens", "96,128",
                              "--output-tokens", "8,12", "--vanilla-target", "2", "--chunk", "64", "--step-tokens",
                              "128", "--rounds", "2", "--no-rebuild", "--slack", "0", "--json", str(out), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert "rows" not in d and "overhead" not in d and not png.exists()
    s, c = d["stats_cost"], d["config"]
    assert s["rounds"] == 2 and s["requests"] == 1 and s["policy"] == "h2o" and s["eviction_ratio"] == 0.5
    assert s["slack"] == 0 and s["slack_variant"] == "block"
    assert s["none_s"] > 0 and s["h2o_s"] > 0 and s["none_cpu_s"] > 0
    for k in ("ratio", "ratio_cpu", "ratio_slack", "ratio_slack_cpu"):
        assert s[f"{k}_spread"]["min"] <= s[k] <= s[f"{k}_spread"]["max"], k
    hp = s["h2o_parts"]  # H2O evicted (a 96-128-token prompt at 0.5) and its statistics were collected
    assert hp["evictions"] >= 1 and hp["statistics_s"] > 0 and hp["policy_s"] > 0
    assert c["only"] == "stats-cost" and 96 <= c["prompt_tokens_mean"] <= 128 and c["stats_backend"]
    assert "stats cost, H2O" in res.stdout and "H2O's extra time" in res.stdout


@pytest.mark.vllm
def test_bench_serve_only_goodput_searches_vanilla_then_the_named_rows(tmp_path: Path) -> None:
    """`--only goodput`: vanilla's SLOs (from its unloaded requests, at the given multiples) and goodput, then
    each --goodput-rows row's, searched on the same rates; every probe says what its misses missed."""
    out, png = tmp_path / "g.json", tmp_path / "g.png"
    res = runner.invoke(app, ["bench", "serve", "--only", "goodput", "--requests", "4", "--prompt-tokens", "96,128",
                              "--output-tokens", "8,12", "--vanilla-target", "2", "--chunk", "64", "--step-tokens",
                              "128", "--goodput-rows", "h2o@0.5,naive:h2o@0.7", "--goodput-requests", "3",
                              "--bisect-steps", "0", "--ttft-slo-factor", "4", "--json", str(out), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert "rows" not in d and "overhead" not in d and "stats_cost" not in d and not png.exists()
    rows, c = d["goodput"], d["config"]
    assert [(r["mode"], r["policy"], r["eviction_ratio"]) for r in rows] == [
        ("vanilla", "none", 0.0), ("naive", "h2o", 0.7), ("vtoken", "h2o", 0.5)]
    assert c["only"] == "goodput" and c["ttft_slo_factor"] == 4.0
    assert c["ttft_slo_s"] == pytest.approx(4.0 * c["unloaded_ttft_s"], rel=1e-2)
    assert c["tpot_slo_s"] == pytest.approx(3.0 * c["unloaded_tpot_s"], rel=1e-2)
    for r in rows:
        g = r["goodput_search"]
        assert r["goodput_rps"] == g["goodput_rps"] >= 0 and g["probes"]
        # each row's gain is over the vanilla search run in turn with it (the first pairing's is the vanilla row)
        van_gp = (g if r["mode"] == "vanilla" else g["vanilla"])["goodput_rps"]
        assert r["goodput_gain"] == (round(r["goodput_rps"] / van_gp, 3) if van_gp else None)
        for p in g["probes"]:  # a request that met both SLOs missed neither
            assert 0 <= p["missed_ttft"] <= 3 and 0 <= p["missed_tpot"] <= 3
            assert round(p["attainment"] * 3) >= 3 - p["missed_ttft"] - p["missed_tpot"]
            assert p["attainment"] < 1 or p["missed_ttft"] == p["missed_tpot"] == 0
    # a row and its vanilla are probed in turn on one grid: both start at the prefill-bound rate
    for r in rows[1:]:
        g = r["goodput_search"]
        assert g["probes"][0]["rate_rps"] == g["vanilla"]["probes"][0]["rate_rps"] == pytest.approx(g["start_rps"], rel=1e-3)
    # the vanilla row is the search of the first pairing
    assert rows[0]["goodput_search"]["probes"] == rows[1]["goodput_search"]["vanilla"]["probes"]
    assert "goodput" in res.stdout and "SLOs: TTFT" in res.stdout and "missed TTFT" in res.stdout
    # uncapped, vanilla runs at least the two requests its KV budget holds once the rate is high enough (a
    # third may start its first chunk while they finish) ...
    assert max(p["running_peak"] for p in rows[0]["goodput_search"]["probes"]) >= 2
    # ... and --goodput-max-seqs 1 caps it (vanilla alone: --goodput-rows none)
    res = runner.invoke(app, ["bench", "serve", "--only", "goodput", "--requests", "4", "--prompt-tokens", "96,128",
                              "--output-tokens", "8,12", "--vanilla-target", "2", "--chunk", "64", "--step-tokens",
                              "128", "--goodput-rows", "none", "--goodput-requests", "3", "--bisect-steps", "0",
                              "--goodput-max-seqs", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert [r["mode"] for r in d["goodput"]] == ["vanilla"] and d["config"]["goodput_max_seqs"] == 1
    assert {p["running_peak"] for p in d["goodput"][0]["goodput_search"]["probes"]} == {1}


def test_bench_serve_rejects_a_bad_only() -> None:
    res = runner.invoke(app, ["bench", "serve", "--only", "rows"])
    assert res.exit_code == 2 and "bad option value" in res.output and "stats-cost" in res.output


def test_bench_serve_rejects_a_bad_when() -> None:
    res = runner.invoke(app, ["bench", "serve", "--when", "decode"])
    assert res.exit_code == 2 and "bad option value" in res.output


@pytest.mark.parametrize("bad", ["blocks", "-4", "1.5"])
def test_bench_serve_rejects_a_bad_slack(bad: str) -> None:
    res = runner.invoke(app, ["bench", "serve", "--slack", bad])
    assert res.exit_code == 2 and "bad option value" in res.output and "slack" in res.output


def test_bench_masks_runs_every_shipped_policy_vector_statistics_included(tmp_path: Path) -> None:
    """Policies that read keys, values or query summaries get them too (it used to stop at keydiff with a
    traceback); the unequal allocations keep what their classes say."""
    import vtoken_policies

    out = tmp_path / "masks.json"
    res = runner.invoke(app, ["bench", "masks", "--n", "256", "--batch", "1", "--layers", "2", "--heads", "2",
                              "--head-dim", "8", "--groups", "2", "--repeats", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(vtoken_policies.names())
    assert rows["ada_snapkv"]["allocation"] == "adaptive_layer" and rows["h2o"]["allocation"] == "uniform"
    assert rows["keydiff"]["kept_fraction"] == 0.5 and rows["ada_snapkv"]["kept_fraction"] == 0.5
