"""``vtoken-cli bench prefix`` (``vtoken_bench.serve_prefix``): serving with prefix caching on, vanilla vLLM
against vToken, on SmolLM2. Fast: the option check. Slow: a small run of both traces whose figures must say
what the design promises (the system prompt is hit as often as vanilla hits it; eviction frees blocks)."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from vtoken_cli.main import app

pytestmark = pytest.mark.vllm


def test_an_unknown_policy_is_exit_2_before_anything_runs() -> None:
    res = CliRunner().invoke(app, ["bench", "prefix", "--policy", "nope"])
    assert res.exit_code == 2 and "--policy 'nope'" in res.output


def test_too_few_goodput_requests_is_exit_2() -> None:
    res = CliRunner().invoke(app, ["bench", "prefix", "--goodput-requests", "2"])
    assert res.exit_code == 2 and "goodput-requests" in res.output


@pytest.mark.parametrize("value", ["256", "320,256", "0,4", "a,b", "1,2,3"])
def test_a_bad_token_range_is_exit_2_naming_the_option(value: str) -> None:
    res = CliRunner().invoke(app, ["bench", "prefix", "--output-tokens", value])
    assert res.exit_code == 2 and "--output-tokens" in res.output and "LO" in res.output


def test_neither_closed_loop_nor_goodput_is_exit_1_before_anything_runs() -> None:
    res = CliRunner().invoke(app, ["bench", "prefix", "--no-closed-loop", "--no-goodput"])
    assert res.exit_code == 1 and "nothing to run" in res.output


@pytest.mark.slow
def test_a_small_run_hits_the_shared_prompt_like_vanilla_and_frees_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from vtoken_bench.models import smollm2_path
    from vtoken_bench.serve_config import ENV
    from vtoken_bench.serve_prefix import PrefixConfig, run_prefix_bench

    for k, v in ENV.items():  # the benchmark sets its environment (VLLM_LOGGING_LEVEL=WARNING, ...): not for the
        monkeypatch.setenv(k, os.environ.get(k, v))  # servers later tests start, which read vLLM's INFO lines

    cfg = PrefixConfig(system_tokens=256, question_tokens=(400, 500), output_tokens=(24, 32), num_requests=6,
                       conversations=2, turns=2, message_tokens=(200, 260), answer_tokens=(16, 24), rounds=2,
                       dtype="float32", max_num_seqs=16, chunk_tokens=256, goodput_requests=6, max_ladder=2,
                       bisect_steps=0, goodput_confirm=1)
    r = run_prefix_bench(str(smollm2_path()), cfg, log=lambda m: None)
    assert {x["engine"] for x in r["rows"]} == {"vanilla", "none", "h2o@0.5"}
    assert len(r["rows"]) == 3 * (2 + 1) and len(r["overhead_none"]["ratios"]) == 2
    s = r["summary"]["shared"]["median"]
    # 5 of 6 requests hit the 256-token system prompt: about 5 x 256 of 6 x ~706 prompt tokens
    assert s["vanilla"]["hit_rate"] > 0.25 and s["none"]["hit_rate"] == s["vanilla"]["hit_rate"]
    assert s["h2o@0.5"]["hit_rate"] >= s["vanilla"]["hit_rate"] - 0.05
    assert s["h2o@0.5"]["blocks_freed"] > 0 and s["vanilla"]["blocks_freed"] == 0
    c = r["summary"]["chat"]["median"]
    assert c["vanilla"]["hit_rate"] > 0.3 and c["h2o@0.5"]["hit_rate"] > 0.1  # turn 2 hits turn 1 (pinned system)

    # goodput: the searches probe the same rates from the same start, each goodput is a rate it probed and passed,
    # vanilla meets SLOs of 5x / 3x its own unloaded latency at the lowest rates, and only the evicting engine
    # frees blocks (it pins the system prompt as in the closed loop)
    g = r["goodput"]
    assert g["requests"] == 6 and g["slo"]["ttft_slo_s"] > 0 and g["slo"]["tpot_slo_s"] > 0
    van, ev = g["engines"]["vanilla"], g["engines"]["h2o@0.5"]
    assert van["probes"][0]["rate_rps"] == ev["probes"][0]["rate_rps"] == round(g["unloaded"]["start_rps"], 4)
    for e in (van, ev):
        passed = {p["rate_rps"] for p in e["probes"] if p["attainment"] >= 0.9}
        assert e["goodput_rps"] == 0 or e["goodput_rps"] in passed
        assert all(len(v) == 1 for v in e["confirm"].values())
    assert van["goodput_rps"] > 0
    assert all(p["blocks_freed"] == 0 for p in van["probes"]) and any(p["blocks_freed"] > 0 for p in ev["probes"])
    assert g["goodput_x"] == round(ev["goodput_rps"] / van["goodput_rps"], 3)



@pytest.mark.slow
def test_three_engines_start_in_one_process() -> None:
    """vanilla, then a vToken engine, then another, SmolLM2 in its own dtype with prefix caching (what ``bench
    prefix`` builds), in a fresh process: the third start used to fail in vLLM's kernel-rebinding scan on
    llvmlite's ``ffi.lib`` (the fix ran before numba had imported ``llvmlite.binding``, so it found nothing
    to fix: ``_numba_compat.make_llvmlite_scan_safe``)."""
    import subprocess
    import sys

    code = """
from vtoken_bench.models import smollm2_path
from vtoken_bench.serve_prefix import PrefixConfig, build
for plugin in (None, {"policy": "none", "device": "cpu"}, {"policy": "h2o", "device": "cpu"}):
    llm = build(str(smollm2_path()), PrefixConfig(), 80, 2048, plugin)
print("three engines started")
"""
    out = subprocess.run([sys.executable, "-c", code], timeout=600, capture_output=True, text=True)
    assert out.returncode == 0 and "three engines started" in out.stdout, out.stderr[-3000:]
