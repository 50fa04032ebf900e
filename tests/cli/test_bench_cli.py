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
    assert "ppl (evict once)" in res.stdout and "ppl (evict every step)" in res.stdout
