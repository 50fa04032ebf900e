"""vtoken-cli validate / list through typer's CliRunner."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.cases import sizes
from vtoken_cli.main import app

ROOT = Path(__file__).resolve().parents[2]
MALFORMED = sorted((Path(__file__).parent / "malformed").glob("*.py"))
runner = CliRunner()


def expected(path: Path) -> tuple[int, str]:
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        m = re.search(r"# EXPECT (\w+)", line)
        if m:
            return i, m.group(1)
    raise AssertionError(f"{path} has no EXPECT marker")


def test_at_least_twelve_malformed_files() -> None:
    assert len(MALFORMED) >= 12


@pytest.mark.parametrize("path", MALFORMED, ids=lambda p: p.stem)
def test_malformed_policy_exits_1_with_location_and_no_traceback(path: Path) -> None:
    line, check = expected(path)
    res = runner.invoke(app, ["validate", str(path), "--examples", "200", "--timeout", "4"])
    assert res.exit_code == 1, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert f"{path}:{line}" in res.stderr, res.stderr
    assert "Traceback" not in res.output and "Traceback" not in res.stderr
    if check in ("load", "definition"):
        assert ("error " + str(path)) in res.stderr
    else:
        assert f"check {check}" in res.stderr, res.stderr
        assert "falsifying example" in res.stderr


@sizes(fast=5, full=60)
def test_shipped_policies_validate_and_every_check_is_shown(examples: int) -> None:
    files = sorted(str(p) for p in (ROOT / "policies").glob("*.py"))
    res = runner.invoke(app, ["validate", *files, "--examples", str(examples), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["ok"] and report["failed"] == 0
    by_policy: dict[str, set[str]] = {}
    for r in report["results"]:
        by_policy.setdefault(r["policy"], set()).add(r["check"])
        assert r["status"] in ("pass", "skip") and "ok" not in r, r
        assert r["status"] == "pass" or r["check"] == "backend_equal", r  # only the Triton check may not run
    assert [report[k] for k in ("passed", "failed", "skipped")] == [
        sum(r["status"] == s for r in report["results"]) for s in ("pass", "fail", "skip")]
    assert set(by_policy) == {"h2o", "scissorhands", "random", "streaming_llm", "snapkv", "tova", "knorm", "observed_attention", "keydiff",
        "expected_attention", "chunkkv", "cur", "diverse_hitters",
        "snap_observed", "ada_snapkv", "ada_expected_attention", "pyramidkv",
        "ada_snap_observed", "duo_attention"}
    for checks in by_policy.values():
        assert checks == set(report["checks"])


MASK_POLICY = textwrap.dedent("""\
    import torch

    import vtoken_sdk as vt


    @vt.mask_policy(budget=vt.Budget(ratio=0.5), reads=("attn_sum",))
    def newest(s: vt.TokenStats, ctx: vt.MaskContext):
        valid = torch.arange(ctx.shape[-1]) < ctx.lengths[:, None, None, None]
        pos = ctx.positions.expand(ctx.shape).to(torch.float64)
        key = torch.where(ctx.pins, float("inf"), torch.where(valid, pos, float("-inf")))
        rank = key.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        return (rank < ctx.keep_count[:, None, None, None]) & valid
    """)


def _counts(line: str) -> dict[str, int]:
    """``{"passed": n, "failed": n, "skipped": n}`` from the closing line ``N passed, N failed, N skipped``."""
    m = re.fullmatch(r"(\d+) passed, (\d+) failed, (\d+) skipped", line.strip())
    assert m, line
    return dict(zip(("passed", "failed", "skipped"), map(int, m.groups()), strict=True))


def test_a_check_that_did_not_run_is_skip_not_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """backend_equal cannot run for a mask policy (torch only), nor for a score policy without CUDA or the
    Triton interpreter: SKIP in the table, counted as skipped, "status": "skip" in --json."""
    import torch

    from vtoken_sdk.checks import CHECKS

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    mask = tmp_path / "newest.py"
    mask.write_text(MASK_POLICY)
    h2o = ROOT / "policies" / "h2o.py"
    res = runner.invoke(app, ["validate", str(mask), str(h2o), "-n", "5"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    rows = {(m[0], m[1]): m[2] for m in re.findall(r"(\w+)\s+│\s+(\w+)\s+│\s+(PASS|FAIL|SKIP)\b", res.stdout)}
    h2o_backend = "PASS" if torch.cuda.is_available() else "SKIP"
    assert rows[("newest", "backend_equal")] == "SKIP" and rows[("h2o", "backend_equal")] == h2o_backend, res.stdout
    assert len(rows) == 2 * len(CHECKS) and all(v == "PASS" for k, v in rows.items() if k[1] != "backend_equal")
    skipped = 1 + (h2o_backend == "SKIP")
    assert _counts(res.stdout.strip().splitlines()[-1]) == {"passed": 2 * len(CHECKS) - skipped, "failed": 0,
                                                            "skipped": skipped}
    res = runner.invoke(app, ["validate", str(mask), "-n", "5", "--json"])
    report = json.loads(res.stdout)
    (row,) = [r for r in report["results"] if r["check"] == "backend_equal"]
    assert row["status"] == "skip" and "torch backend only" in row["detail"] and "ok" not in row
    assert (report["ok"], report["passed"], report["failed"], report["skipped"]) == (True, len(CHECKS) - 1, 0, 1)


def test_installed_cli_counts_skipped_checks_apart(tmp_path: Path) -> None:
    """The real process: a failing file, a file whose backend check does not run; exit 1, honest counts."""
    mask = tmp_path / "newest.py"
    mask.write_text(MASK_POLICY)
    bad = Path(__file__).parent / "malformed" / "drops_pin.py"
    res, _ = cli("validate", str(mask), str(bad), "-n", "5")
    assert res.returncode == 1, res.stderr
    counts = _counts(res.stdout.strip().splitlines()[-1])
    assert counts["failed"] >= 1 and counts["skipped"] >= 1, res.stdout
    assert "SKIP" in res.stdout and "skipped: " not in res.stdout
    res, _ = cli("validate", str(mask), str(bad), "-n", "5", "--json")
    report = json.loads(res.stdout)
    assert {k: report[k] for k in counts} == counts
    assert report["ok"] is False and {r["status"] for r in report["results"]} == {"pass", "fail", "skip"}


def test_json_report_on_failure(tmp_path: Path) -> None:
    res = runner.invoke(app, ["validate", str(MALFORMED[0]), "--json"])
    assert res.exit_code == 1
    assert json.loads(res.stdout)["ok"] is False


def test_usage_errors_exit_2() -> None:
    assert runner.invoke(app, ["validate"]).exit_code == 2
    assert runner.invoke(app, ["validate", "x.py", "--examples", "0"]).exit_code == 2
    assert runner.invoke(app, ["no-such-command"]).exit_code == 2


def test_missing_file_is_a_usage_error() -> None:
    res = runner.invoke(app, ["validate", "does/not/exist.py", str(ROOT / "policies" / "h2o.py")])
    assert res.exit_code == 2
    assert res.stderr.strip() == "error does/not/exist.py: no such file"
    assert res.stdout == ""  # nothing was validated


def test_directory_is_a_usage_error() -> None:
    res = runner.invoke(app, ["validate", str(ROOT / "policies"), "--json"])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "is a directory" in lines[0] and str(ROOT / "policies") in lines[0]
    assert res.stdout == "" and "Traceback" not in res.stderr


def cli(*args: str, timeout: float = 180) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the installed ``vtoken-cli`` like a user does (a real process, real exit code)."""
    exe = Path(sys.executable).with_name("vtoken-cli")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "from vtoken_cli.main import app; app()"]
    t0 = time.monotonic()
    res = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return res, time.monotonic() - t0


def test_file_that_never_finishes_loading_times_out_and_the_others_are_checked() -> None:
    loops = Path(__file__).parent / "malformed" / "loops_forever.py"
    line, _ = expected(loops)
    t0 = time.monotonic()
    res = runner.invoke(app, ["validate", str(loops), str(ROOT / "policies" / "h2o.py"), "--timeout", "2",
                              "--examples", "5", "--json"])
    assert time.monotonic() - t0 < 2 + 10
    assert res.exit_code == 1
    msg = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert msg == [f"error {loops}:{line}: loading the file timed out after 2 s (still executing this line; "
                   "raise --timeout if the file is only slow)"], res.stderr
    report = json.loads(res.stdout)
    assert [r["check"] for r in report["results"] if r["file"] == str(loops)] == ["load"]
    h2o = [r for r in report["results"] if r["policy"] == "h2o"]
    assert len(h2o) == len(report["checks"]) and all(r["status"] != "fail" for r in h2o)


def test_cli_process_does_not_hang_on_a_loop_in_c_code() -> None:
    """The installed command: a loop that holds the GIL in C is stopped too, output stays JSON."""
    loops = Path(__file__).parent / "malformed" / "loops_in_c.py"
    line, _ = expected(loops)
    res, took = cli("validate", str(loops), "policies/tova.py", "--timeout", "2", "-n", "5", "--json")
    assert res.returncode == 1, res.stderr
    assert f"error {loops}:{line}: loading the file timed out after 2 s" in res.stderr
    assert "Traceback" not in res.stderr
    report = json.loads(res.stdout)
    assert {r["policy"] for r in report["results"]} == {None, "tova"}
    assert took < 120


def test_hanging_check_times_out_and_the_next_policy_is_checked(tmp_path: Path) -> None:
    f = tmp_path / "hangs.py"
    f.write_text(textwrap.dedent("""\
        import vtoken_sdk as vt


        @vt.mask_policy(budget=vt.Budget(ratio=0.5), reads=("attn_sum",))
        def hangs(s: vt.TokenStats, ctx: vt.MaskContext):
            while True: pass


        @vt.policy(budget=vt.Budget(ratio=0.5))
        def fine(s: vt.TokenStats):
            return s.attn_sum
        """))
    t0 = time.monotonic()
    res = runner.invoke(app, ["validate", str(f), "--check-timeout", "2", "-n", "5", "--json"])
    assert time.monotonic() - t0 < 2 + 15
    assert res.exit_code == 1
    assert (f"FAIL {f}:6: policy 'hangs' check score_shape: running the check timed out after 2 s "
            "(still executing this line; raise --check-timeout if the checks are only slow)") in res.stderr
    results = json.loads(res.stdout)["results"]
    hangs = [r for r in results if r["policy"] == "hangs"]
    assert [(r["check"], r["status"]) for r in hangs] == [("definition", "pass"), ("known_stats", "pass"),
                                                           ("score_shape", "fail")]
    fine = [r for r in results if r["policy"] == "fine"]
    assert fine and all(r["status"] != "fail" for r in fine)


@pytest.mark.parametrize(("code", "where", "message"), [
    ("import os\nos._exit(3)", "", "the process loading the file exited with code 3"),
    ("import ctypes\nctypes.string_at(0)", ":2", "the process loading the file was killed by SIGSEGV"),  # faulthandler
])
def test_file_that_kills_the_interpreter_is_reported(tmp_path: Path, code: str, where: str, message: str) -> None:
    f = tmp_path / "dies.py"
    f.write_text(code + "\n")
    res = runner.invoke(app, ["validate", str(f), str(ROOT / "policies" / "h2o.py"), "-n", "5"])
    assert res.exit_code == 1
    assert f"error {f}{where}: {message}\n" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "Fatal Python error" not in res.stderr
    assert "passed, 1 failed" in res.stdout  # h2o was still checked


@pytest.mark.parametrize("name", ["numpy_ufunc", "numpy_method"])
def test_numpy_in_a_score_says_numpy_cannot_be_traced(name: str) -> None:
    path = Path(__file__).parent / "malformed" / f"{name}.py"
    line, _ = expected(path)
    res = runner.invoke(app, ["validate", str(path)])
    assert res.exit_code == 1
    first = res.stderr.splitlines()[0]
    assert first.startswith(f"error {path}:{line}: numpy cannot be traced"), res.stderr
    assert "Traceback" not in res.stderr


def test_timeout_option_is_typed_and_documented() -> None:
    assert runner.invoke(app, ["validate", "x.py", "--timeout", "soon"]).exit_code == 2
    assert runner.invoke(app, ["validate", "x.py", "--timeout", "0"]).exit_code == 2
    res = runner.invoke(app, ["validate", "--help"], env={"COLUMNS": "200"})
    assert "--timeout" in res.stdout and "--check-timeout" in res.stdout


def test_list_shows_shipped_policies() -> None:
    res = runner.invoke(app, ["list", "--json"])
    assert res.exit_code == 0
    names = {p["name"] for p in json.loads(res.stdout)}
    assert names == {"h2o", "scissorhands", "random", "streaming_llm", "snapkv", "tova", "knorm", "observed_attention", "keydiff",
        "expected_attention", "chunkkv", "cur", "diverse_hitters",
        "snap_observed", "ada_snapkv", "ada_expected_attention", "pyramidkv",
        "ada_snap_observed", "duo_attention"}
    by_name = {p["name"]: p for p in json.loads(res.stdout)}
    assert by_name["h2o"]["allocation"] == {"kind": "uniform"}
    assert by_name["ada_snapkv"]["allocation"] == {"kind": "adaptive_layer", "floor": 0.2}
    res = runner.invoke(app, ["list"])
    assert "h2o" in res.stdout and "attn_sum" in res.stdout and "adaptive_layer" in res.stdout


def test_no_args_shows_help() -> None:
    res = runner.invoke(app, [])
    assert "validate" in res.output


def test_crash_line_found_when_a_library_replaced_the_crash_handler(tmp_path: Path) -> None:
    """The parent (e.g. pytest) has faulthandler enabled, then a native library replaces the SIGSEGV
    handler (an in-process vLLM engine did): the forked child must reinstall faulthandler's handlers, not
    only swap its file, or the crash leaves an empty dump and the report loses the line."""
    import faulthandler
    import signal

    f = tmp_path / "dies.py"
    f.write_text("import ctypes\nctypes.string_at(0)\n")
    was = faulthandler.is_enabled()
    faulthandler.enable()
    old = signal.signal(signal.SIGSEGV, signal.SIG_DFL)  # faulthandler still "enabled", its handler gone
    try:
        res = runner.invoke(app, ["validate", str(f), "-n", "5"])
    finally:
        signal.signal(signal.SIGSEGV, old)
        faulthandler.disable()
        if was:
            faulthandler.enable()
    assert res.exit_code == 1
    assert f"error {f}:2: the process loading the file was killed by SIGSEGV\n" in res.stderr, res.stderr


def test_a_bad_allocation_names_its_model_and_field() -> None:
    path = Path(__file__).parent / "malformed" / "bad_allocation_floor.py"
    res = runner.invoke(app, ["validate", str(path)])
    assert res.exit_code == 1
    assert "AdaptiveLayer.floor" in res.stderr and "hint: see vtoken_sdk.AdaptiveLayer" in res.stderr
    path = Path(__file__).parent / "malformed" / "allocation_per_request.py"
    res = runner.invoke(app, ["validate", str(path)])
    assert res.exit_code == 1 and "expected granularity='head'" in res.stderr
