"""Every ``vtoken_*`` Prometheus counter against the figure of the component that owns it, for a known request
mix (in-process engine, chunked prefill, one request opted out, one with its own budget): the scheduler's block
manager (blocks freed that stay freed, evicted tokens, truncations), the token table (tokens moved by
compaction) and the eviction driver (times, failures). ``vtoken_blocks_freed_total`` leaves out blocks a request
takes back at its next step (slack 0 with a budget of whole blocks: one every decode step). Failures and rejections are counted where a test knows how many there are:
``test_vllm_plugin.py::test_policy_error_fails_only_its_request`` and
``test_vllm_engine.py::test_bad_requests_then_good_ones_in_process``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.vllm._vllm_helpers import engine, generate, make_tiny_model, metric, prompts, runner, scheduler  # noqa: E402

pytestmark = pytest.mark.vllm

NAMES = ("tokens_evicted", "blocks_freed", "tokens_moved", "evictions", "policy_failures", "reclaim_seconds",
         "policy_seconds", "rejected_requests")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllm_metrics") / "tiny")


def _counters() -> dict[str, float]:
    return {n: metric(f"vtoken_{n}_total") for n in NAMES}


def test_every_counter_matches_its_owner(tiny: Path) -> None:
    llm = engine(tiny, {"policy": "h2o", "mode": "compact", "debug": True}, max_num_batched_tokens=48)
    sched, run = scheduler(llm), runner(llm)
    (mgr,) = sched.kv_cache_manager.coordinator.single_type_managers
    truncate = mgr.truncate
    seen = {"truncations": 0, "tokens": 0, "blocks": 0}

    def counted(rid, t, computed=None):  # the block manager's own figures, per truncation
        before = mgr.evicted_tokens(rid)
        freed = truncate(rid, t, computed)
        seen["truncations"] += 1
        seen["tokens"] += mgr.evicted_tokens(rid) - before
        seen["blocks"] += freed
        return freed

    mgr.truncate = counted
    before = _counters()
    kept0 = mgr.blocks_kept_freed
    cache = run.vtoken_cache
    moved0 = cache.tokens_moved_total
    extra = [None, {"enabled": False}, {"budget_tokens": 50}, None]
    outs = generate(llm, prompts([100, 150, 120, 70], seed=4), [40, 24, 30, 33], extra=extra)
    assert [len(o) for o in outs] == [40, 24, 30, 33]
    got = {k: v - before[k] for k, v in _counters().items()}
    drv = run.vtoken_counters
    rows = cache.num_rows  # every row of a request evicts as many tokens: row-tokens = rows x tokens
    assert seen["truncations"] > 10 and seen["blocks"] > 0 and cache.tokens_moved_total > moved0, seen
    assert got["evictions"] == seen["truncations"] == drv["evictions"]
    assert got["tokens_evicted"] == rows * seen["tokens"] == drv["tokens_evicted"]
    assert seen["blocks"] == sched.vtoken_stats["blocks_freed"] == drv["blocks_freed"]  # every block freed
    assert got["blocks_freed"] == mgr.blocks_kept_freed - kept0 and 0 < got["blocks_freed"] <= seen["blocks"]
    assert got["tokens_moved"] == cache.tokens_moved_total - moved0 == drv["tokens_moved"]
    assert got["policy_failures"] == drv["policy_failures"] == 0 and got["rejected_requests"] == 0
    for t in ("reclaim_seconds", "policy_seconds"):
        assert got[t] == pytest.approx(drv[t], rel=1e-6, abs=1e-9) and got[t] > 0, t


def test_blocks_freed_counts_only_blocks_that_stay_freed(tiny: Path) -> None:
    """Slack 0 and a budget of whole blocks (64 tokens = 2 blocks of 32): every decode step opens a third block
    and eviction frees it again. Those are not counted: what stays freed is, per request, the blocks it held at
    its peak (the prompt) less the blocks it holds when it finishes."""
    llm = engine(tiny, {"policy": "h2o", "budget_tokens": 64, "slack": 0})
    (mgr,) = scheduler(llm).kv_cache_manager.coordinator.single_type_managers
    peak: dict[str, int] = {}
    final: dict[str, int] = {}
    allocate, pop = mgr.allocate_new_blocks, mgr.pop_blocks_for_free

    def allocated(rid, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        new = allocate(rid, *a, **kw)
        peak[rid] = max(peak.get(rid, 0), mgr.held_blocks(rid))
        return new

    def popped(rid):  # noqa: ANN001, ANN202
        final[rid] = mgr.held_blocks(rid)
        return pop(rid)

    mgr.allocate_new_blocks, mgr.pop_blocks_for_free = allocated, popped
    before, raw0, kept0 = metric("vtoken_blocks_freed_total"), mgr.blocks_freed, mgr.blocks_kept_freed
    steps = [40, 30]
    outs = generate(llm, prompts([150, 200], seed=7), steps)
    assert [len(o) for o in outs] == steps and set(final) == set(peak) and len(final) == 2
    got = metric("vtoken_blocks_freed_total") - before
    raw = mgr.blocks_freed - raw0
    assert got == mgr.blocks_kept_freed - kept0 == sum(peak[r] - final[r] for r in final) > 0
    assert raw >= got + sum(steps) - 2 * len(steps)  # the block taken and given back at (nearly) every decode step


def test_block_pool_gauges_follow_the_pool_and_end_empty(tiny: Path) -> None:
    """``vtoken_kv_blocks_total`` / ``_free`` / ``_held`` (the soak's leak check): after every allocation, tail
    free and request free the gauges equal the pool's own free count and the manager's lists, ``free + held ==
    total``; once the requests finish (one opted out, one with its own budget) ``free == total`` and ``held == 0``."""
    from prometheus_client import REGISTRY

    llm = engine(tiny, {"policy": "h2o", "mode": "compact"}, max_num_batched_tokens=48)
    (mgr,) = scheduler(llm).kv_cache_manager.coordinator.single_type_managers
    seen: list[tuple[float, ...]] = []
    record = mgr._record_pool

    def recorded() -> None:
        record()
        g = tuple(REGISTRY.get_sample_value(f"vtoken_kv_blocks_{k}") for k in ("total", "free", "held"))
        assert g == tuple(float(x) for x in mgr.pool_accounts())
        seen.append(g)

    mgr._record_pool = recorded
    outs = generate(llm, prompts([100, 150, 120], seed=5), [30, 20, 25],
                    extra=[None, {"enabled": False}, {"budget_tokens": 50}])
    assert [len(o) for o in outs] == [30, 20, 25]
    assert len(seen) > 10 and any(h > 0 for _, _, h in seen)
    assert all(f + h == t for t, f, h in seen), seen
    total, free, held = seen[-1]
    assert free == total == mgr.block_pool.num_gpu_blocks - 1 and held == 0
