"""Unequal row budgets inside vLLM's CPU worker (issue 39): requests in per-row pages of vLLM's own buffer.

A policy with ``allocation=`` (AdaKV here: ``ada_snapkv``, ``ada_expected_attention``) hands each request, at
its first eviction, to :class:`~vtoken_runtime.vllm_plugin.rows.VllmRowCache`; from then on every step with a
row request writes and attends through vLLM's own CPU kernels with one sequence per (request, KV head).
Checked here on the real engine (tiny random model, float32):

* every greedy token is the argmax of the HF model when each query attends exactly the keys its row kept
  (per layer and KV head, unequal lengths), the same check as the uniform path's;
* the scheduler's block manager holds exactly the page table's blocks after every step, the pool's
  accounting adds up, and every block is back when the requests finish;
* a batch mixing row requests, an opted-out request and chunked prefills: the opted-out request's tokens
  equal vanilla vLLM's;
* preemption (recompute) returns a row request's pages and the request starts again in the token table;
* what the row path does not cover is refused at start-up by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from tests.vllm._vllm_helpers import (  # noqa: E402
    engine,
    generate,
    hf_session_generate,
    make_tiny_model,
    prompts,
    replay_gap,
    runner,
    scheduler,
    segments,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllm_rows") / "tiny")


def _watch_blocks(llm: Any) -> dict[str, Any]:
    """After every scheduler update: each running row request's held blocks (scheduler) == the page table's,
    and the pool's ``free + held == total``. Returns the record (mismatches, row requests seen, steps)."""
    run, sched = runner(llm), scheduler(llm)
    seen: dict[str, Any] = {"bad": [], "rows": set(), "unequal": set(), "steps": 0, "freed": 0}
    orig = sched.update_from_output

    def wrapped(so: Any, mro: Any) -> Any:
        out = orig(so, mro)
        rows = run._vt_rows
        seen["steps"] += 1
        for rid, st in rows.table.requests.items():
            req = sched.requests.get(rid)
            if req is None or req.status.name != "RUNNING":
                continue
            seen["rows"].add(rid)
            if len(set(st.lengths.tolist())) > 1:
                seen["unequal"].add(rid)
            if sched.held_blocks(rid) != len(st.blocks):
                seen["bad"].append((rid, sched.held_blocks(rid), len(st.blocks)))
        total, free, held = sched._vt_blocks.pool_accounts()
        if free + held != total:
            seen["bad"].append(("pool", total, free, held))
        seen["freed"] = sched.vtoken_stats["blocks_freed"]
        return out

    sched.update_from_output = wrapped
    return seen


def _all_back_and_replayed(llm: Any, model: Path, ps: list[list[int]], outs: list[list[int]]) -> tuple[float, int]:
    """Every block back in the pool once the requests finished; then the HF replay of the trace (worst logit
    gap, tokens checked)."""
    total, free, held = scheduler(llm)._vt_blocks.pool_accounts()
    assert free == total and held == 0
    run = runner(llm)
    cache = run.vtoken_cache
    return replay_gap(model, run.vtoken_trace, ps, outs, cache.num_layers, cache.num_kv_heads)


@pytest.mark.parametrize("policy", ["ada_snapkv", "ada_expected_attention"])
def test_row_requests_attend_exactly_their_rows_and_hold_the_page_tables_blocks(tiny: Path, policy: str) -> None:
    llm = engine(tiny, {"policy": policy, "eviction_ratio": 0.5, "debug": True}, blocks=64)
    run = runner(llm)
    run.vtoken_trace = {}
    seen = _watch_blocks(llm)
    ps = prompts([150, 90, 200, 61], seed=1)
    outs = generate(llm, ps, 24)
    assert run.vtoken_counters["policy_failures"] == 0
    assert len(seen["rows"]) == 4 and seen["unequal"], seen  # every request went to rows; rows really unequal
    assert not seen["bad"], seen["bad"][:5]
    assert seen["freed"] > 0  # the handoff freed tail blocks through the scheduler
    worst, checked = _all_back_and_replayed(llm, tiny, ps, outs)
    print(f"{policy}: {checked} tokens checked against the HF replay over the kept rows, worst logit gap {worst:.2e}")
    assert checked == 4 * 24 and worst < 1e-3


def test_a_mixed_batch_keeps_the_opted_out_request_exact(tiny: Path) -> None:
    """Row requests decode while others prefill in chunks, one request opts out and one asks for uniform
    allocation (``vtoken_allocation``): the opted-out one's tokens equal vanilla vLLM's, the uniform one stays
    in the token table with equal rows, and every request matches the replay of what it kept."""
    ps = prompts([300, 120, 260, 200], seed=2)
    extra: list[dict | None] = [None, None, {"enabled": False}, {"allocation": "uniform"}]
    van = engine(tiny, None, max_num_batched_tokens=128)
    ref = generate(van, ps, [20, 30, 25, 12])
    del van
    llm = engine(tiny, {"policy": "ada_snapkv", "eviction_ratio": 0.5}, max_num_batched_tokens=128)
    run = runner(llm)
    run.vtoken_trace = {}
    seen = _watch_blocks(llm)
    outs = generate(llm, ps, [20, 30, 25, 12], extra=extra)
    assert outs[2] == ref[2]
    assert len(seen["rows"]) == 2 and not seen["bad"], seen
    uni = next(t for r, t in run.vtoken_trace.items() if r.startswith("3-"))
    assert all(isinstance(p, np.ndarray) for _, _, p in uni) and uni[-1][2].shape[1] < 200 + 12  # evicted, equal rows
    cache = run.vtoken_cache
    worst, checked = replay_gap(tiny, run.vtoken_trace, ps, outs, cache.num_layers, cache.num_kv_heads)
    assert checked == sum([20, 30, 25, 12]) and worst < 1e-3


def test_bf16_rows_in_the_engines_own_layout(tiny: Path) -> None:
    """bfloat16, in the layout the engine's ISA writes (``amx`` on a CPU with AMX tiles: keys in pairs of dims per
    32-bit word, moved through the probed element maps): opted-out requests that run through the row path give
    vanilla's tokens bit for bit, and the row requests match the float32 HF replay over their kept rows up to
    bf16 noise (measured 2.3e-3 on an AMX CPU; a move with the wrong token's elements gave 3.5)."""
    ps = prompts([300, 120, 260, 200], seed=2)
    lens = [20, 30, 25, 12]
    van = engine(tiny, None, max_num_batched_tokens=128, dtype="bfloat16")
    ref = generate(van, ps, lens)
    del van
    llm = engine(tiny, {"policy": "ada_snapkv", "eviction_ratio": 0.5, "debug": True}, max_num_batched_tokens=128,
                 dtype="bfloat16")
    run = runner(llm)
    run.vtoken_trace = {}
    outs = generate(llm, ps, lens, extra=[None, {"enabled": False}, None, {"enabled": False}])
    assert outs[1] == ref[1] and outs[3] == ref[3]
    cache = run.vtoken_cache
    assert sum(isinstance(t[-1][2], list) for t in run.vtoken_trace.values()) == 2
    worst, checked = replay_gap(tiny, run.vtoken_trace, ps, outs, cache.num_layers, cache.num_kv_heads)
    print(f"bf16 (isa {run._vt_isa}): worst logit gap {worst:.2e} over {checked} tokens")
    assert checked == sum(lens) and worst < 0.05


def test_preemption_returns_a_row_requests_pages(tiny: Path) -> None:
    """A KV cache too small for every request at once: vLLM preempts (recompute); a preempted row request gives
    its pages back and starts again in the token table; every request completes and matches the replay."""
    ps = prompts([200, 220, 180, 240, 210], seed=3)
    llm = engine(tiny, {"policy": "ada_snapkv", "eviction_ratio": 0.5, "debug": True}, blocks=16,
                 max_model_len=384)
    run = runner(llm)
    run.vtoken_trace = {}
    seen = _watch_blocks(llm)
    outs = generate(llm, ps, 120)
    assert [len(o) for o in outs] == [120] * 5 and not seen["bad"], seen["bad"][:5]
    restarts = sum(len(segments(t)) - 1 for t in run.vtoken_trace.values())
    assert restarts > 0, "the cache was meant to be too small: no preemption happened"
    total, free, held = scheduler(llm)._vt_blocks.pool_accounts()
    assert free == total
    cache = run.vtoken_cache
    worst, _ = replay_gap(tiny, run.vtoken_trace, ps, outs, cache.num_layers, cache.num_kv_heads)
    assert worst < 1e-3


def test_row_budgets_that_evict_during_decode_are_refused_at_start(tiny: Path) -> None:
    with pytest.raises(Exception, match="per-row pages take a request once, after prefill"):
        engine(tiny, {"policy": "ada_snapkv", "eviction_ratio": 0.5, "when": "decode"})


STREAMING_POLICY = """
import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5, when="both"), granularity="head",
           allocation=vt.HeadClasses(retrieval=((0, 1), (1, 1)), sinks=4, recent=16))
def streaming_heads(s: vt.TokenStats):
    return s.position
"""


@pytest.fixture(scope="module")
def streaming_policy(tmp_path_factory: pytest.TempPathFactory) -> str:
    """DuoAttention-style classes on the tiny model (2 layers x 2 KV heads), evicting during decode too. KV head 1
    retrieves in both layers: under TP=2 rank 0 holds only streaming rows, rank 1 only retrieval rows, so the
    ranks need different block counts and must agree on one."""
    path = tmp_path_factory.mktemp("streaming") / "streaming_heads.py"
    path.write_text(STREAMING_POLICY)
    return str(path)


def test_streaming_rows_are_evicted_again_during_decode_exactly(tiny: Path, streaming_policy: str) -> None:
    """HeadClasses with ``when="both"``: after the handoff, every decode step takes each streaming row back to its
    4 sinks and 16 recent positions (no statistics needed), in vLLM's own buffer; retrieval rows keep every
    token. Every greedy token is the argmax of the HF replay over each step's kept rows, the block manager holds
    exactly the page table's blocks after every step, and every block is back at the end."""
    llm = engine(tiny, {"policy": streaming_policy, "debug": True}, blocks=64)
    run = runner(llm)
    run.vtoken_trace = {}
    seen = _watch_blocks(llm)
    ps = prompts([150, 90, 200], seed=6)
    outs = generate(llm, ps, 40)
    assert run.vtoken_counters["policy_failures"] == 0
    assert run.vtoken_counters["evictions"] >= 3 * 39  # the handoffs, then one per decode step and request
    assert len(seen["rows"]) == 3 and not seen["bad"], seen["bad"][:5]
    for rid, steps in run.vtoken_trace.items():
        for s, n, rows in steps:
            if n != 1:
                continue
            lens = [len(r) for r in rows]  # rows 0, 2 stream; 1, 3 retrieve (row = layer * 2 + head)
            assert lens[0] <= 21 and lens[2] <= 21 and lens[1] == lens[3] == s + 1, (rid, s, lens)
    worst, checked = _all_back_and_replayed(llm, tiny, ps, outs)
    print(f"streaming rows: {checked} tokens checked against the HF replay, worst logit gap {worst:.2e}")
    assert checked == 3 * 40 and worst < 1e-3


def test_trace_rows_are_unequal_lists(tiny: Path) -> None:
    """The trace of a row request is one array per row (what the replay above reads), not a padded matrix."""
    llm = engine(tiny, {"policy": "ada_snapkv", "eviction_ratio": 0.5})
    run = runner(llm)
    run.vtoken_trace = {}
    generate(llm, prompts([180], seed=4), 4)
    (trace,) = run.vtoken_trace.values()
    last = trace[-1][2]
    assert isinstance(last, list) and len(last) == run.vtoken_cache.num_rows
    assert all(np.all(np.diff(p) > 0) for p in last)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["ada_snapkv", "pyramidkv"])
def test_smollm2_rows_in_vllm_equal_the_hf_session(policy: str) -> None:
    """SmolLM2-135M, a 1,000-token essay prompt at 0.5: vLLM's row path and the HF session's per-row pages (issue
    38, itself equal to kvpress's kept sets) keep the same positions in every (layer, KV head) row at every
    decode step and produce the same greedy tokens."""
    from transformers import AutoTokenizer

    from vtoken_bench.essays import essay_token_requests
    from vtoken_bench.models import smollm2_path

    path = str(smollm2_path())
    (prompt,) = essay_token_requests(AutoTokenizer.from_pretrained(path), [1000], 1)
    llm = engine(path, {"policy": policy, "eviction_ratio": 0.5}, tokenizer=True, blocks=80, max_model_len=1536)
    run = runner(llm)
    run.vtoken_trace = {}
    seen = _watch_blocks(llm)
    out_vllm = generate(llm, [prompt], 24)[0]
    (trace,) = run.vtoken_trace.values()
    held = seen["bad"], len(seen["rows"])
    del llm

    out_hf, log = hf_session_generate(policy, 0.5, prompt, 24, num_blocks=80)
    ((ln, kept),) = log  # the one eviction, at the handoff
    compared = 0
    for start, n, rows in trace:
        if n != 1:
            continue
        assert isinstance(rows, list)
        want = [np.concatenate([k, np.arange(ln, start + 1)]) for k in kept]
        assert all(np.array_equal(a, b) for a, b in zip(want, rows, strict=True)), f"step at {start}"
        compared += 1
    lens = [len(k) for k in kept]
    print(f"{policy}: {compared} decode steps with identical rows (kept {min(lens)}-{max(lens)} per row)")
    assert compared == 23 and held == ([], 1)
    assert out_vllm == out_hf


def _start_trace(worker: Any) -> bool:  # runs in each worker process (collective_rpc)
    worker.model_runner.vtoken_trace = {}
    return True


def _row_trace(worker: Any) -> dict:  # by the request's index in the generate call; a row request's rows as lists
    return {rid.split("-")[0]: [(s, n, [p.tolist() for p in rows] if isinstance(rows, list) else rows.tolist())
                                for s, n, rows in steps]
            for rid, steps in worker.model_runner.vtoken_trace.items()}


@pytest.mark.parametrize("policy", ["ada_snapkv", "streaming"])
def test_tp2_ranks_keep_the_tp1_rows_and_the_same_blocks(tiny: Path, streaming_policy: str, policy: str) -> None:
    """TP=2 (the multiprocess executor, gloo): each rank holds one of the two KV heads, so a layer's AdaKV counts
    need both ranks' scores. The driver gathers every head's statistics, positions and pins, every rank selects
    the whole layer as one rank would and keeps its own head's rows; the ranks agree on the blocks held (the
    larger of their needs; vLLM has one list). Every row at every step equals TP=1's, the greedy tokens too, and
    (debug) every rank's page table holds exactly vLLM's list at every step."""
    import gc
    import os

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a test function
    ps = prompts([150, 90, 200], seed=5)
    got = {}
    for tp in (2, 1):
        kw = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
        plugin = {"policy": "ada_snapkv", "eviction_ratio": 0.5} if policy == "ada_snapkv" else \
            {"policy": streaming_policy}  # streaming rows: evicted again at every decode step, on every rank
        llm = engine(tiny, {**plugin, "debug": True}, **kw)
        try:
            llm.collective_rpc(_start_trace)
            outs = generate(llm, ps, 20)
            got[tp] = (outs, llm.collective_rpc(_row_trace))
        finally:
            del llm
            gc.collect()
    (outs2, (rank0, rank1)), (outs1, (single,)) = got[2], got[1]
    assert rank0.keys() == rank1.keys() == single.keys() and len(single) == 3
    L = 2  # the tiny model: 2 layers x 2 KV heads; rank k holds head k: TP=1 row l*2+k is row l of rank k
    unequal = 0
    for rid in single:
        a, b, c = rank0[rid], rank1[rid], single[rid]
        assert [(s, n) for s, n, _ in a] == [(s, n) for s, n, _ in b] == [(s, n) for s, n, _ in c]
        for (s, _, pa), (_, _, pb), (_, _, pc) in zip(a, b, c, strict=True):
            merged = [row for layer in range(L) for row in (pa[layer], pb[layer])]
            assert merged == list(pc), f"request {rid}: TP=2 keeps other rows than TP=1 at position {s}"
            unequal += len({len(r) for r in pc}) > 1
    assert unequal > 10  # rows of unequal lengths at many steps
    assert outs2 == outs1
