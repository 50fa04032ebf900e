"""``vtoken-cli eval ruler`` (``vtoken_bench.ruler_eval``): RULER under eviction, vtoken beside kvpress.

Fast: scoring rows, agreement, the mean table, the plot, and option errors (nothing runs).  Slow: our
prompt ids equal kvpress's own ``preprocess`` (the peer), and a two-task run of the installed CLI with
both engines whose shared methods give the same answers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vtoken_bench import models
from vtoken_bench.kvpress_check import PEER_PY
from vtoken_bench.ruler_eval import (
    FULL,
    PEER_SCRIPT,
    agreement,
    ids_sha,
    mean_table,
    plot_ruler,
    prompt_ids,
    read_answers,
    score_rows,
)
from vtoken_bench.ruler_tasks import RulerSample
from vtoken_cli.main import app

runner = CliRunner()


def _sample(task: str, index: int, answers: tuple[str, ...]) -> RulerSample:
    return RulerSample(task=task, index=index, context="ctx ", question="What is the special magic number? ",
                       answer_prefix="Answer:", answers=answers, max_new_tokens=8, length=100)


SAMPLES = [_sample("niah_single_1", 0, ("1234",)), _sample("niah_single_1", 1, ("5678",)),
           _sample("qa_1", 0, ("Paris", "paris, France"))]


def _answers(engine: str, method: str, ratio: float, texts: list[str]) -> dict:
    keys = ["niah_single_1/0", "niah_single_1/1", "qa_1/0"]
    return {(engine, k, method, ratio): t for k, t in zip(keys, texts, strict=True)}


def test_score_rows_per_task_and_mean() -> None:
    ans = {**_answers("vtoken", FULL, 0.0, ["1234", "5678", "Paris"]),
           **_answers("vtoken", "knorm", 0.5, ["1234", "no", "no"]),
           **_answers("kvpress", "knorm", 0.5, ["1234", "no", "Paris"])}
    rows = score_rows(SAMPLES, ans)
    got = {(r["engine"], r["method"], r["ratio"], r["task"]): r["score"] for r in rows}
    assert got[("vtoken", FULL, 0.0, "niah_single_1")] == 100.0
    assert got[("vtoken", "knorm", 0.5, "niah_single_1")] == 50.0
    assert got[("vtoken", "knorm", 0.5, "qa_1")] == 0.0
    assert got[("vtoken", "knorm", 0.5, "mean")] == 25.0  # mean of the task scores, not of the samples
    assert got[("kvpress", "knorm", 0.5, "mean")] == 75.0
    assert set(rows[0]) == {"engine", "method", "ratio", "task", "score"}


def test_score_rows_skip_a_configuration_missing_a_sample() -> None:
    ans = _answers("vtoken", "knorm", 0.5, ["1234", "5678", "Paris"])
    del ans[("vtoken", "qa_1/0", "knorm", 0.5)]
    assert score_rows(SAMPLES, ans) == []


def test_agreement_counts_identical_texts_and_names_the_rest() -> None:
    ans = {**_answers("vtoken", "snapkv", 0.5, ["a", "b", "c"]), **_answers("kvpress", "snapkv", 0.5, ["a", "x", "c"]),
           **_answers("vtoken", "h2o", 0.5, ["a", "b", "c"])}  # no press: no pair
    (a,) = agreement(ans)
    assert (a["method"], a["ratio"], a["samples"], a["identical"], a["differ"]) == (
        "snapkv", 0.5, 3, 2, ["niah_single_1/1"])


def test_read_answers_keeps_only_lines_for_the_current_sample_ids(tmp_path: Path) -> None:
    """``--resume`` reuses an answer only for the token ids it was computed on: a line of another seed or
    context length under the same key, a line without a fingerprint and a torn last line are left out;
    kvpress's method ``none`` is the full cache at ratio 0."""
    sha = ids_sha([1, 2, 3], [4])
    assert sha == ids_sha([1, 2, 3], [4]) and sha != ids_sha([1, 2], [3, 4]) and sha != ids_sha([1, 2, 3], [5])
    f = tmp_path / "a.jsonl"
    lines = [{"key": "qa_1/0", "sha": sha, "method": "none", "ratio": 0.0, "answer": "full"},
             {"key": "qa_1/0", "sha": sha, "method": "snapkv", "ratio": 0.5000000001, "answer": "s"},
             {"key": "qa_1/0", "sha": "0" * 16, "method": "knorm", "ratio": 0.5, "answer": "other ids"},
             {"key": "qa_1/0", "method": "tova", "ratio": 0.5, "answer": "no fingerprint"},
             {"key": "qa_1/1", "sha": sha, "method": "knorm", "ratio": 0.5, "answer": "not a current sample"}]
    f.write_text("".join(json.dumps(d) + "\n" for d in lines) + '{"key": "qa_1/0", "sha": "')
    assert read_answers(f, {"qa_1/0": sha}) == {("qa_1/0", FULL, 0.0): "full", ("qa_1/0", "snapkv", 0.5): "s"}
    assert read_answers(tmp_path / "missing.jsonl", {"qa_1/0": sha}) == {}


def test_mean_table_and_plot(tmp_path: Path) -> None:
    rows = [{"engine": e, "method": m, "ratio": r, "task": "mean", "score": s}
            for e, m, r, s in [("vtoken", FULL, 0.0, 90.0), ("vtoken", "knorm", 0.5, 60.0),
                               ("vtoken", "knorm", 0.25, 80.0), ("kvpress", FULL, 0.0, 90.0),
                               ("kvpress", "pyramidkv", 0.5, 70.0)]]
    header, body = mean_table(rows)
    assert header == ["engine", "method", "0 (full)", "0.25", "0.5", "mean over ratios"]
    assert body == [["vtoken", "knorm", "90.0", "80.0", "60.0", "70.0"], ["kvpress", "pyramidkv", "90.0", "-", "70.0",
                                                                          "70.0"]]
    cfg = {"context_tokens": 2048, "samples_per_task": 1, "tasks": ["vt"], "model": "m"}
    plot_ruler({"config": cfg, "rows": rows}, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 10_000


def test_markdown_tables_of_a_report() -> None:
    """``benchmarks/md_tables.py`` renders an ``eval ruler --json`` report for docs/benchmarks.md: the mean
    table (agreement summed over a method's ratios, on its vtoken row) and the per-task table at 0.5."""
    from vtoken_bench.md_tables import ruler

    ans = {**_answers("vtoken", FULL, 0.0, ["1234", "5678", "Paris"]),
           **_answers("kvpress", FULL, 0.0, ["1234", "5678", "Paris"]),
           **_answers("vtoken", "knorm", 0.5, ["1234", "no", "no"]), **_answers("kvpress", "knorm", 0.5, ["1234", "no", "x"]),
           **_answers("vtoken", "knorm", 0.25, ["1234", "5678", "no"]),
           **_answers("kvpress", "knorm", 0.25, ["1234", "5678", "no"])}
    cfg = {"context_tokens": 2048, "samples_per_task": 2, "tasks": ["niah_single_1", "qa_1"], "model": "m",
           "protocol": "query-agnostic"}
    md = ruler({"config": cfg, "rows": score_rows(SAMPLES, ans), "agreement": agreement(ans)})
    lines = md.splitlines()
    assert "| engine | method | 0 (full) | 0.25 | 0.5 | mean over ratios | same answer text |" in lines
    assert "| vtoken | knorm | 100.0 | 50.0 | 25.0 | 37.5 | 5/6 |" in lines  # 3/3 at 0.25, 2/3 at 0.5
    assert "| kvpress | knorm | 100.0 | 50.0 | 25.0 | 37.5 |  |" in lines
    assert "| vtoken | knorm | 50 | 0 |" in lines and "| kvpress | full | 100 | 100 |" in lines


@pytest.mark.parametrize(("args", "message"), [
    (["--tasks", "niah_single_1,nope"], "--tasks nope"),
    (["--engines", "vllm"], "--engines"),
    (["--ratios", "0.5,1.0"], "--ratios"),
    (["--ratios", "half"], "--ratios"),
])
def test_bad_options_exit_2_before_anything_runs(args: list[str], message: str, tmp_path: Path) -> None:
    res = runner.invoke(app, ["eval", "ruler", *args, "--work-dir", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert message in res.stderr
    assert not any(tmp_path.iterdir())  # nothing generated


def test_unknown_policy_exits_1_naming_it(tmp_path: Path) -> None:
    res = runner.invoke(app, ["eval", "ruler", "--policies", "no_such_policy", "--engines", "vtoken",
                              "--work-dir", str(tmp_path)])
    assert res.exit_code == 1, res.output
    assert "no_such_policy" in res.stderr and "Traceback" not in res.output


UNEQUAL_DURING_DECODE = """import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5), granularity="head", allocation=vt.AdaptiveLayer(floor=0.2))
def ada_knorm_decode(s: vt.TokenStats):
    return -s.key_norm
"""


def test_a_policy_with_unequal_budgets_evicting_in_decode_exits_1_with_the_reason_before_anything_runs(
        tmp_path: Path) -> None:
    """Per-row pages take a request once, after prefill (the shipped unequal policies run: ``when="prefill"``);
    a policy file whose unequal budget evicts during decode is refused by name before anything runs."""
    pol = tmp_path / "ada_knorm_decode.py"
    pol.write_text(UNEQUAL_DURING_DECODE)
    work = tmp_path / "work"
    res = runner.invoke(app, ["eval", "ruler", "--policies", str(pol), "--engines", "vtoken",
                              "--work-dir", str(work)])
    assert res.exit_code == 1, res.output
    assert "ada_knorm_decode" in res.stderr and "when='prefill'" in res.stderr and "Traceback" not in res.output
    assert not work.exists() or not any(work.iterdir())


# --------------------------------------------------------------------------- slow: real samples, both engines

needs_peer = pytest.mark.skipif(not PEER_PY.exists(), reason="run `make kvpress`")


@pytest.mark.slow
@needs_peer
def test_prompt_ids_equal_kvpress_preprocess(tmp_path: Path) -> None:
    """The ids both engines run are kvpress's own pipeline preprocessing (transformers 5.2 in the peer venv)
    of the same RULER samples, on every task family."""
    from transformers import AutoTokenizer

    from vtoken_bench.ruler_tasks import generate_ruler

    tok = AutoTokenizer.from_pretrained(str(models.smollm2_path()))
    samples = generate_ruler(2048, 1, tasks=["niah_multivalue", "vt", "cwe", "fwe", "qa_1"], out_dir=tmp_path / "d")
    spec = [{"key": f"{s.task}/{s.index}", "context": s.context, "question": s.question,
             "answer_prefix": s.answer_prefix, "max_new_tokens": s.max_new_tokens, "context_ids": [],
             "question_ids": []} for s in samples]
    (tmp_path / "s.json").write_text(json.dumps(spec))
    subprocess.run([str(PEER_PY), str(PEER_SCRIPT), "--model-dir", str(models.smollm2_path()), "--samples",
                    str(tmp_path / "s.json"), "--out", str(tmp_path / "o.jsonl"), "--methods", "none", "--ratios",
                    "0.5", "--dump-ids", str(tmp_path / "ids.json")], check=True, capture_output=True,
                   env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                        "HOME": os.environ.get("HOME", "/root")})
    theirs = json.loads((tmp_path / "ids.json").read_text())
    for s in samples:
        c, q = prompt_ids(tok, s)
        t = theirs[f"{s.task}/{s.index}"]
        assert (c, q) == (t["context_ids"], t["question_ids"]), s.task
        assert len(c) > 1000 and 10 < len(q) < 200  # cwe/fwe contexts are shorter than niah's


@pytest.mark.slow
@needs_peer
def test_cli_both_engines_same_answers_on_shared_methods(tmp_path: Path) -> None:
    """The installed CLI, the way a user runs it: two tasks, full cache and two shared methods at 0.5,
    both engines.  The kept sets of a shared method match kvpress's (``bench kvpress``), so the answers
    must be the same text on every sample; the JSON follows the issue's schema."""
    out = tmp_path / "r.json"
    cli = Path(sys.executable).parent / "vtoken-cli"
    res = subprocess.run([str(cli), "eval", "ruler", "--tasks", "niah_single_1,qa_1", "--samples", "1",
                          "--policies", "knorm,snapkv", "--presses", "knorm,snapkv", "--ratios", "0.5",
                          "--work-dir", str(tmp_path / "w"), "--json", str(out), "--plot", str(tmp_path / "r.png")],
                         capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    d = json.loads(out.read_text())
    assert set(d["config"]) >= {"context_tokens", "samples_per_task", "tasks", "model", "protocol"}
    assert d["config"]["context_tokens"] == 2048 and d["config"]["tasks"] == ["niah_single_1", "qa_1"]
    combos = {(r["engine"], r["method"], r["ratio"]) for r in d["rows"]}
    assert combos == {(e, m, r) for e in ("vtoken", "kvpress")
                      for m, r in ((FULL, 0.0), ("knorm", 0.5), ("snapkv", 0.5))}
    assert all(set(r) == {"engine", "method", "ratio", "task", "score"} for r in d["rows"])
    agree = {(a["method"], a["ratio"]): a for a in d["agreement"]}
    assert set(agree) == {(FULL, 0.0), ("knorm", 0.5), ("snapkv", 0.5)}
    for a in agree.values():
        assert a["identical"] == a["samples"] == 2, a
    full = {r["task"]: r["score"] for r in d["rows"] if r["method"] == FULL and r["engine"] == "vtoken"}
    assert full["niah_single_1"] == 100.0  # the full cache finds the needle at 2K
    assert "same answer text, vtoken vs kvpress, snapkv@0.5: 2/2" in res.stdout
    assert (tmp_path / "r.png").stat().st_size > 10_000

    # --resume widens the run by a ratio: only the new configurations are computed (one line each per
    # engine and sample), the stored answers come back unchanged, and the agreement holds at the new ratio.
    work = tmp_path / "w"
    before = {e: (work / f"{e}.jsonl").read_text().splitlines() for e in ("vtoken", "kvpress")}
    assert [len(v) for v in before.values()] == [6, 6]  # 2 samples x (full, knorm, snapkv)
    res = subprocess.run([str(cli), "eval", "ruler", "--tasks", "niah_single_1,qa_1", "--samples", "1",
                          "--policies", "knorm,snapkv", "--presses", "knorm,snapkv", "--ratios", "0.5,0.75",
                          "--work-dir", str(work), "--json", str(out), "--resume"],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resume: 6 vtoken answer(s)" in res.stderr and "6 kvpress answer(s)" in res.stderr
    for e, old in before.items():
        now = (work / f"{e}.jsonl").read_text().splitlines()
        assert now[:6] == old
        assert sorted((json.loads(x)["method"], json.loads(x)["ratio"]) for x in now[6:]) == \
            [("knorm", 0.75), ("knorm", 0.75), ("snapkv", 0.75), ("snapkv", 0.75)]
    d2 = json.loads(out.read_text())
    assert [r for r in d2["rows"] if r["ratio"] != 0.75] == d["rows"]
    agree = {(a["method"], a["ratio"]): a for a in d2["agreement"]}
    assert agree[("snapkv", 0.75)]["identical"] == agree[("knorm", 0.75)]["identical"] == 2
