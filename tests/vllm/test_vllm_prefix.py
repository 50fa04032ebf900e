"""Prefix caching with eviction in vLLM's CPU worker (issue 40; design: ``vllm_plugin.prefix``, decision 9).

On the real engine (tiny random model, float32, prefix caching on, every check of ``debug`` on):

* a block in vLLM's prefix cache is never rewritten under its hash: after every scheduler step, the K/V of
  every block that carries a hash is compared with what it held when it was first seen with that hash;
* requests sharing a pinned system prompt hit it in the cache, and every greedy token is the argmax of the
  HF model over exactly the keys the request kept (the cached prefix's K/V is what a request without eviction
  computes), with eviction after the prompt and after every prefill chunk;
* a later turn of an evicted conversation hits the cache for its prefix below the first evicted position,
  and no further;
* what is not supported with prefix caching is refused at start-up by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from tests.vllm._vllm_helpers import (  # noqa: E402
    engine,
    make_tiny_model,
    prompts,
    replay_gap,
    runner,
    scheduler,
)

pytestmark = pytest.mark.vllm

BS = 32
POLICY = """
import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5), granularity="head")
def split_heads(s: vt.TokenStats):
    \"\"\"KV head 1 keeps the most recent tokens, the others the oldest.\"\"\"
    return s.position * (2.0 * (s.head == 1).float() - 1.0)
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllm_prefix") / "tiny")


def _watch_cached_blocks(llm: Any) -> dict[str, Any]:
    """After every scheduler update: each block carrying a prefix-cache hash holds the K/V (every layer) it held
    when first seen with that hash. Also records each request's first evicted position (the worker's reports)."""
    run, sched = runner(llm), scheduler(llm)
    pool = sched.kv_cache_manager.block_pool
    kv = run.vtoken_cache.kv_caches
    seen: dict[str, Any] = {"content": {}, "rewritten": [], "checked": 0, "intact": {}, "steps": 0}
    mgr = sched._vt_blocks
    orig_update, orig_truncate = sched.update_from_output, mgr.truncate

    def truncate(rid: str, t: Any, computed: int | None = None) -> int:
        seen["intact"][rid] = min(seen["intact"].get(rid, 1 << 62), t.intact)
        return orig_truncate(rid, t, computed)

    def update(so: Any, mro: Any) -> Any:
        out = orig_update(so, mro)
        seen["steps"] += 1
        for blk in pool.blocks:
            h = getattr(blk, "block_hash", None)
            if h is None:
                continue
            now = torch.stack([layer[blk.block_id] for layer in kv]).clone()
            key = (blk.block_id, h)
            before = seen["content"].setdefault(key, now)
            seen["checked"] += 1
            if not torch.equal(before, now):
                seen["rewritten"].append(key[0])
        return out

    mgr.truncate = truncate
    sched.update_from_output = update
    return seen


def _generate(llm: Any, ps: list[list[int]], max_tokens: int, extra: list[dict | None]) -> list[Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sps = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          extra_args={"vtoken": e} if e is not None else None) for e in extra]
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sps, use_tqdm=False)


@pytest.mark.parametrize("when", [None, "chunks"])
def test_a_shared_system_prompt_is_hit_never_rewritten_and_every_request_is_exact(tiny: Path, when: str | None) -> None:
    """A 128-token system prompt (pinned: ``vtoken_pinned_spans``) shared by five requests, evicted to half (the
    budget counts the pins: the shorter requests keep little more than the system prompt).
    The first request computes and offers it; the other four hit all of it; a block with a hash is never
    rewritten; each token matches the HF replay of the request's kept keys, hits included."""
    system = prompts([128], seed=7)[0]
    tails = prompts([90, 150, 60, 200, 120], seed=8)
    ps = [system + t for t in tails]
    pin = {"pinned_spans": [0, 128]}
    llm = engine(tiny, {"policy": "h2o", "eviction_ratio": 0.5, "debug": True, "when": when}, blocks=96,
                 enable_prefix_caching=True, max_num_batched_tokens=128 if when else 2048)
    run = runner(llm)
    run.vtoken_trace = {}
    seen = _watch_cached_blocks(llm)
    first = _generate(llm, ps[:1], 24, [pin])
    rest = _generate(llm, ps[1:], 24, [pin] * 4)
    outs = [list(o.outputs[0].token_ids) for o in first + rest]
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [128] * 4, [o.num_cached_tokens for o in rest]
    assert run.vtoken_counters["policy_failures"] == 0 and run.vtoken_counters["evictions"] >= 5
    assert seen["checked"] > 0 and not seen["rewritten"], seen["rewritten"][:5]
    pool = scheduler(llm).kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # every block back (cached ones are free)
    trace = run.vtoken_trace  # keyed "<index>-...": the LLM's request counter runs on across the two calls
    assert sorted(int(r.split("-")[0]) for r in trace) == [0, 1, 2, 3, 4]
    cache = run.vtoken_cache
    worst, checked = replay_gap(tiny, trace, ps, outs, cache.num_layers, cache.num_kv_heads)
    print(f"when={when}: {checked} tokens checked against the HF replay, worst logit gap {worst:.2e}; "
          f"{seen['checked']} cached-block checks over {seen['steps']} steps")
    assert checked == 5 * 24 and worst < 1e-3


def test_a_later_turn_hits_the_prefix_below_the_first_evicted_position(tiny: Path) -> None:
    """Turn 1 evicts (no pins); turn 2 (turn 1's prompt, its answer and a new message) hits exactly the whole
    blocks below turn 1's first evicted position, and is exact against the replay."""
    p1 = prompts([200], seed=11)[0]
    llm = engine(tiny, {"policy": "h2o", "eviction_ratio": 0.5, "debug": True}, blocks=96, enable_prefix_caching=True)
    run = runner(llm)
    run.vtoken_trace = {}
    seen = _watch_cached_blocks(llm)
    (t1,) = _generate(llm, [p1], 40, [None])
    (rid1,) = [r for r in run.vtoken_trace]
    first = seen["intact"][rid1]
    assert 0 <= first < 200  # turn 1 evicted inside its prompt
    p2 = p1 + list(t1.outputs[0].token_ids) + prompts([50], seed=12)[0]
    (t2,) = _generate(llm, [p2], 16, [None])
    assert t2.num_cached_tokens == first // BS * BS
    assert not seen["rewritten"]
    trace = run.vtoken_trace
    assert len(trace) == 2
    cache = run.vtoken_cache
    worst, checked = replay_gap(tiny, trace, [p1, p2], [list(t1.outputs[0].token_ids), list(t2.outputs[0].token_ids)],
                                cache.num_layers, cache.num_kv_heads)
    assert checked == 40 + 16 and worst < 1e-3


def test_an_opted_out_request_is_cached_as_vllm_caches_it_and_hits_are_shared(tiny: Path) -> None:
    """An opted-out request never evicts, so vLLM's own rule offers its blocks; an evicting request then hits
    its prefix (shared blocks, two owners in the token table's pool) and vanilla tokens come out for the
    opted-out one."""
    base = prompts([160], seed=21)[0]
    ps = [base + prompts([40], seed=22)[0], base + prompts([80], seed=23)[0]]
    van = engine(tiny, None, blocks=96)
    ref = _generate(van, ps[:1], 20, [None])
    del van
    llm = engine(tiny, {"policy": "h2o", "eviction_ratio": 0.5, "debug": True}, blocks=96, enable_prefix_caching=True)
    seen = _watch_cached_blocks(llm)
    (a,) = _generate(llm, ps[:1], 20, [{"enabled": False}])
    (b,) = _generate(llm, ps[1:], 20, [None])
    assert list(a.outputs[0].token_ids) == list(ref[0].outputs[0].token_ids)
    assert b.num_cached_tokens == 160 and not seen["rewritten"]


def test_a_repeated_prompt_hits_the_cache_and_keeps_what_its_first_run_kept(tiny: Path) -> None:
    """The budget counts the frozen prefix as it counts every pin, so a prompt sent again (prefilled in one step)
    starts with its first run's unevicted prefix frozen and keeps the same tokens at every step: the same
    output, with and without the cache hit."""
    p = prompts([230], seed=31)[0]
    extra = {"pinned_spans": [0, 64]}
    llm = engine(tiny, {"policy": "h2o", "eviction_ratio": 0.5, "debug": True}, blocks=96, enable_prefix_caching=True)
    run = runner(llm)
    run.vtoken_trace = {}
    (a,) = _generate(llm, [p], 30, [extra])
    (b,) = _generate(llm, [p], 30, [extra])
    assert a.num_cached_tokens == 0 and b.num_cached_tokens >= 64
    assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
    ta, tb = run.vtoken_trace.values()  # in the order the worker first saw them
    kept = [(s + n, live.tolist()) for s, n, live in ta]
    assert [(s + n, live.tolist()) for s, n, live in tb][1:] == kept[1:]  # the same keys at every decode step


def test_tp2_offers_only_what_every_rank_kept_and_equals_tp1(tiny: Path, tmp_path: Path) -> None:
    """TP=2 (mp executor): each rank's KV heads evict their own positions, so the first evicted
    position reported is the smallest over the ranks; the tokens and cache hits equal TP=1's, with every rank
    checking its frozen prefix in place (``debug``) and the block manager refusing any report that would free an
    offered block."""
    import gc
    import os

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # KV head 1 (rank 1's) keeps the most recent tokens, head 0 (rank 0's) the oldest: the ranks' first evicted
    # positions differ by blocks, so a report of rank 0's alone would offer blocks that rank 1 evicted in
    policy = tmp_path / "split_heads.py"
    policy.write_text(POLICY)
    system = prompts([96], seed=41)[0]
    ps = [system + t for t in prompts([150, 70, 120], seed=42)]
    got = {}
    for tp in (1, 2):
        kw = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"} if tp == 2 else {}
        llm = engine(tiny, {"policy": str(policy), "eviction_ratio": 0.5, "debug": True}, blocks=96,
                     enable_prefix_caching=True, **kw)
        pin = {"pinned_spans": [0, 64]}
        first = _generate(llm, ps[:1], 20, [pin])
        rest = _generate(llm, ps[1:], 20, [pin, pin])
        got[tp] = [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in first + rest]
        del llm
        gc.collect()
    assert got[2] == got[1], (got[1], got[2])
    assert all(c >= 64 for _, c in got[1][1:])  # the later requests hit what the first left unevicted


def test_what_prefix_caching_does_not_cover_is_refused_by_name(tiny: Path) -> None:
    from vtoken_runtime.vllm_plugin import vllm_engine_args

    assert vllm_engine_args(policy="h2o", device="cuda", enable_prefix_caching=True)["enable_prefix_caching"] is True
    with pytest.raises(ValueError, match="unequal row budgets"):
        vllm_engine_args(policy="ada_snapkv", device="cuda", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="unequal row budgets"):
        vllm_engine_args(policy="ada_snapkv", device="cpu", enable_prefix_caching=True)
    assert vllm_engine_args(policy="ada_snapkv", device="cpu")["enable_prefix_caching"] is False  # off by default
    with pytest.raises(Exception, match="unequal row budgets"):
        engine(tiny, {"policy": "ada_snapkv"}, enable_prefix_caching=True)
