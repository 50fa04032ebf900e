"""Check 1, ``copy_layouts``: the copy engine's CUDA path (Triton repack kernel on the engine's side stream)
on bf16 K/V views of vLLM's two layer-outermost layouts, built with ``torch.as_strided`` over one
allocation for all layers (logical view per layer ``[NB, H, bs, 2D]``; physical LBNHC = ``[NB, bs, H, 2D]``,
LBHNC = ``[NB, H, bs, 2D]``), through ``vtoken_runtime.kv_layout.LayoutCopyEngine`` (or a local fallback,
reported): compact and ordered plans x request and head granularity, random bit patterns (NaN payloads
included), byte-exact against a CPU numpy expectation that applies the plan's moves one by one in plan
order (K/V, two per-slot statistics, positions) and leaves the guard region past the last layer untouched."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .gpu_context import CheckContext, layout_engine, layout_views


def expected_moves(E: np.ndarray, stats: dict[str, np.ndarray], posn: np.ndarray, rows: np.ndarray,
                    src: np.ndarray, dst: np.ndarray, H: int, bs: int, per_head: bool) -> None:
    """Apply the moves one by one in plan order (numpy, in place): E [L, NB, H, bs, C] logical K/V,
    stats [L, H, S], positions [R, S]."""
    for r, s, d in zip(rows.tolist(), src.tolist(), dst.tolist(), strict=True):
        if per_head:
            li, h = divmod(r, H)
            E[li, d // bs, h, d % bs] = E[li, s // bs, h, s % bs]
            for t in stats.values():
                t[li, h, d] = t[li, h, s]
        else:
            E[:, d // bs, :, d % bs] = E[:, s // bs, :, s % bs]
            for t in stats.values():
                t[:, :, d] = t[:, :, s]
        posn[r, d] = posn[r, s]


LAYOUTS = ("LBNHC", "LBHNC")
PLANNERS = ("compact", "ordered")
GRANULARITIES = ("request", "head")


def copy_layout_case(ctx: CheckContext, layout: str, planner: str, gran: str) -> dict[str, Any]:
    """One case of the check: a plan of 3 requests on ``layout`` (LBNHC / LBHNC), ``planner`` (compact /
    ordered) and ``gran`` (request / head) submitted to the layout engine; ``pass`` when K/V, statistics and
    positions are byte-exact, the guard region is untouched and every job ran on the Triton runner. The case's
    ``engine`` names the engine class (``note``: why the local fallback was used, when it was)."""
    from vtoken_runtime.copy_engine import CopyPlan
    from vtoken_runtime.planner import plan_compact, plan_ordered
    from vtoken_runtime.slot_stats import SlotStore

    L, H, D, bs, NB, bpr = (2, 2, 8, 4, 12, 3) if ctx.smoke else (2, 8, 128, 16, 256, 6)
    C, S, guard = 2 * D, NB * bs, 4096
    eng_cls, eng_name, note = layout_engine()
    li, pi, gi = LAYOUTS.index(layout), PLANNERS.index(planner), GRANULARITIES.index(gran)
    seed = ctx.seed * 100 + li * 10 + pi * 2 + gi
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    per_head = gran == "head"
    R = L * H if per_head else 1
    store, views = layout_views(L, NB, H, bs, C, torch.bfloat16, ctx.dev, layout, guard)
    store.view(torch.int16).copy_(torch.randint(-2**15, 2**15, store.shape, generator=g,
                                                dtype=torch.int16).to(ctx.dev))
    ss = SlotStore(L, H, S, R, ("attn_sum", "low_attn_count"), ctx.dev)
    for t in ss.stats.values():
        t.copy_(torch.randn(t.shape, generator=g).to(ctx.dev))
    ss.positions.copy_(torch.randint(-1, 1 << 40, ss.positions.shape, generator=g).to(ctx.dev))
    eng = eng_cls(views, "generic", H, D, bs, NB, ss, per_head=per_head, async_copy=True)
    eng.gpu_runner, eng.planner_mode = ctx.runner, planner
    # a plan of 3 requests on disjoint, scattered block lists (what reclaim submits)
    perm = rng.permutation(NB)
    rows_l, src_l, dst_l = [], [], []
    for i in range(3):
        blocks = perm[i * bpr:(i + 1) * bpr]
        U = bpr * bs
        n = max(1, int(U * rng.uniform(0.3, 0.7)))
        live = np.zeros((R, U), dtype=bool)
        for r in range(R):
            live[r, rng.choice(U, n, replace=False)] = True
        r_, s_, d_ = (plan_compact if planner == "compact" else plan_ordered)(live, n)
        rows_l.append(r_)
        src_l.append(blocks[s_ // bs] * bs + s_ % bs)
        dst_l.append(blocks[d_ // bs] * bs + d_ % bs)
    plan = CopyPlan(np.concatenate(rows_l), np.concatenate(src_l).astype(np.int64),
                    np.concatenate(dst_l).astype(np.int64))
    E = np.stack([v.view(torch.int16).cpu().numpy() for v in views])  # [L, NB, H, bs, C] logical
    guard_before = store.view(torch.int16)[L * NB * bs * H * C:].cpu().numpy().copy()
    st = {k: t.cpu().numpy().view(np.int32).copy() for k, t in ss.stats.items()}
    pn = ss.positions.cpu().numpy().copy()
    expected_moves(E, st, pn, plan.rows, plan.src, plan.dst, H, bs, per_head)
    eng.submit(plan)
    eng.fence()
    ctx.sync()
    got = np.stack([v.view(torch.int16).cpu().numpy() for v in views])
    ok_kv = bool(np.array_equal(got, E))
    ok_guard = bool(np.array_equal(store.view(torch.int16)[L * NB * bs * H * C:].cpu().numpy(),
                                   guard_before))
    ok_st = all(np.array_equal(t.cpu().numpy().view(np.int32), st[k]) for k, t in ss.stats.items())
    ok_pos = bool(np.array_equal(ss.positions.cpu().numpy(), pn))
    runners = dict(eng.jobs_run)
    ok_runner = set(runners) == {"triton"}
    case = {"layout": layout, "planner": planner, "granularity": gran, "moves": plan.num_moves,
            "kv_bytes_moved": int(eng.bytes_moved), "kv_exact": ok_kv, "guard_untouched": ok_guard,
            "stats_exact": bool(ok_st), "positions_exact": ok_pos, "jobs_by_runner": runners,
            "engine_physical_layout": getattr(eng, "physical_layout", getattr(eng, "_phys", None)),
            "pass": ok_kv and ok_guard and bool(ok_st) and ok_pos and ok_runner}
    case.update(engine=eng_name, dtype="bfloat16", runner=ctx.runner, shape={"L": L, "H": H, "D": D, "bs": bs, "NB": NB})
    if note:
        case["note"] = note
    return case
