"""Check 3, ``cuda_graph``: a static-width paged attention over the cache's persistent buffers (K/V views,
per-slot positions, the block tables / cache lengths that ``attention_metadata`` writes in place) captured
once in a ``torch.cuda.CUDAGraph`` and replayed for 50 evict/reclaim steps (new tokens, random evictions,
compact reclaims on the side stream): equal to dense attention over the kept tokens and to the eager
``paged_attention``; every buffer's ``data_ptr`` unchanged. Without CUDA the same function runs eagerly over
the same persistent buffers (``captured`` False)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .gpu_context import CheckContext, make_cache, random_keep


def static_paged_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bt: torch.Tensor, lens: torch.Tensor,
                           qpos: torch.Tensor, kpos: torch.Tensor, width: int) -> torch.Tensor:
    """``paged_attention``'s math (causal by true key position) over a FIXED width of virtual slots, so
    no ``max(len)`` is read on the host: capturable in a CUDA graph. Returns ``[B, Q, H_q, D]`` float32."""
    from vtoken_runtime.token_table import slot_index

    B, Q, Hq, D = q.shape
    NB, bs, H, _ = kc.shape
    G = Hq // H
    slots, in_range = slot_index(bt, lens, width, bs)  # [B, W]
    blk, off = slots // bs, slots % bs
    k = kc[blk, off].to(torch.float32).permute(0, 2, 1, 3)  # [B, H, W, D]
    v = vc[blk, off].to(torch.float32).permute(0, 2, 1, 3)
    qf = q.to(torch.float32).view(B, Q, H, G, D).permute(0, 2, 3, 1, 4).reshape(B, H, G * Q, D)
    s = torch.matmul(qf, k.transpose(-1, -2)).view(B, H, G, Q, width) * (1.0 / math.sqrt(D))
    kp = kpos[:, slots].permute(1, 0, 2)[:, :, None, None, :]  # [B, R, 1, 1, W]
    qp = qpos[:, None, None, :, None]
    valid = in_range[:, None, None, None, :] & (qp >= 0) & (kp >= 0) & (kp <= qp)
    p = torch.nan_to_num(torch.softmax(s.masked_fill(~valid, float("-inf")), dim=-1), nan=0.0)
    out = torch.matmul(p.view(B, H, G * Q, width), v).view(B, H, G, Q, D)
    return out.permute(0, 3, 1, 2, 4).reshape(B, Q, Hq, D)


def check_cuda_graph(ctx: CheckContext) -> dict[str, Any]:
    from vtoken_runtime.paged_attention import dense_attention

    L, H, Hq, D, bs, nreq, P = (2, 2, 4, 8, 4, 2, 24) if ctx.smoke else (2, 8, 32, 128, 16, 4, 256)
    steps = 50
    maxb = math.ceil((P + steps) / bs) + 1
    NB = nreq * maxb + 2
    cache, info = make_cache(ctx, L, H, D, bs, NB, "compact", "head", True, ctx.runner, None, nreq, maxb)
    rng = np.random.default_rng(ctx.seed + 11)
    g = torch.Generator().manual_seed(ctx.seed + 11)
    reqs = list(range(nreq))
    for rid in reqs:
        cache.add_request(rid, range(2))
        slots = cache.reserve(rid, P)
        for layer in range(L):
            cache.write_kv_slots(layer, slots, torch.randn(P, H, D, generator=g).to(ctx.dev),
                                 torch.randn(P, H, D, generator=g).to(ctx.dev))
    width = maxb * bs
    q_buf = torch.zeros(nreq, 1, Hq, D, dtype=torch.float32, device=ctx.dev)
    qpos_buf = torch.zeros(nreq, 1, dtype=torch.int64, device=ctx.dev)
    md = cache.attention_metadata(reqs)
    kc = [cache.key_cache(li) for li in range(L)]
    vc = [cache.value_cache(li) for li in range(L)]
    kpos = [cache.key_positions(li) for li in range(L)]
    bt_buf, lens_buf = md.block_tables, md.cache_lens

    def fn() -> torch.Tensor:
        return torch.stack([static_paged_attention(q_buf, kc[li], vc[li], bt_buf, lens_buf, qpos_buf, kpos[li], width)
                            for li in range(L)])

    def ptrs() -> list[int]:
        m = cache.attention_metadata(reqs, fence=False)
        return ([m.block_tables.data_ptr(), m.cache_lens.data_ptr(), q_buf.data_ptr(), qpos_buf.data_ptr()]
                + [t.data_ptr() for t in kc + vc + kpos])

    ptrs0 = ptrs()
    graph = static_out = None
    max_dense = max_eager = 0.0
    ptrs_same = True
    moved = freed = 0
    for _ in range(steps):
        for rid in reqs:
            slots = cache.reserve(rid, 1)
            for layer in range(L):
                cache.write_kv_slots(layer, slots, torch.randn(1, H, D, generator=g).to(ctx.dev),
                                     torch.randn(1, H, D, generator=g).to(ctx.dev))
        md = cache.attention_metadata(reqs)  # reclaims holes, fences, writes the persistent buffers in place
        ptrs_same &= ptrs() == ptrs0
        q_buf.copy_(torch.randn(nreq, 1, Hq, D, generator=g))
        qpos_buf.copy_(torch.tensor([[cache.logical_len(r) - 1] for r in reqs], dtype=torch.int64))
        if ctx.cuda:
            if graph is None:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        fn()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out = fn()
            graph.replay()
            out = static_out
        else:
            out = fn()
        assert out is not None
        for li in range(L):
            eager, _ = cache.attention(li, q_buf, md, qpos_buf)
            max_eager = max(max_eager, float((out[li] - eager).abs().max()))
            for i, rid in enumerate(reqs):
                kp, kk, vv = cache.gather_kv(li, rid)
                ref = dense_attention(q_buf[i], kk, vv, qpos_buf[i], kp)
                max_dense = max(max_dense, float((out[li, i] - ref).abs().max()))
        for rid in reqs:  # evict, then reclaim on the side stream (lands before the next metadata)
            pos, _ = cache.live_view(rid)
            keep = random_keep(rng, pos, 2)
            if keep is not None:
                cache.apply_keep_mask(rid, keep)
        st = cache.reclaim()
        moved += st.tokens_moved
        freed += st.blocks_freed
    cache.close()
    tol = 1e-3
    ok = ptrs_same and max_dense <= tol and max_eager <= tol and moved > 0
    return {"steps": steps, "requests": nreq, "layers": L, "width_slots": width, "layout": info["layout"],
            "captured": graph is not None, "replays": steps if graph is not None else 0,
            **({} if ctx.cuda else {"skipped": "no CUDA", "ran": "eagerly, same persistent buffers"}),
            "tokens_moved": moved, "blocks_freed": freed, "data_ptrs_unchanged": bool(ptrs_same),
            "max_abs_err_vs_dense": max_dense, "max_abs_err_vs_eager_paged": max_eager, "tolerance": tol,
            "pass": bool(ok)}
