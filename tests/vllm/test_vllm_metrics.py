"""Every ``vtoken_*`` Prometheus counter against the figure of the component that owns it, for a known request
mix (in-process engine, chunked prefill, one request opted out, one with its own budget): the scheduler's block
manager (blocks freed, evicted tokens, truncations), the token table (tokens moved by compaction) and the
eviction driver (times, failures). Failures and rejections are counted where a test knows how many there are:
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

    def counted(rid, t):  # the block manager's own figures, per truncation
        before = mgr.evicted_tokens(rid)
        freed = truncate(rid, t)
        seen["truncations"] += 1
        seen["tokens"] += mgr.evicted_tokens(rid) - before
        seen["blocks"] += freed
        return freed

    mgr.truncate = counted
    before = _counters()
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
    assert got["blocks_freed"] == seen["blocks"] == sched.vtoken_stats["blocks_freed"] == drv["blocks_freed"]
    assert got["tokens_moved"] == cache.tokens_moved_total - moved0 == drv["tokens_moved"]
    assert got["policy_failures"] == drv["policy_failures"] == 0 and got["rejected_requests"] == 0
    for t in ("reclaim_seconds", "policy_seconds"):
        assert got[t] == pytest.approx(drv[t], rel=1e-6, abs=1e-9) and got[t] > 0, t

