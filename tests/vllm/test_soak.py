"""``vtoken-cli bench soak --minutes 1`` as CI runs it: the installed CLI in a subprocess starts its own server
(``--enforce-eager``: no compilation at start-up), sends a small bounded mix, and must exit 0 with every check
PASS and the JSON fields present (one object on stdout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FIELDS = ("requests", "completed", "rejected_400", "status_5xx", "mismatched_outputs", "kv_usage_end",
          "vtoken_counters_consistent", "rss_growth_pct", "preemptions", "p99_ttft_s", "p99_tpot_s", "checks",
          "per_kind", "server_command", "kv_blocks")


def test_one_minute_soak_passes_every_check(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-c", "from vtoken_cli.main import main; main()", "bench", "soak", "--minutes", "1",
           "--max-requests", "12", "--rate", "0.3", "--replay", "3", "--prompt-tokens", "1024,2048",
           "--warm-requests", "2", "--enforce-eager", "--json", str(out), "--server-log", str(tmp_path / "server.log")]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    wall = time.monotonic() - t0
    assert r.returncode == 0, (r.stderr[-4000:], r.stdout[-4000:])
    got = json.loads(r.stdout)
    assert got == json.loads(out.read_text())
    for f in FIELDS:
        assert f in got, f
    assert set(got["checks"].values()) == {"PASS"}, got["checks"]
    assert got["status_5xx"] == 0 and got["mismatched_outputs"] == 0 and got["kv_usage_end"] == 0
    assert got["completed"] == got["good"] > 0 and got["rejected_400"] == got["invalid_sent"] > 0
    assert got["kv_blocks"]["free"] == got["kv_blocks"]["total"] > 0 and got["kv_blocks"]["held"] == 0
    assert got["vtoken_counters_consistent"] is True and got["rss_growth_pct"] < 5
    assert got["config"]["warm_requests"] == 2
    assert len(got["rss_trajectory"]["quarters_pct"]) == 4 and got["rss_by_process"]["end"]
    assert "--dtype float32" in got["server_command"]
    # the server runs with the oneDNN cache serve sets (the worker's memory bound: docs/vllm.md, soak)
    assert got["server_env"]["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "128"
    print(f"soak wall time {wall:.0f} s")
