"""Check 2, ``async_steps``: 100 random steps of admit -> reserve -> write K/V -> attention metadata ->
``VTokenCache.attention`` (+ ``accumulate_stats``) -> random keep masks -> ``reclaim`` (plan -> copy on the
side stream) on cache A (``async_copy=True``, Triton runner, LIFO block pool so the next ``reserve`` hands
out the blocks the in-flight copy is still reading, and ``write_kv_slots`` must fence before writing into
them), against cache B (``async_copy=False``, torch runner, same decisions): attention outputs and
probabilities bit-identical every step, final K/V, statistics, positions and block counts identical, A's
outputs equal to dense attention over its live tokens. On CUDA ``torch.cuda.set_sync_debug_mode("error")``
is on inside ``CopyEngine.submit`` and ``CopyEngine.fence`` (they must never synchronise the host); every
other runtime call of the step runs under ``"warn"`` and the number of synchronising operations per call is
reported (the token table's device mirror is uploaded non-blocking from a pinned twin; the torch reference
``paged_attention`` used here reads ``max(len)`` on the host, which the vLLM path never calls)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .gpu_context import CheckContext, bits, lifo_pool, make_cache, random_keep


class SyncWatch:
    """Counts synchronising CUDA operations per runtime call ("warn"), and makes the calls that must not
    synchronise raise ("error"). Off on CPU."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.synced: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.example: dict[str, str] = {}
        self.strict_errors: list[str] = []

    def call(self, name: str, fn: Callable[..., Any], *a: Any, **k: Any) -> Any:
        self.calls[name] = self.calls.get(name, 0) + 1
        if not self.enabled:
            return fn(*a, **k)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return fn(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                hits = [w for w in caught if "synchroniz" in str(w.message).lower()]
                if hits:
                    self.synced[name] = self.synced.get(name, 0) + len(hits)
                    self.example.setdefault(name, f"{hits[0].filename}:{hits[0].lineno}")

    def strict(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*a: Any, **k: Any) -> Any:
            if not self.enabled:
                return fn(*a, **k)
            prev = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*a, **k)
            except RuntimeError as e:
                if "synchroniz" in str(e).lower():
                    self.strict_errors.append(f"{name}: {e}")
                raise
            finally:
                torch.cuda.set_sync_debug_mode(prev)

        return wrapped


def async_run(ctx: CheckContext, mode: str, gran: str, steps: int) -> dict[str, Any]:
    from vtoken_runtime.paged_attention import dense_attention

    L, H, Hq, D, bs, max_req, pmin, pmax = (2, 2, 4, 8, 4, 3, 4, 16) if ctx.smoke else (4, 8, 32, 128, 16, 8, 16, 300)
    maxb = math.ceil((pmax + steps) / bs) + 1
    NB = max_req * maxb + 2
    pools = [lifo_pool(NB), lifo_pool(NB)]
    A, info = make_cache(ctx, L, H, D, bs, NB, mode, gran, True, ctx.runner, pools[0], max_req, maxb)
    B, _ = make_cache(ctx, L, H, D, bs, NB, mode, gran, False, "torch", pools[1], max_req, maxb)
    watch = SyncWatch(ctx.cuda)
    A.engine.submit = watch.strict("CopyEngine.submit", A.engine.submit)
    A.engine.fence = watch.strict("CopyEngine.fence", A.engine.fence)
    rng = np.random.default_rng(ctx.seed + 7)
    g = torch.Generator().manual_seed(ctx.seed + 7)
    active: list[int] = []
    next_id, pins = 0, 2
    mismatches: list[str] = []
    max_err = 0.0
    reused_in_flight = tokens_moved = blocks_freed = evicted = exact_outputs = 0
    max_ab = 0.0

    def rnd(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(ctx.dev, dtype)

    for step in range(steps):
        new: dict[int, int] = {}
        if len(active) < max_req and (not active or rng.random() < 0.3):
            rid, next_id = next_id, next_id + 1
            for c in (A, B):
                c.add_request(rid, range(pins))
            new[rid] = int(rng.integers(pmin, pmax + 1))
            active.append(rid)
        if len(active) > 1 and rng.random() < 0.05:
            rid = active.pop(int(rng.integers(len(active))))
            new.pop(rid, None)
            watch.call("free", A.free, rid)
            B.free(rid)
        for rid in active:
            t = new.get(rid, 1)
            in_flight, hits = A.engine.in_flight, pools[0].hits
            sa = watch.call("reserve", A.reserve, rid, t)
            sb = B.reserve(rid, t)
            if sa is None or sb is None:
                raise RuntimeError(f"step {step}: pool exhausted (sizing bug in the check)")
            if in_flight:
                reused_in_flight += pools[0].hits - hits
            if not np.array_equal(sa, sb):
                mismatches.append(f"step {step}: reserve slots differ")
            for layer in range(L):
                k, v = rnd(t, H, D), rnd(t, H, D)
                watch.call("write_kv_slots", A.write_kv_slots, layer, sa, k, v)
                B.write_kv_slots(layer, sb, k, v)
        md_a = watch.call("attention_metadata", A.attention_metadata, active)
        md_b = B.attention_metadata(active)
        q = rnd(len(active), 1, Hq, D, dtype=torch.float32)
        qpos = torch.tensor([[A.logical_len(r) - 1] for r in active], dtype=torch.int64, device=ctx.dev)
        for layer in range(L):
            oa, pa = watch.call("attention", A.attention, layer, q, md_a, qpos, return_probs=True)
            ob, pb = B.attention(layer, q, md_b, qpos, return_probs=True)
            # what attention read must be bit-identical; its result is compared with a tolerance too, so
            # that a non-deterministic library kernel cannot pass for a copy race (both are reported)
            if torch.equal(oa, ob) and torch.equal(pa, pb):
                exact_outputs += 1
            max_ab = max(max_ab, float((oa - ob).abs().max()), float((pa - pb).abs().max()))
            watch.call("accumulate_stats", A.accumulate_stats, "attn_sum", layer, md_a, pa.sum(2))
            B.accumulate_stats("attn_sum", layer, md_b, pb.sum(2))
            for i, rid in enumerate(active):
                xa, xb = A.gather_kv(layer, rid), B.gather_kv(layer, rid)
                if not all(torch.equal(bits(u), bits(w)) for u, w in zip(xa, xb, strict=True)):
                    mismatches.append(f"step {step} layer {layer} request {rid}: live K/V or positions differ")
                kp, kk, vv = xa
                ref = dense_attention(q[i], kk, vv, qpos[i], kp)
                max_err = max(max_err, float((oa[i] - ref).abs().max()))
        for rid in active:
            if rng.random() < 0.5:
                pos_a, _ = A.live_view(rid)
                keep = random_keep(rng, pos_a, pins)
                if keep is not None:
                    evicted += watch.call("apply_keep_mask", A.apply_keep_mask, rid, keep)
                    B.apply_keep_mask(rid, keep)
        ra = watch.call("reclaim", A.reclaim)
        rb = B.reclaim()
        if (ra.tokens_moved, ra.blocks_freed) != (rb.tokens_moved, rb.blocks_freed):
            mismatches.append(f"step {step}: reclaim differs {ra} vs {rb}")
        tokens_moved += ra.tokens_moved
        blocks_freed += ra.blocks_freed
    final_ok = True
    for rid in active:
        for layer in range(L):
            xa, xb = A.gather_kv(layer, rid), B.gather_kv(layer, rid)
            final_ok &= all(torch.equal(bits(a), bits(b)) for a, b in zip(xa, xb, strict=True))
        sa, sb = A.gather_stats(rid), B.gather_stats(rid)
        final_ok &= all(torch.equal(sa[k], sb[k]) for k in sa)
        final_ok &= A.held_blocks(rid) == B.held_blocks(rid)
    final_ok &= A.num_free_blocks == B.num_free_blocks
    A.check_invariants()
    B.check_invariants()
    A.close()
    B.close()
    tol = 1e-3
    ok = not mismatches and final_ok and max_err <= tol and max_ab <= 1e-5 and not watch.strict_errors
    ok &= set(A.engine.jobs_run) <= {"triton"} and bool(A.engine.jobs_run)
    res: dict[str, Any] = {
        "mode": mode, "granularity": gran, "steps": steps, "layers": L, "kv_heads": H, "head_size": D,
        "block_size": bs, "layout": info["layout"], "A": f"async_copy=True, gpu_runner={ctx.runner}",
        "B": "async_copy=False, gpu_runner=torch", "requests_admitted": next_id, "tokens_evicted": evicted,
        "tokens_moved": tokens_moved, "blocks_freed": blocks_freed, "freed_blocks_reused": pools[0].hits,
        "reused_while_copy_in_flight": reused_in_flight, "A_jobs_by_runner": dict(A.engine.jobs_run),
        "B_jobs_by_runner": dict(B.engine.jobs_run), "mismatches": mismatches[:5], "final_state_equal": bool(final_ok),
        "attention_calls_bit_identical": f"{exact_outputs}/{steps * L}", "max_abs_diff_A_vs_B": max_ab,
        "max_abs_err_vs_dense": max_err, "dense_tolerance": tol, "pass": bool(ok)}
    if ctx.cuda:
        res["sync_debug"] = {"error_mode_inside": ["CopyEngine.submit", "CopyEngine.fence"],
                             "strict_errors": watch.strict_errors, "warn_mode_calls": watch.calls,
                             "synchronising_ops_per_call": watch.synced, "first_sync_site": watch.example}
    else:
        res["sync_debug"] = {"skipped": "no CUDA"}
    return res
