"""Asynchronous scheduling (issue 40): vLLM schedules step N + 1 before step N's output arrives, so the worker's
eviction report of step N reaches the scheduler after step N + 1 was scheduled with the blocks the request held
before that eviction.

What must hold: the scheduler keeps the blocks step N + 1 writes (``truncate``'s ``computed``), the runner's rows
follow the scheduler's truncated lists (``SchedulerOutput.vtoken_rows``: the way a resumed request's list is sent
breaks here, the runner rebuilding its output tokens from the scheduler's copy, which lacks the tokens in flight),
every freed block is handed out only after the runner is done with it, and the outputs are those of synchronous
scheduling, token for token.

vLLM's CPU platform switches asynchronous scheduling off by itself; :func:`cpu_async_scheduling` undoes that one
assignment so vLLM's real asynchronous engine (``AsyncScheduler``, the batch queue of two, the V1 runner's
asynchronous outputs) runs here, in process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from tests.vllm._vllm_helpers import (  # noqa: E402
    core,
    cpu_async_scheduling,
    engine,
    generate,
    make_tiny_model,
    prompts,
    replay_gap,
    runner,
    scheduler,
    traced_run,
    watch_runner_rows,
)

pytestmark = pytest.mark.vllm

# more requests than the 24 blocks hold at once: freed blocks are handed to other requests while the first
# ones decode, and vLLM chunks the prompts (48 tokens a step)
LENGTHS = [150, 100, 190, 70, 130, 120]
MAX_TOKENS = [40, 24, 33, 50, 28, 36]
ENGINE = {"blocks": 24, "max_num_batched_tokens": 48, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllm_async") / "tiny")


def _engine(model: Path, plugin: dict[str, Any] | None, asynchronous: bool, **kw: Any) -> Any:
    if asynchronous:
        with cpu_async_scheduling():
            return engine(model, plugin, async_scheduling=True, **kw)
    return engine(model, plugin, async_scheduling=False, **kw)


def _free_at_end(llm: Any) -> tuple[int, int]:
    pool = scheduler(llm).kv_cache_manager.block_pool
    return pool.get_num_free_blocks(), pool.num_gpu_blocks - 1


def test_vllm_runs_asynchronously_on_this_cpu(tiny: Path) -> None:
    """The premise of this module: with the platform's switch undone, vanilla vLLM runs its asynchronous engine
    here (``AsyncScheduler``, a batch queue of two) and gives the synchronous engine's tokens."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    ps = prompts(LENGTHS, seed=3)
    llm = _engine(tiny, None, True, **ENGINE)
    assert isinstance(scheduler(llm), AsyncScheduler) and core(llm).batch_queue_size == 2
    assert runner(llm).use_async_scheduling
    got = generate(llm, ps, MAX_TOKENS)
    del llm
    llm = _engine(tiny, None, False, **ENGINE)
    assert not isinstance(scheduler(llm), AsyncScheduler) and core(llm).batch_queue is None
    assert got == generate(llm, ps, MAX_TOKENS)


@pytest.mark.parametrize("plugin", [
    {"policy": "h2o", "mode": "compact", "eviction_ratio": 0.5},
    {"policy": "scissorhands", "mode": "ordered", "eviction_ratio": 0.6},
], ids=["h2o", "scissorhands-ordered"])
def test_async_scheduling_gives_the_synchronous_tokens(tiny: Path, plugin: dict[str, Any]) -> None:
    """Same prompts, same policy: asynchronous scheduling evicts (reports read, blocks freed), runs on
    :class:`VTokenAsyncScheduler`, gives every token synchronous scheduling gives, and ends with every block
    back in the pool. ``debug`` on: the runtime's invariant checks run at every step."""
    from vtoken_runtime.vllm_plugin.scheduler import VTokenAsyncScheduler, VTokenScheduler

    ps = prompts(LENGTHS, seed=5)
    plugin = {**plugin, "debug": True}
    outs, stats = {}, {}
    for asynchronous in (True, False):
        llm = _engine(tiny, plugin, asynchronous, **ENGINE)
        sched = scheduler(llm)
        assert isinstance(sched, VTokenAsyncScheduler) is asynchronous and isinstance(sched, VTokenScheduler)
        outs[asynchronous] = generate(llm, ps, MAX_TOKENS)
        stats[asynchronous] = dict(sched.vtoken_stats)
        free, total = _free_at_end(llm)
        assert free == total, f"async={asynchronous}: {total - free} blocks still held after every request ended"
        del llm
    assert stats[True]["reports"] > 10 and stats[True]["blocks_freed"] > 5, stats
    assert outs[True] == outs[False]


def test_runner_rows_follow_the_scheduler_under_async_scheduling(tiny: Path) -> None:
    """The runner's copies of each request's block list (its block-table row and ``requests[rid].block_ids``)
    equal the scheduler's list after every state update, with reports read a step late and rows sent in
    ``vtoken_rows``; and a block on a running request's list is never on another's (a block freed by a late
    report and handed out again while the runner still used it would show as one)."""
    llm = _engine(tiny, {"policy": "h2o", "mode": "compact", "eviction_ratio": 0.5}, True, **ENGINE)
    seen = watch_runner_rows(llm)
    generate(llm, prompts(LENGTHS, seed=1), MAX_TOKENS)
    assert seen["checked"] > 20 and seen["rows_sent"] > 0 and not seen["bad"], seen["bad"][:3]


def test_evicting_per_chunk_async_tokens_are_the_argmax_of_the_hf_replay(tiny: Path) -> None:
    """H2O evicting after every 48-token prefill chunk and every decode step. Its kept sets depend on where the
    chunks end, and vLLM's asynchronous scheduler, a step ahead, splits the step's token budget differently by
    itself (measured here: two of the six prompts are chunked differently; vanilla's tokens do not depend on it).
    So: a request chunked as in the synchronous run gets the synchronous run's tokens, and every generated token
    of the asynchronous run is the argmax of the HF model attending exactly the keys the engine's trace says each
    query attended."""
    ps = prompts(LENGTHS, seed=5)
    plugin = {"policy": "h2o", "mode": "compact", "eviction_ratio": 0.5, "when": "chunks", "debug": True}
    kw = {"blocks": ENGINE["blocks"], "max_num_batched_tokens": 48, "max_num_seqs": 4}
    with cpu_async_scheduling():
        outs, traces = traced_run(tiny, plugin, ps, max_tokens=30, async_scheduling=True, **kw)
    outs_sync, traces_sync = traced_run(tiny, plugin, ps, max_tokens=30, async_scheduling=False, **kw)

    def chunks(trace: dict[str, list]) -> list[list[tuple[int, int]]]:
        rids = sorted(trace, key=lambda r: int(r.split("-")[0]))
        return [[(s, n) for s, n, _ in trace[r]] for r in rids]

    same = [i for i, (a, b) in enumerate(zip(chunks(traces[0]), chunks(traces_sync[0]), strict=True)) if a == b]
    assert len(same) >= 3, same
    assert [outs[i] for i in same] == [outs_sync[i] for i in same]
    trace = {rid: [(s, n, np.asarray(pos)) for s, n, pos in steps] for rid, steps in traces[0].items()}
    worst, checked = replay_gap(tiny, trace, ps, outs, 2, 2)
    assert checked == len(ps) * 30 and worst < 1e-3, (worst, checked)


def test_prefix_caching_under_async_scheduling_offers_only_frozen_blocks(tiny: Path) -> None:
    """Prefix caching on (vLLM's default) with asynchronous scheduling: the scheduler offers a block to the prefix
    cache only once the worker has frozen it, though the report of the step in flight has not arrived (an offer
    counted from the scheduled tokens would include blocks the step in flight may still evict in: measured, the
    first report after such an offer asked to free an offered block). A pinned 128-token system prompt shared by
    five requests evicting after every 64-token chunk: a block with a hash is never rewritten, the later requests
    hit the system prompt, and every token (hits included) is the argmax of the HF replay of the keys the
    request attended."""
    from tests.vllm.test_vllm_prefix import _generate, _watch_cached_blocks

    system = prompts([128], seed=7)[0]
    tails = prompts([90, 150, 60, 200, 120], seed=8)
    ps = [system + t for t in tails]
    with cpu_async_scheduling():
        llm = engine(tiny, {"policy": "h2o", "eviction_ratio": 0.5, "debug": True, "when": "chunks"}, blocks=96,
                     enable_prefix_caching=True, max_num_batched_tokens=64, async_scheduling=True)
    run = runner(llm)
    run.vtoken_trace = {}
    seen = _watch_cached_blocks(llm)
    pin = {"pinned_spans": [0, 128]}
    first = _generate(llm, ps[:1], 24, [pin])
    rest = _generate(llm, ps[1:], 24, [pin] * 4)
    outs = [list(o.outputs[0].token_ids) for o in first + rest]
    assert [o.num_cached_tokens for o in rest] == [128] * 4, [o.num_cached_tokens for o in rest]
    assert run.vtoken_counters["evictions"] >= 10
    assert seen["checked"] > 0 and not seen["rewritten"], seen["rewritten"][:5]
    worst, checked = replay_gap(tiny, run.vtoken_trace, ps, outs, 2, 2)
    assert checked == 5 * 24 and worst < 1e-3, (worst, checked)
