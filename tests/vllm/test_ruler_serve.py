"""RULER through the serving path (``vtoken_bench.ruler_serve``): RULER's own client (``call_api.py`` of
``nvidia-long-context-eval``) against ``vtoken-cli serve``, compared with the in-process path.

Fast: the request body RULER's client sends, the server's start-up line, the token-level explanation of a
difference, the command's error path. Slow (vllm): the real server (StreamingLLM at eviction ratio 0.5,
float32, compiled as served) and ``call_api.py`` on niah_single_1 and qa_1, one sample each: the predictions
equal the in-process ones, the scores are equal, the prompt ids equal the server's ``/tokenize``, and the
server's eviction counters equal the in-process driver's (same evictions, row-tokens and moves).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from vtoken_bench.ruler_serve import explain_difference, parse_server_protocol

RULER_MODULES = ("long_context_eval", "wonderwords", "nltk", "punkt", "tenacity", "tiktoken", "requests")
missing = [m for m in RULER_MODULES if importlib.util.find_spec(m) is None]
needs_ruler = pytest.mark.skipif(bool(missing), reason=f"RULER's package or its imports missing: {missing}")


class _Tok:
    def decode(self, ids, skip_special_tokens: bool = False) -> str:  # noqa: ANN001
        return "".join(f"<{i}>" for i in ids)


def test_explanation_names_the_first_differing_token_and_both_gaps() -> None:
    server = [5, 6, 7, 8]
    server_top = [{5: -0.1}, {6: -0.2}, {7: -0.70, 9: -0.71, 3: -5.0}, {8: -0.1}]
    mine = [5, 6, 9, 1]
    mine_top = [([5, 4], [3.0, 1.0]), ([6, 4], [2.0, 1.0]), ([9, 7, 3], [4.02, 4.0, 1.0]), ([1, 2], [1.0, 0.0])]
    x = explain_difference(_Tok(), server, server_top, mine, mine_top)
    assert x["first_diff_step"] == 2
    assert x["server_token"] == {"id": 7, "text": "<7>"} and x["in_process_token"] == {"id": 9, "text": "<9>"}
    assert x["common_prefix"] == "<5><6>"
    assert x["server_gap"]["gap"] == pytest.approx(0.01) and not x["server_gap"]["bound"]
    assert x["in_process_gap"]["gap"] == pytest.approx(0.02) and not x["in_process_gap"]["bound"]
    # the other side's token outside a top list: a lower bound
    y = explain_difference(_Tok(), [5, 6, 7], [{5: 0.0}, {6: 0.0}, {7: -0.5, 3: -2.0}], mine, mine_top)
    assert y["server_gap"] == {"gap": pytest.approx(1.5), "bound": True, "note": y["server_gap"]["note"]}
    assert explain_difference(_Tok(), [5, 6], [{}, {}], [5, 6], [])["first_diff_step"] is None
    assert explain_difference(_Tok(), [5, 6], [{}, {}], [5, 6, 2], [])["first_diff_step"] == 2


def test_server_protocol_line() -> None:
    line = ("(Worker pid=1) INFO 12-05 16:25:07 [worker.py:178] vtoken: policy=streaming_llm budget(eviction_ratio=0.5 "
            "slack=block when=both) granularity=request statistics=none; mode=compact; KV cache 182 blocks x 128 "
            "tokens, 30 layers x 3 KV heads on this rank")
    assert parse_server_protocol("x\n" + line + "\n") == {
        "policy_line": "policy=streaming_llm budget(eviction_ratio=0.5 slack=block when=both) granularity=request "
                       "statistics=none", "mode": "compact", "kv_blocks": 182, "block_size": 128}
    with pytest.raises(ValueError, match="KV cache"):
        parse_server_protocol("vtoken: policy=h2o budget(eviction_ratio=0.5) granularity=head statistics=none")


@needs_ruler
def test_client_body_is_greedy_without_top_k() -> None:
    from vtoken_bench.ruler_serve import call_api_command, client_body

    body = client_body("PROMPT", "/m", 128)
    assert body == {"prompt": "PROMPT", "temperature": 0.0, "top_p": 1.0, "stop": [], "model": "/m",
                    "max_tokens": 128, "seed": 0}
    cmd = call_api_command("qa_1", Path("/d"), Path("/s"), "http://127.0.0.1:1/v1/completions", "/m")
    assert cmd[1].endswith("long_context_eval/pred/call_api.py")
    assert cmd[2:] == ["--server_type", "generic_oai_server", "--generic_oai_server_url",
                       "http://127.0.0.1:1/v1/completions", "--generic_oai_server_mode", "completion",
                       "--model_name_or_path", "/m", "--temperature", "0", "--threads", "1", "--data_dir", "/d",
                       "--save_dir", "/s", "--task", "qa_1"]


def test_command_errors_are_one_line_exit_1(tmp_path: Path) -> None:
    from vtoken_cli.eval_ruler_serve_cmd import eval_ruler_serve

    app = typer.Typer()
    app.command()(eval_ruler_serve)
    r = CliRunner().invoke(app, ["--tasks", "niah_single_1,nope", "--work-dir", str(tmp_path)])
    assert r.exit_code == 1
    assert "unknown ['nope']" in r.output and "valid tasks" in r.output
    r = CliRunner().invoke(app, ["--policy", "none", "--work-dir", str(tmp_path)])
    assert r.exit_code == 1 and "evicts nothing" in r.output


@needs_ruler
@pytest.mark.vllm
@pytest.mark.slow
def test_call_api_against_the_server_equals_the_in_process_path(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from vtoken_bench.ruler_serve import run_ruler_serve

    t0 = time.monotonic()
    res = run_ruler_serve(["niah_single_1", "qa_1"], 1, "streaming_llm", 0.5, work_dir=tmp_path)
    wall = time.monotonic() - t0
    assert res["protocol"]["policy_line"] == res["protocol"]["in_process_policy"]
    assert "slack=block when=both" in res["protocol"]["policy_line"] and res["protocol"]["block_size"] == 128
    assert res["protocol"]["prompt_ids_equal_server_tokenize"]
    assert res["total"] == 2
    for row in res["samples"]:
        assert row["server_pred"] == row["in_process_pred"], row
        assert row["server_score"] == row["in_process_score"]
    assert res["identical"] == 2 and res["differences"] == []
    assert res["scores"]["server"] == res["scores"]["in_process"]
    assert res["scores"]["server"]["niah_single_1"] == 100.0  # the needle is in the recent half StreamingLLM keeps
    for task, e in res["evictions"].items():  # the same phases, budgets and kept sets
        assert e["server"]["evictions"] >= 1, task
        for k in ("evictions", "tokens_evicted", "tokens_moved"):
            assert e["server"][k] == e["in_process"][k], (task, k, e)
    for task in ("niah_single_1", "qa_1"):
        assert (tmp_path / "pred" / f"{task}.jsonl").is_file()  # written by RULER's client
    print(f"ruler-serve wall time {wall:.0f} s: {res['seconds']}")
