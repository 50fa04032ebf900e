"""vtoken-cli validate / list through typer's CliRunner."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

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
    res = runner.invoke(app, ["validate", str(path), "--examples", "200"])
    assert res.exit_code == 1, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert f"{path}:{line}" in res.stderr, res.stderr
    assert "Traceback" not in res.output and "Traceback" not in res.stderr
    if check in ("load", "definition"):
        assert ("error " + str(path)) in res.stderr
    else:
        assert f"check {check}" in res.stderr, res.stderr
        assert "falsifying example" in res.stderr


def test_shipped_policies_validate_and_every_check_is_shown() -> None:
    files = sorted(str(p) for p in (ROOT / "policies").glob("*.py"))
    res = runner.invoke(app, ["validate", *files, "--examples", "60", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["ok"]
    by_policy: dict[str, set[str]] = {}
    for r in report["results"]:
        by_policy.setdefault(r["policy"], set()).add(r["check"])
        assert r["ok"], r
    assert set(by_policy) == {"h2o", "scissorhands", "random", "streaming_llm", "snapkv", "tova", "knorm"}
    for checks in by_policy.values():
        assert checks == set(report["checks"])


def test_json_report_on_failure(tmp_path: Path) -> None:
    res = runner.invoke(app, ["validate", str(MALFORMED[0]), "--json"])
    assert res.exit_code == 1
    assert json.loads(res.stdout)["ok"] is False


def test_usage_errors_exit_2() -> None:
    assert runner.invoke(app, ["validate"]).exit_code == 2
    assert runner.invoke(app, ["validate", "x.py", "--examples", "0"]).exit_code == 2
    assert runner.invoke(app, ["no-such-command"]).exit_code == 2


def test_missing_file_is_reported() -> None:
    res = runner.invoke(app, ["validate", "does/not/exist.py"])
    assert res.exit_code == 1 and "no such file" in res.stderr


def test_list_shows_shipped_policies() -> None:
    res = runner.invoke(app, ["list", "--json"])
    assert res.exit_code == 0
    names = {p["name"] for p in json.loads(res.stdout)}
    assert names == {"h2o", "scissorhands", "random", "streaming_llm", "snapkv", "tova", "knorm"}
    res = runner.invoke(app, ["list"])
    assert "h2o" in res.stdout and "attn_sum" in res.stdout


def test_no_args_shows_help() -> None:
    res = runner.invoke(app, [])
    assert "validate" in res.output
