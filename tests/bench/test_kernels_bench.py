"""``benchmarks/kernels.py --section layouts`` on a tiny shape: both layouts run on the same keys (the
benchmark checks that the paired view unpacks to them) and every timing row has its ratio."""

from __future__ import annotations

import pytest

pytest.importorskip("numba")


def test_layouts_section_times_both_layouts() -> None:
    from vtoken_bench.kernels import run_layouts

    res = run_layouts(batch=2, context=80, kv_heads=2, q_heads=4, head_size=16, block_size=32, chunk=8, rounds=2)
    assert [r["step"] for r in res["rows"]] == ["decode Q=1", "prefill chunk Q=8"]
    for r in res["rows"]:
        assert r["vec_ms"]["min"] > 0 and r["amx_ms"]["min"] > 0
        assert r["amx_vs_vec"] == pytest.approx(r["amx_ms"]["median"] / r["vec_ms"]["median"])


def test_stats_section_times_the_torch_collector_against_the_kernel() -> None:
    """The "collector" row is the torch backend (on CPU, auto would pick the numba kernel: the row would time the
    kernel against itself), and each row's speedup is the ratio of its two medians."""
    from vtoken_bench.kernels import run_stats_step

    res = run_stats_step(batch=1, context=40, kv_heads=2, q_heads=4, head_size=16, block_size=8, chunk=4, rounds=2)
    assert len(res["rows"]) == 4
    for r in res["rows"]:
        assert r["collector_backend"] == "torch"
        assert r["numba_speedup"] == pytest.approx(r["collector_ms"]["median"] / r["numba_ms"]["median"])
