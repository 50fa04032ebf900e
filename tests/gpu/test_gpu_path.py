"""The GPU path's checks (see ``tests/gpu/__init__.py``): correctness is asserted, measured figures and
performance goals go to the report (``record``). Without CUDA every test skips (``ctx``) unless the run is a
smoke run (``VTOKEN_GPU_SMOKE=1``: tiny shapes under the Triton interpreter); the parts that need CUDA
itself (graph capture, the host-sync guard) skip on CPU even then."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from .async_steps import async_run
from .copy_layouts import GRANULARITIES, LAYOUTS, PLANNERS, copy_layout_case
from .cuda_graph import check_cuda_graph
from .decode_overhead import check_decode_overhead
from .gpu_context import CheckContext
from .kernel_bandwidth import check_kernels

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]
Record = Callable[[str, dict[str, Any]], None]


def timed(fn: Callable[..., dict[str, Any]], *a: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    res = fn(*a)
    res["seconds"] = time.perf_counter() - t0
    return res


# ---------------------------------------------------------------- 1. copy_layouts
@pytest.mark.parametrize("gran", GRANULARITIES)
@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_engine_moves_rows_byte_exact_on_vllm_layouts(ctx: CheckContext, record: Record, layout: str,
                                                           planner: str, gran: str) -> None:
    case = timed(copy_layout_case, ctx, layout, planner, gran)
    record("copy_layouts", case)
    assert case["moves"] > 0
    assert case["kv_exact"], "K/V differ from the moves applied one by one in plan order"
    assert case["guard_untouched"], "the copy wrote past the last layer"
    assert case["stats_exact"] and case["positions_exact"], "per-slot statistics or positions differ"
    assert set(case["jobs_by_runner"]) == {"triton"}, case["jobs_by_runner"]


# ---------------------------------------------------------------- 2. async_steps
@pytest.fixture(scope="module", params=[("compact", "head"), ("ordered", "request")], ids=lambda p: "-".join(p))
def async_result(request: pytest.FixtureRequest, ctx: CheckContext, record: Record) -> dict[str, Any]:
    res = timed(async_run, ctx, *request.param, 100)
    record("async_steps", res)
    return res


def test_async_copies_match_synchronous_copies(async_result: dict[str, Any]) -> None:
    r = async_result
    assert r["mismatches"] == [], r["mismatches"]
    assert r["final_state_equal"], "final K/V, statistics, positions or block counts differ between A and B"
    assert r["max_abs_diff_A_vs_B"] <= 1e-5, r["attention_calls_bit_identical"]
    assert r["max_abs_err_vs_dense"] <= r["dense_tolerance"]
    assert r["tokens_moved"] > 0
    assert set(r["A_jobs_by_runner"]) == {"triton"}, r["A_jobs_by_runner"]


def test_copy_engine_never_synchronises_the_host(ctx: CheckContext, async_result: dict[str, Any]) -> None:
    if not ctx.cuda:
        pytest.skip("needs CUDA: torch.cuda.set_sync_debug_mode has no CPU counterpart (nothing was checked)")
    sd = async_result["sync_debug"]
    assert sd["strict_errors"] == [], sd["strict_errors"]


# ---------------------------------------------------------------- 3. cuda_graph
@pytest.fixture(scope="module")
def graph_result(ctx: CheckContext, record: Record) -> dict[str, Any]:
    res = timed(check_cuda_graph, ctx)
    record("cuda_graph", res)
    return res


def test_attention_over_persistent_buffers_matches_dense(graph_result: dict[str, Any]) -> None:
    r = graph_result
    assert r["data_ptrs_unchanged"], "a persistent buffer was reallocated"
    assert r["max_abs_err_vs_dense"] <= r["tolerance"] and r["max_abs_err_vs_eager_paged"] <= r["tolerance"]
    assert r["tokens_moved"] > 0


def test_cuda_graph_replays_over_evictions(ctx: CheckContext, graph_result: dict[str, Any]) -> None:
    if not ctx.cuda:
        pytest.skip("needs CUDA: graph capture (the CPU run executed the same function eagerly)")
    assert graph_result["captured"] and graph_result["replays"] == graph_result["steps"]


# ---------------------------------------------------------------- 4. kernels
def test_kernels_match_their_torch_references(ctx: CheckContext, record: Record) -> None:
    res = timed(check_kernels, ctx)
    record("kernels", res)
    bad = [r["kernel"] for r in res["rows"] if not r["check"]]
    assert not bad, f"kernels differing from their torch reference: {bad}"


# ---------------------------------------------------------------- 5. decode_overhead
def test_decode_step_with_h2o_eviction_is_exact(ctx: CheckContext, record: Record) -> None:
    res = timed(check_decode_overhead, ctx)
    record("decode_overhead", res)
    assert res["select_matches_reference"], "the compiled H2O mask differs from the reference backend's"
    assert res["output_finite"]
    assert res["repack_moves_kv_stats_positions_together"], "K/V, attn_sum and positions did not move together"
    assert all(res["cache_consistent"].values()), res["cache_consistent"]


# ---------------------------------------------------------------- 6. row pages (issue 39), needs vLLM
@pytest.mark.parametrize("mode", ["kernels", "cache"])
def test_row_pages_through_vllms_triton_backend(ctx: CheckContext, record: Record, mode: str) -> None:
    """Per-row pages (unequal budgets) through vLLM's own Triton write and attention kernels: ``kernels`` (random
    rows, decode and chunk queries) and ``cache`` (the GPU worker's row cache end to end: handoff, mixed
    batches, a repacking eviction). Compiled on CUDA, interpreted in a smoke run. Needs vLLM, which the lent GPU
    machine does not have: there it skips, with the reason."""
    import importlib.util
    import json
    import subprocess
    import sys

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (vtoken_bench.gpu_rows_check calls vLLM's Triton kernels); not installed here")
    args = ["--cache"] if mode == "cache" else ["--cases", "12"]
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "vtoken_bench.gpu_rows_check", *args], capture_output=True, text=True,
                         timeout=900)
    got = json.loads(res.stdout.strip().splitlines()[-1]) if res.stdout.strip() else {}
    got["seconds"] = time.perf_counter() - t0
    record(f"row_pages_{mode}", got)
    assert res.returncode == 0 and got.get("pass"), (res.returncode, got, res.stderr[-2000:])
    assert got["interpreted"] == (not ctx.cuda)
