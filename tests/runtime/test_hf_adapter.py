"""The HF transformers adapter: exactness, accounting, failure isolation (tiny models + SmolLM2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vtoken_policies
import vtoken_sdk as vt
from tests.cases import CASES, build, case_id
from tests.oracles.dense import dense_greedy
from vtoken_bench.models import tiny_llama, tiny_qwen2
from vtoken_runtime._debug import InvariantError
from vtoken_runtime.hf_adapter import HFSession
from vtoken_sdk.selection import select


def _prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _small(policy: vt.Policy) -> vt.Policy:
    """Scale a shipped policy's protection to tiny prompts."""
    protect = [vt.recent(8)] if policy.name == "snapkv" else [vt.sinks(2), vt.recent(4)]
    return policy.configure(protect=protect, stats=vt.StatsConfig(obs_window=8, history_window=16))


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_paged_without_eviction_equals_hf_dense(factory) -> None:
    model = factory()
    ids = _prompt(70)
    s = HFSession(model, block_size=16, num_blocks=32, chunk_size=24)
    s.add("a", None)
    assert s.generate(["a"], [ids], 10)[0] == dense_greedy(model, ids, 10)


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("mode", ["compact", "ordered"])
def test_compacted_greedy_equals_dense_restricted_to_kept_sets(factory, case, mode) -> None:
    model = factory()
    policy = _small(build(case))
    ids = _prompt(90)
    s = HFSession(model, block_size=16, num_blocks=64, mode=mode, stat_names=policy.stored_reads, chunk_size=32,
                  record_keeps=True, debug=True)
    s.add("a", policy)
    got = s.generate(["a"], [ids], 12)[0]
    log = s.requests["a"].keep_log
    assert log, "the policy never evicted"
    assert got == dense_greedy(model, ids, 12, log)
    assert not s.requests["a"].failures


@pytest.mark.parametrize("name", ["h2o", "streaming_llm", "tova"])
@pytest.mark.parametrize("granularity", ["head", "request"])
def test_eviction_during_chunked_prefill_is_exact_and_bounds_the_peak(name: str, granularity: str) -> None:
    """``Budget(when="chunks")``: eviction after every prefill chunk. Greedy tokens equal the dense model fed
    the same chunks with each recorded kept set applied at its boundary, and no request ever holds more
    than its budget plus one chunk (the point of the option)."""
    model = tiny_llama()
    pol = _small(vtoken_policies.load(name))
    pol = pol.configure(budget=pol.budget.override(when="chunks"), granularity=granularity)
    ids = _prompt(150)
    chunk = 24
    s = HFSession(model, block_size=8, num_blocks=96, stat_names=pol.stored_reads, chunk_size=chunk,
                  record_keeps=True, debug=True)
    s.add("a", pol)
    peak = 0
    forward = s.forward

    def watched(req_ids, tokens, all_logits=False):  # noqa: ANN001, ANN202 - the session's own signature
        nonlocal peak
        out = forward(req_ids, tokens, all_logits)
        peak = max(peak, s.cache.live_tokens("a"))
        return out

    s.forward = watched  # type: ignore[method-assign]
    got = s.generate(["a"], [ids], 10)[0]
    log = s.requests["a"].keep_log
    boundaries = [n for n, _ in log if n < len(ids)]
    assert len(boundaries) >= 4, f"expected evictions between chunks, got kept sets at {[n for n, _ in log]}"
    assert got == dense_greedy(model, ids, 10, log, chunk_size=chunk)
    budget_at_end = pol.budget.resolve(len(ids))
    assert peak <= budget_at_end + chunk, (peak, budget_at_end)
    # after prefill: exactly the budget (every chunk evicted down to it)
    assert not s.requests["a"].failures


@pytest.mark.parametrize("granularity", ["head", "request"])
def test_block_accounting_exact_after_every_step(granularity: str) -> None:
    model = tiny_llama()
    pol = vtoken_policies.load("h2o").configure(granularity=granularity, protect=[vt.sinks(2), vt.recent(4)])
    s = HFSession(model, block_size=16, num_blocks=128, granularity=granularity, stat_names=pol.stored_reads,
                  follower_block_sizes=(32, 48), chunk_size=40)
    s.add("a", pol)
    s.add("b", None)
    prompts = [_prompt(100, 2), _prompt(60, 3)]
    logits = s.prefill(["a", "b"], prompts)
    for _ in range(40):
        for bs, fig in s.blocks("a").items():
            assert fig["vtoken"] == fig["ideal"] == -(-s.cache.live_tokens("a") // 16 * 16 // bs) or \
                fig["vtoken"] == -(-s.cache.live_tokens("a") // bs)
            assert fig["vtoken"] <= fig["naive"] <= fig["full"]
        assert s.blocks("b")[16]["vtoken"] == -(-s.cache.logical_len("b") // 16)
        logits = s.decode(["a", "b"], logits.argmax(-1).tolist())
    assert s.cache.live_tokens("a") == pol.budget.resolve(s.cache.logical_len("a"))


def test_failing_policy_only_affects_its_own_request(caplog) -> None:
    @vt.mask_policy(budget=vt.Budget(ratio=0.5), reads=("attn_sum",))
    def broken(s: vt.TokenStats, ctx: vt.MaskContext):
        raise ZeroDivisionError("policy bug")

    @vt.mask_policy(budget=vt.Budget(ratio=0.5), reads=("attn_sum",), protect=[vt.sinks(4)])
    def drops_pins(s: vt.TokenStats, ctx: vt.MaskContext):
        last_k = torch.arange(ctx.shape[-1]) >= ctx.lengths[:, None, None, None] - ctx.keep_count[:, None, None, None]
        return (last_k & (torch.arange(ctx.shape[-1]) < ctx.lengths[:, None, None, None])).expand(ctx.shape)

    model = tiny_llama()
    h2o = _small(vtoken_policies.load("h2o"))
    s = HFSession(model, block_size=16, num_blocks=64, stat_names=("attn_sum",), chunk_size=32)
    for r, p in (("bad", broken), ("pins", drops_pins), ("good", h2o)):
        s.add(r, p)
    ids = _prompt(64)
    outs = s.generate(["bad", "pins", "good"], [ids, ids, ids], 6)
    assert s.requests["bad"].failures and "ZeroDivisionError" in s.requests["bad"].failures[0]
    assert s.requests["pins"].failures and "pinned" in s.requests["pins"].failures[0]
    assert not s.requests["good"].failures
    assert s.cache.live_tokens("bad") == s.cache.logical_len("bad")  # fell back to no eviction
    assert s.cache.live_tokens("good") < s.cache.logical_len("good")
    ref = HFSession(model, block_size=16, num_blocks=64, chunk_size=32)
    ref.add("x", None)
    assert outs[0] == ref.generate(["x"], [ids], 6)[0]  # the failing request is served as if no policy ran


@pytest.mark.parametrize("fault", [InvariantError("I2", "injected"), torch.OutOfMemoryError("injected: out of memory"),
                                   RuntimeError("CUDA error: device-side assert triggered (injected)")],
                         ids=["invariant", "oom", "device"])
def test_runtime_faults_inside_the_step_propagate(fault: Exception) -> None:
    """A broken invariant, an out-of-memory or a device error raised while the step selects is not the
    policy's bug: it propagates (the batched call and the per-request retry alike) instead of becoming a
    silent per-request fallback over a state nobody can trust."""

    @vt.mask_policy(budget=vt.Budget(ratio=0.5), reads=("attn_sum",))
    def faulty(s: vt.TokenStats, ctx: vt.MaskContext):
        raise fault

    model = tiny_llama()
    s = HFSession(model, block_size=16, num_blocks=64, stat_names=("attn_sum",), chunk_size=32)
    s.add("a", faulty)
    s.add("b", _small(vtoken_policies.load("h2o")))
    with pytest.raises(type(fault), match="injected"):
        s.prefill(["a", "b"], [_prompt(48), _prompt(40, 2)])
    assert not s.requests["a"].failures and s.driver.counters["policy_failures"] == 0


# ------------------------------------------------------------------ one policy object shared by many requests
RAISE_AT, BREAK_AT = 20, 24  # per-request budget overrides that single out one request each (keep_count)


def _shared_policy(raise_at: int | None, break_at: int | None, error: type[Exception] = RuntimeError) -> vt.Policy:
    """ONE mask policy for every request: pins, then the most recent tokens. It raises ``error`` when a request
    of its batch must keep ``raise_at`` tokens, and drops the pins of a request that must keep ``break_at``."""

    @vt.mask_policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(2)], granularity="head")
    def recent(s: vt.TokenStats, ctx: vt.MaskContext):
        b, l_, h, n = ctx.shape
        if raise_at is not None and bool((ctx.keep_count == raise_at).any()):
            raise error(f"policy bug: a request keeping {raise_at} tokens")
        score = ctx.positions.expand(b, l_, h, n).reshape(b, l_ * h, n).to(torch.float32)
        keep = select(score, ctx.lengths, ctx.pins.reshape(b, l_ * h, n), ctx.keep_count).reshape(b, l_, h, n)
        if break_at is not None:
            keep = torch.where((ctx.keep_count == break_at)[:, None, None, None], keep & ~ctx.pins, keep)
        return keep

    return recent


@pytest.mark.parametrize("failing", [("raise",), ("break", "refuse"), ("raise", "break", "refuse")],
                         ids="+".join)
def test_one_shared_policy_failing_for_one_request_leaves_the_others_evicting(failing: tuple[str, ...],
                                                                              monkeypatch) -> None:
    """Requests share ONE policy object (so one batched call); only some fail: the policy raises on one
    ("raise"), breaks the contract on another ("break"), or the cache refuses its mask ("refuse": the
    cache's public ``apply_keep_mask`` raises its misuse error for that request). The others, before
    and after them in the batch, keep evicting at every step with exact outputs."""
    model = tiny_llama()
    bs, steps = 16, 8
    policy = _shared_policy(RAISE_AT if "raise" in failing else None, BREAK_AT if "break" in failing else None)
    # (request, prompt length, per-request budget, role); good requests keep >= 28 tokens, never 20 / 24
    specs = [("a", 70, None, "good"), ("raiser", 64, RAISE_AT, "raise"), ("b", 66, 28, "good"),
             ("broken", 62, BREAK_AT, "break"), ("refused", 72, None, "refuse"), ("c", 61, None, "good")]
    specs = [x for x in specs if x[3] == "good" or x[3] in failing]
    rids = [x[0] for x in specs]
    prompts = [_prompt(n, seed=10 + i) for i, (_, n, _, _) in enumerate(specs)]
    s = HFSession(model, block_size=bs, num_blocks=96, chunk_size=32, record_keeps=True, debug=True)
    for r, _, budget, _ in specs:
        s.add(r, policy, budget=budget)
    apply = s.cache.apply_keep_mask

    def refusing(req_id, keep):  # the cache refuses one request's masks (as it does a mask that drops a pin)
        if req_id == "refused":
            raise ValueError(f"request {req_id!r}: keep mask refused (injected by the test)")
        return apply(req_id, keep)

    monkeypatch.setattr(s.cache, "apply_keep_mask", refusing)

    def check_step() -> None:
        for r, _, budget, role in specs:
            live, seq = s.cache.live_tokens(r), s.cache.logical_len(r)
            assert s.cache.held_blocks(r) == -(-live // bs), r  # compacted after every eviction
            fails = s.requests[r].failures
            if role == "good":
                assert not fails, (r, fails)
                assert live == (budget if budget is not None else (seq + 1) // 2), (r, live, seq)  # 0.5, half up
            else:
                assert fails, f"{r} should have failed"
                assert live == seq, f"{r} failed, so it keeps its whole cache"
                assert {"raise": "policy bug", "break": "pinned", "refuse": "refused"}[role] in fails[0], fails

    outs: list[list[int]] = [[] for _ in rids]
    logits = s.prefill(rids, prompts)
    for step in range(steps):
        check_step()
        for o, t in zip(outs, logits.argmax(-1).tolist(), strict=True):
            o.append(int(t))
        if step < steps - 1:
            logits = s.decode(rids, [o[-1] for o in outs])
    for (r, _, _, role), p, o in zip(specs, prompts, outs, strict=True):
        log = s.requests[r].keep_log
        if role == "good":  # ratio 0.5 evicts at every other step, a fixed budget at every step
            assert len(log) >= steps // 2, f"{r} evicted at only {len(log)} steps"
        assert o == dense_greedy(model, p, steps, log), f"{r}: greedy tokens differ from dense over its kept sets"


@pytest.mark.parametrize("error", [ValueError, ZeroDivisionError])
def test_policy_errors_fall_back_for_their_request_only(error: type[Exception]) -> None:
    """What user code raises (here while scoring one request of a shared batch) fails that request only: the
    batched call is retried per request and the others evict as their budgets say."""
    model = tiny_llama()
    s = HFSession(model, block_size=16, num_blocks=64, chunk_size=32)
    policy = _shared_policy(RAISE_AT, None, error)
    for r, budget in (("a", 28), ("raiser", RAISE_AT), ("b", None)):
        s.add(r, policy, budget=budget)
    s.prefill(["a", "raiser", "b"], [_prompt(64, 1), _prompt(60, 2), _prompt(62, 3)])
    fails = s.requests["raiser"].failures
    assert fails and f"{error.__name__}: policy bug" in fails[0], fails
    assert s.cache.live_tokens("raiser") == 60
    assert (s.cache.live_tokens("a"), s.cache.live_tokens("b")) == (28, 31)
    assert not s.requests["a"].failures and not s.requests["b"].failures


def test_request_pins_are_honoured() -> None:
    model = tiny_llama()
    s = HFSession(model, block_size=16, num_blocks=64, stat_names=("attn_sum",), chunk_size=32)
    s.add("a", _small(vtoken_policies.load("h2o")), pinned_positions=range(10, 30))
    s.generate(["a"], [_prompt(80)], 8)
    pos, _ = s.cache.live_view("a")
    assert all(np.isin(np.arange(10, 30), row).all() for row in pos)


def test_stats_config_conflict_is_refused() -> None:
    s = HFSession(tiny_llama(), block_size=16, num_blocks=16, stat_names=("attn_window",))
    snap = vtoken_policies.load("snapkv")
    s.add("a", snap)
    with pytest.raises(ValueError, match="obs_window"):
        s.add("b", snap.configure(stats=vt.StatsConfig(obs_window=8)))


def test_policy_needing_uncollected_stats_is_refused() -> None:
    s = HFSession(tiny_llama(), block_size=16, num_blocks=16, stat_names=())
    with pytest.raises(ValueError, match="attn_sum"):
        s.add("a", vtoken_policies.load("h2o"))


# ------------------------------------------------------------------ SmolLM2 (real model)


@pytest.fixture(scope="module")
def smollm2():
    from vtoken_bench.models import load_smollm2

    return load_smollm2()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["h2o", "tova", "snapkv"])
def test_smollm2_compacted_greedy_equals_dense_restricted(smollm2, name: str) -> None:
    from vtoken_bench.essays import essay_token_requests

    model, tok = smollm2
    prompt = essay_token_requests(tok, [384], 1, offset=5000)[0]
    pol = vtoken_policies.load(name).configure(budget=vt.Budget.evict(0.5))
    s = HFSession(model, block_size=16, num_blocks=128, stat_names=pol.stored_reads, chunk_size=128, record_keeps=True)
    s.add("a", pol)
    got = s.generate(["a"], [prompt], 16)[0]
    assert got == dense_greedy(model, prompt, 16, s.requests["a"].keep_log)
    assert s.blocks("a")[16]["vtoken"] == -(-s.cache.live_tokens("a") // 16)


@pytest.mark.slow
def test_smollm2_passkey_with_full_cache(smollm2) -> None:
    from vtoken_bench.essays import build_passkey, parse_passkey

    model, tok = smollm2
    hits = 0
    for i, depth in enumerate((0.1, 0.5, 0.9)):
        p = build_passkey(tok, 2048, depth, 31337 + 1111 * i, filler_offset=20_000 + 3_000 * i)
        s = HFSession(model, block_size=16, num_blocks=140, chunk_size=512)
        s.add("a", None)
        out = s.generate(["a"], [p.input_ids], 8)[0]
        hits += parse_passkey(tok.decode(out)) == p.passkey
    assert hits >= 2, f"full-cache passkey retrieval {hits}/3"
