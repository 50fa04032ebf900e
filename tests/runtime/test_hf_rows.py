"""Unequal budgets end to end in the HF adapter (issue 38): a policy with ``allocation=`` hands its request to
per-row pages at its eviction; greedy output equals the dense model whose KV heads each see only their own
kept positions, the blocks held are the page bound, and the blocks the rows no longer need return to the pool.
Tiny random models here; SmolLM2 with the shipped policies in the slow test."""

from __future__ import annotations

import pytest
import torch

import vtoken_policies
import vtoken_sdk as vt
from tests.cases import ALLOCATION_CASES, build, case_id
from tests.oracles.dense import dense_greedy_row_steps, dense_greedy_rows
from vtoken_bench.models import tiny_llama, tiny_qwen2
from vtoken_runtime.hf_adapter import HFSession


def _prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _at_prefill(policy: vt.Policy) -> vt.Policy:
    """Per-row pages take a request once, after prefill: the cases' budgets evict then."""
    return policy.configure(budget=policy.budget.override(when="prefill"),
                            stats=vt.StatsConfig(obs_window=8, history_window=16))


def _session(model, policy: vt.Policy, **kw) -> HFSession:
    return HFSession(model, block_size=16, num_blocks=64, stat_names=policy.stored_reads, chunk_size=32,
                     record_keeps=True, debug=True, policies=[policy], **kw)


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
@pytest.mark.parametrize("case", ALLOCATION_CASES, ids=case_id)
def test_greedy_with_unequal_rows_equals_dense_over_each_heads_kept_set(factory, case) -> None:
    model = factory()
    policy = _at_prefill(build(case))
    ids = _prompt(90)
    s = _session(model, policy)
    s.add("a", policy)
    got = s.generate(["a"], [ids], 12)[0]
    t = s.requests["a"]
    assert not t.failures and t.in_rows and "a" in s.rows
    (at, kept), = t.keep_log
    assert at == len(ids) and len(kept) == s.num_layers * s.num_kv_heads
    assert got == dense_greedy_rows(model, ids, 12, kept)
    fig = s.blocks("a")[16]
    # R4: the page bound, never above issue 38's per-layer ideal; every row holds its kept set + 11 decoded
    assert fig["vtoken"] == fig["ideal_pages"] <= fig["ideal"] <= fig["max_row"]
    assert fig["rows_live_min"] == min(k.size for k in kept) + 11
    s.cache.check_invariants()  # the pool check counts the row cache's blocks
    s.rows.check_invariants()


def test_rows_really_differ_and_free_memory_the_shared_list_would_hold() -> None:
    """HeadClasses: retrieval rows keep all 90 tokens, streaming rows 5: the shared list would hold the
    longest row's blocks (6 after 1 decode token); pages hold what the rows need."""
    model = tiny_llama()
    policy = _at_prefill(build(("knorm", {"allocation": vt.HeadClasses(retrieval=((0, 1), (1, 0)), sinks=2,
                                                                           recent=3)})))
    s = _session(model, policy)
    s.add("a", policy)
    free0 = s.cache.num_free_blocks
    s.prefill(["a"], [_prompt(90)])
    fig = s.blocks("a")[16]
    assert (fig["rows_live_min"], fig["rows_live_max"]) == (5, 90)
    assert fig["max_row"] == 6 and fig["vtoken"] == fig["ideal_pages"] < fig["max_row"]
    assert s.cache.num_free_blocks == free0 - fig["vtoken"]
    s.free("a")
    assert s.cache.num_free_blocks == free0 and "a" not in s.rows


@pytest.mark.parametrize("slack", [0, 4])
def test_streaming_rows_stay_bounded_during_decode_and_equal_dense_over_each_steps_kept_set(slack: int) -> None:
    """HeadClasses evicting during decode (``when="both"``): after the handoff at prefill, every decode step (or
    every ``slack + 1`` tokens) takes each streaming row back to its sinks and recent window, without
    statistics; retrieval rows keep every token. Greedy output equals the dense model where each row sees its
    latest kept set; streaming rows never hold more than sinks + recent + slack + 1 tokens, and the blocks
    the rows no longer need go back to the pool."""
    model = tiny_llama()
    alloc = vt.HeadClasses(retrieval=((0, 1), (1, 0)), sinks=2, recent=3)
    policy = build(("knorm", {"allocation": alloc}))
    policy = policy.configure(budget=policy.budget.override(when="both", slack=slack))
    ids = _prompt(90)
    s = _session(model, policy)
    s.add("a", policy, pinned_positions=[40])
    free0 = s.cache.num_free_blocks
    got = s.generate(["a"], [ids], 24)[0]
    t = s.requests["a"]
    assert not t.failures and t.in_rows
    log = t.keep_log
    assert log[0][0] == len(ids) and len(log) == 1 + 23 // (slack + 1)  # the handoff, then the decode evictions
    streaming = [r for r in range(s.num_layers * s.num_kv_heads) if (r // s.num_kv_heads, r % s.num_kv_heads)
                 not in alloc.retrieval]
    for at, kept in log:
        for r, k in enumerate(kept):
            if r in streaming:  # sinks 0, 1, the pin 40, the recent window
                assert k.tolist() == [0, 1, 40, at - 3, at - 2, at - 1], (at, r, k)
            else:
                assert k.tolist() == list(range(at)), (at, r)
    assert got == dense_greedy_row_steps(model, ids, 24, log)
    fig = s.blocks("a")[16]
    assert fig["rows_live_min"] <= 6 + slack + 1 and fig["rows_live_max"] == len(ids) + 23
    assert fig["vtoken"] == fig["ideal_pages"]
    s.rows.check_invariants()
    s.cache.check_invariants()
    s.free("a")
    assert s.cache.num_free_blocks == free0


def test_a_refused_cut_of_streaming_rows_fails_the_request_alone_or_stops_tensor_parallel_ranks(monkeypatch) -> None:
    """The cut's keep is the runtime's own, so a refusal is a fault: alone, the request falls back to no further
    eviction and keeps decoding; with a tensor-parallel group, a RuntimeError (the ranks would part ways)."""
    from types import SimpleNamespace

    model = tiny_llama()
    policy = build(("knorm", {"allocation": vt.HeadClasses(retrieval=((0, 1),), sinks=2, recent=3)}))
    policy = policy.configure(budget=policy.budget.override(when="both", slack=0))

    def refuse(req_id, keep):
        raise ValueError("refused for the test")

    s = _session(model, policy)
    monkeypatch.setattr(s.rows, "row_evict", refuse)
    s.add("a", policy)
    got = s.generate(["a"], [_prompt(60)], 6)[0]
    assert len(got) == 6 and s.requests["a"].failures == ["per-row eviction refused: refused for the test"]
    s2 = _session(model, policy)
    monkeypatch.setattr(s2.rows, "row_evict", refuse)
    s2.add("a", policy)
    logits = s2.prefill(["a"], [_prompt(60)])  # the handoff; then the decode cut, as one rank of a group
    assert s2.requests["a"].in_rows
    s2.driver.collective = SimpleNamespace(rank=0)
    with pytest.raises(RuntimeError, match="ranks cannot stay in step"):
        s2.decode(["a"], [int(logits[0].argmax())])


def test_a_batch_mixing_row_and_uniform_requests_equals_each_alone() -> None:
    model = tiny_qwen2()
    ada = _at_prefill(build(("h2o", {"allocation": vt.AdaptiveLayer(floor=0.2)})))
    uni = _at_prefill(build(("h2o", {})))
    p1, p2 = _prompt(70, 1), _prompt(50, 2)

    def alone(policy: vt.Policy, prompt: list[int]) -> list[int]:
        s = _session(model, policy)
        s.add("x", policy)
        return s.generate(["x"], [prompt], 8)[0]

    s = HFSession(model, block_size=16, num_blocks=64, stat_names=ada.stored_reads, chunk_size=32, debug=True,
                  policies=[ada, uni])
    s.add("ada", ada)
    s.add("uni", uni)
    s.add("none", None)
    got = s.generate(["ada", "uni", "none"], [p1, p2, p1], 8)
    assert "ada" in s.rows and "uni" not in s.rows and "none" not in s.rows
    assert got[0] == alone(ada, p1) and got[1] == alone(uni, p2)
    plain = HFSession(model, block_size=16, num_blocks=64)
    plain.add("x", None)
    assert got[2] == plain.generate(["x"], [p1], 8)[0]


def test_decode_time_eviction_with_unequal_budgets_is_refused_by_name_and_changes_nothing() -> None:
    pol = vtoken_policies.load("ada_snapkv").configure(budget=vt.Budget(ratio=0.5))  # when="both"
    s = _session(tiny_llama(), pol)
    with pytest.raises(ValueError, match="ada_snapkv.*when='both'.*when='prefill'"):
        s.add("r", pol)
    assert "r" not in s.requests and "r" not in s.driver.requests
    s.add("r", pol.configure(budget=vt.Budget(ratio=0.5, when="prefill")))  # the way out the message names
    s.prefill(["r"], [_prompt(40)])
    assert "r" in s.rows


def test_a_request_in_rows_forks_refuses_new_pins_and_keeps_decoding() -> None:
    pol = _at_prefill(build(("h2o", {"allocation": vt.AdaptiveLayer(floor=0.2)})))
    s = _session(tiny_llama(), pol)
    s.add("a", pol, pinned_positions=[0, 1])
    logits = s.prefill(["a"], [_prompt(60)])
    with pytest.raises(ValueError, match="per-row pages"):
        s.set_pins("a", [0])
    free0 = s.cache.num_free_blocks
    s.fork("a", "b")  # a copy in its own blocks, in per-row pages too
    assert "b" in s.rows and s.requests["b"].in_rows and s.cache.num_free_blocks == free0 - s.blocks("a")[16]["vtoken"]
    nxt = int(logits[0].argmax())
    la, lb = s.decode(["a"], [nxt]), s.decode(["b"], [nxt])
    torch.testing.assert_close(la, lb)  # the same rows, the same K/V: the same next logits
    s.free("b")
    assert s.cache.num_free_blocks == free0
    kept = s.requests["a"].keep_log[0][1]
    assert all({0, 1} <= set(k.tolist()) for k in kept)  # pins kept in every row
    logits = la
    for _ in range(20):  # crosses block boundaries: new pages, then a new block
        logits = s.decode(["a"], [int(logits[0].argmax())])
    assert s.logical_len("a") == 81
    s.rows.check_invariants()


def test_out_of_blocks_in_rows_is_a_memory_error() -> None:
    pol = _at_prefill(build(("h2o", {"allocation": vt.AdaptiveLayer(floor=0.2)})))
    model = tiny_llama()
    s = HFSession(model, block_size=16, num_blocks=5, stat_names=pol.stored_reads, chunk_size=32, policies=[pol])
    s.add("a", pol)
    s.prefill(["a"], [_prompt(64)])
    held = s.blocks("a")[16]["vtoken"]
    s.add("filler", None)
    s.prefill(["filler"], [_prompt(16 * (5 - held), 3)])
    assert s.cache.num_free_blocks == 0
    with pytest.raises(MemoryError, match="per-row pages"):
        for _ in range(40):
            s.decode(["a"], [1])
    s.rows.check_invariants()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ada_snapkv", "pyramidkv", "duo_attention", "ada_snap_observed",
                                  "ada_expected_attention"])
def test_smollm2_shipped_unequal_policies_are_exact_and_hold_the_page_bound(name: str) -> None:
    """SmolLM2-135M, a 1,500-token passkey prompt, the shipped policy as is: greedy output equals the dense
    replay over each head's kept set, and the request holds the page bound (adaptive: below the shared list)."""
    from vtoken_bench.essays import build_passkey
    from vtoken_bench.models import load_smollm2

    model, tok = load_smollm2()
    prompt = build_passkey(tok, 1500, 0.5, 48213)
    ids = prompt.input_ids
    pol = vtoken_policies.load(name)
    s = HFSession(model, block_size=16, num_blocks=1024, stat_names=pol.stored_reads, record_keeps=True,
                  policies=[pol])
    s.add("a", pol)
    got = s.generate(["a"], [ids], 8)[0]
    (_, kept), = s.requests["a"].keep_log
    assert got == dense_greedy_rows(model, ids, 8, kept)
    fig = s.blocks("a")[16]
    assert fig["vtoken"] == fig["ideal_pages"] <= fig["ideal"]
    total = sum(k.size for k in kept)
    if name.startswith("ada_"):  # a layer keeps H x budget tokens, shared unequally among its heads
        assert total == len(kept) * pol.budget.resolve(len(ids))
        assert fig["rows_live_min"] < fig["rows_live_max"] and fig["vtoken"] < fig["max_row"]
    else:  # pyramid: layers differ; duo: retrieval heads keep all, streaming heads 4 + 64
        assert fig["rows_live_min"] < fig["rows_live_max"]


def test_a_session_frees_its_kv_without_the_cyclic_gc() -> None:
    """No reference cycle through the handoff or the pool check: a benchmark that builds one session per
    sample must not keep each one's K/V until the cyclic GC happens to run (it ran out of memory once)."""
    import gc
    import weakref

    pol = _at_prefill(build(("h2o", {"allocation": vt.AdaptiveLayer(floor=0.2)})))
    s = _session(tiny_llama(), pol)
    s.add("a", pol)
    s.generate(["a"], [_prompt(40)], 2)
    assert "a" in s.rows
    kv = weakref.ref(s.kv_all)
    gc.collect()
    gc.disable()
    try:
        del s
        assert kv() is None
    finally:
        gc.enable()
