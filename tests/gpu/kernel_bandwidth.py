"""Check 4, ``kernels``: ``benchmarks/gpu_kernels.py``'s select (single, tiled), repack (compact, ordered) and
statistics kernels against their torch references, with bandwidth as a fraction of a device-to-device copy
of the same bytes (goal >= :data:`KERNEL_GOAL`, reported, never failed on)."""

from __future__ import annotations

from typing import Any

from .gpu_context import CheckContext

KERNEL_GOAL = 0.70  # kernel bandwidth / device copy bandwidth


def check_kernels(ctx: CheckContext) -> dict[str, Any]:
    from vtoken_bench import gpu_kernels as gk

    measure = gk.timer(ctx.dev, 1 if ctx.smoke else 20)
    rows = (gk.bench_select(ctx.dev, measure, ctx.smoke) + gk.bench_repack(ctx.dev, measure, ctx.smoke)
            + gk.bench_stats(ctx.dev, measure, ctx.smoke))
    for r in rows:
        r["x_copy"] = r["GBps"] / r["copy_GBps"] if r["copy_GBps"] else 0.0
        r["goal_met"] = r["x_copy"] >= KERNEL_GOAL
    return {"rows": rows, "goal": f"bandwidth >= {KERNEL_GOAL} x a device copy of the same bytes",
            "goal_met": all(r["goal_met"] for r in rows),
            "note": "repack[ordered] moves every byte twice (gather to scratch, scatter) but counts it once",
            "pass": all(bool(r["check"]) for r in rows)}
