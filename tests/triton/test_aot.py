"""AOT compile of every shipped policy's kernels + repack + stats for sm_90 (no GPU needed): no spills."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vtoken_policies

pytestmark = pytest.mark.triton
ROOT = Path(__file__).resolve().parents[2]
RUN = "import typer; from vtoken_cli.compile_cmd import compile_policies; typer.run(compile_policies)"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=900)


def test_compile_shipped_policies_and_runtime_kernels_sm90_without_spills() -> None:
    files = [str(p) for p in vtoken_policies.files()]
    res = _cli(*files, "--target", "sm_90", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    kernels = report["kernels"]
    names = {k["kernel"] for k in kernels}
    for pol in vtoken_policies.names():
        assert {f"{pol}.pin_count", f"{pol}.select[single]", f"{pol}.select[tiled]"} <= names
    assert any(n.startswith("repack.") for n in names) and any(n.startswith("attn_stats.") for n in names)
    assert report["spilling"] == [], report["spilling"]
    assert all(k["registers"] > 0 and k["arch"] == "sm_90a" for k in kernels)


def test_emit_triton_prints_generated_source() -> None:
    res = _cli(str(vtoken_policies.path("snapkv")), "--emit", "triton")
    assert res.returncode == 0, res.stderr
    assert "def select_kernel" in res.stdout and "avg_pool(" in res.stdout


def test_compile_reports_a_broken_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import vtoken_sdk as vt\n\n@vt.policy(budget=vt.Budget(ratio=0.5))\ndef p(s):\n    return s.nope\n")
    res = _cli(str(bad), "--json", "--no-runtime-kernels")
    assert res.returncode == 1
    assert "nope" in res.stderr
