"""Attention-statistics kernels: per-slot attn_sum / attn_last / attn_window / low_attn_count.

Paged attention kernels do not return probabilities; H2O, TOVA, SnapKV and Scissorhands need them.
These two kernels recompute ``softmax(scale * q . K)`` for the step's query tokens over the
request's paged keys (GQA: the G query heads of a KV head packed as rows of one ``tl.dot``) and
update the layer's per-slot statistics in place. Semantics: ``vtoken_runtime.stats.torch_stats`` (the torch
backend's rules; exact definitions in docs/kernels.md; test oracle :mod:`.attn_stats_ref`).

1. ``softmax_rows_kernel`` grid ``(B, H_kv, cdiv(Q, BLOCK_Q))``: online max / sum-of-exp of every
   (query, query head) row over all key tiles -> ``m, l`` and the visible-key count (``[B, H_q, Q]``).
2. ``slot_stats_kernel`` grid ``(B, H_kv, cdiv(max_blocks * bs, BLOCK_N))``: for one tile of key
   slots, loop over the query blocks, ``P = sum_g exp(s - m) / l`` and reduce over queries into the
   four statistics (semantics of ``vtoken_runtime.stats.torch_stats``); each (request, KV head, slot) belongs to exactly one program, so accumulation
   is a plain load-add-store (deterministic, no atomics).

Keys are read twice (pass 1 and 2) and queries once per key tile; the statistics are written once.
Layouts: ``query [B, Q, H_q, D]``, ``key_cache [NB, bs, H_kv, D]`` with any strides but unit stride
along D (the vllm_cpu ``[NB, H_kv, bs, 2D]`` cache is the view ``cache[..., :D].permute(0, 2, 1, 3)``),
``block_tables [B, max_blocks]``, ``cache_lens [B]``, ``query_pos [B, Q]`` (-1 = padding),
``key_positions [R, NB*bs]`` (R = H_kv or 1), stats ``[H_kv, NB*bs]`` float32 per name.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
import triton
import triton.language as tl

from ..stats.torch_stats import ATTENTION_STATS as STAT_NAMES

NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))


@triton.jit
def _key_tile(k_ptr, k_snb, k_sbs, k_sh, bt_ptr, bt_sb, kpos_ptr, kpos_sr, b, h, j, jm, d, D,
              bs: tl.constexpr, KPOS_PER_HEAD: tl.constexpr, UPCAST: tl.constexpr):
    blk = tl.load(bt_ptr + b * bt_sb + j // bs, mask=jm, other=0).to(tl.int64)
    off = j % bs
    slot = blk * bs + off
    if KPOS_PER_HEAD:
        kp = tl.load(kpos_ptr + h * kpos_sr + slot, mask=jm, other=-1)
    else:
        kp = tl.load(kpos_ptr + slot, mask=jm, other=-1)
    kt = tl.load(k_ptr + blk[:, None] * k_snb + off[:, None] * k_sbs + h * k_sh + d[None, :],
                 mask=jm[:, None] & (d < D)[None, :], other=0.0)
    if UPCAST:
        kt = kt.to(tl.float32)
    return slot, kp, kt


@triton.jit
def _load_q(q_ptr, q_sb, q_sq, q_sh, k_ptr, b, qi, head, rvalid, d, D, UPCAST: tl.constexpr):
    """Query rows ``[rows, BLOCK_D]`` in the dot's input type (the cache dtype, or fp32)."""
    qv = tl.load(q_ptr + b * q_sb + qi[:, None] * q_sq + head[:, None] * q_sh + d[None, :],
                 mask=rvalid[:, None] & (d < D)[None, :], other=0.0)
    if UPCAST:
        return qv.to(tl.float32)
    return qv.to(k_ptr.dtype.element_ty)


@triton.jit
def softmax_rows_kernel(q_ptr, q_sb, q_sq, q_sh, k_ptr, k_snb, k_sbs, k_sh, bt_ptr, bt_sb, lens_ptr,
                        qpos_ptr, qpos_sb, kpos_ptr, kpos_sr, m_ptr, l_ptr, nvis_ptr, Q, Hq, D, scale,
                        G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, bs: tl.constexpr, KPOS_PER_HEAD: tl.constexpr,
                        PREC: tl.constexpr, UPCAST: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    rows = tl.arange(0, G_PAD * BLOCK_Q)
    g = rows // BLOCK_Q
    qi = tl.program_id(2) * BLOCK_Q + rows % BLOCK_Q
    rin = (g < G) & (qi < Q)
    qpos = tl.load(qpos_ptr + b * qpos_sb + qi, mask=rin, other=-1)
    rvalid = rin & (qpos >= 0)
    d = tl.arange(0, BLOCK_D)
    qv = _load_q(q_ptr, q_sb, q_sq, q_sh, k_ptr, b, qi, h * G + g, rvalid, d, D, UPCAST)
    m = tl.full([G_PAD * BLOCK_Q], NEG_INF, tl.float32)
    lsum = tl.zeros([G_PAD * BLOCK_Q], dtype=tl.float32)
    nvis = tl.zeros([G_PAD * BLOCK_Q], dtype=tl.float32)
    n_len = tl.load(lens_ptr + b).to(tl.int32)
    for j0 in range(0, n_len, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        jm = j < n_len
        slot, kp, kt = _key_tile(k_ptr, k_snb, k_sbs, k_sh, bt_ptr, bt_sb, kpos_ptr, kpos_sr, b, h, j, jm, d, D,
                                 bs, KPOS_PER_HEAD, UPCAST)
        s = tl.dot(qv, tl.trans(kt), input_precision=PREC) * scale
        vis = rvalid[:, None] & jm[None, :] & (kp >= 0)[None, :] & (kp[None, :] <= qpos[:, None])
        s = tl.where(vis, s, NEG_INF)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.where(m_new == NEG_INF, 0.0, tl.exp(m - m_new))
        p = tl.where(vis, tl.exp(s - m_new[:, None]), 0.0)
        lsum = lsum * alpha + tl.sum(p, axis=1)
        nvis += tl.sum(vis.to(tl.float32), axis=1)
        m = m_new
    out = b * Hq * Q + (h * G + g) * Q + qi
    tl.store(m_ptr + out, m, mask=rin)
    tl.store(l_ptr + out, lsum, mask=rin)
    tl.store(nvis_ptr + out, nvis, mask=rin)


@triton.jit
def slot_stats_kernel(q_ptr, q_sb, q_sq, q_sh, k_ptr, k_snb, k_sbs, k_sh, bt_ptr, bt_sb, lens_ptr,
                      qpos_ptr, qpos_sb, kpos_ptr, kpos_sr, m_ptr, l_ptr, nvis_ptr, qn_ptr, plen_ptr, w_ptr, decay_ptr,
                      sum_ptr, lastout_ptr, win_ptr, low_ptr, out_sh, Q, Hq, D, scale, obs_window, thr_g,
                      DO_SUM: tl.constexpr, DO_LAST: tl.constexpr, DO_WIN: tl.constexpr, DO_LOW: tl.constexpr,
                      G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, bs: tl.constexpr, KPOS_PER_HEAD: tl.constexpr,
                      PREC: tl.constexpr, UPCAST: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    n_len = tl.load(lens_ptr + b).to(tl.int32)
    qn = tl.load(qn_ptr + b)
    plen = tl.load(plen_ptr + b)
    j = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    jm = j < n_len
    active = tl.program_id(2) * BLOCK_N < n_len
    d = tl.arange(0, BLOCK_D)
    slot, kp, kt = _key_tile(k_ptr, k_snb, k_sbs, k_sh, bt_ptr, bt_sb, kpos_ptr, kpos_sr, b, h, j, jm, d, D,
                             bs, KPOS_PER_HEAD, UPCAST)
    rows = tl.arange(0, G_PAD * BLOCK_Q)
    g = rows // BLOCK_Q
    acc_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_last = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_win = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_low = tl.zeros([BLOCK_N], dtype=tl.float32)
    q_end = tl.where(active, Q, 0)
    for q0 in range(0, q_end, BLOCK_Q):
        qi = q0 + rows % BLOCK_Q
        rin = (g < G) & (qi < Q)
        qpos_r = tl.load(qpos_ptr + b * qpos_sb + qi, mask=rin, other=-1)
        rvalid = rin & (qpos_r >= 0)
        qv = _load_q(q_ptr, q_sb, q_sq, q_sh, k_ptr, b, qi, h * G + g, rvalid, d, D, UPCAST)
        ridx = b * Hq * Q + (h * G + g) * Q + qi
        m = tl.load(m_ptr + ridx, mask=rvalid, other=0.0)
        lsum = tl.load(l_ptr + ridx, mask=rvalid, other=1.0)
        s = tl.dot(qv, tl.trans(kt), input_precision=PREC) * scale
        vis = rvalid[:, None] & jm[None, :] & (kp >= 0)[None, :] & (kp[None, :] <= qpos_r[:, None])
        p = tl.where(vis, tl.exp(s - m[:, None]) / lsum[:, None], 0.0)
        P = tl.sum(tl.reshape(p, [G_PAD, BLOCK_Q, BLOCK_N]), axis=0)  # summed over the G query heads
        qq = q0 + tl.arange(0, BLOCK_Q)
        qp = tl.load(qpos_ptr + b * qpos_sb + qq, mask=qq < Q, other=-1)
        vq = qp >= 0
        visq = vq[:, None] & jm[None, :] & (kp >= 0)[None, :] & (kp[None, :] <= qp[:, None])
        Pv = tl.where(visq, P, 0.0)
        if DO_SUM:
            acc_sum += tl.sum(Pv, axis=0)
        if DO_LAST:
            acc_last += tl.sum(tl.where((vq & (qq == qn - 1))[:, None], Pv, 0.0), axis=0)
        if DO_WIN:
            acc_win += tl.sum(tl.where((vq & (qp >= plen - obs_window) & (qp < plen))[:, None], Pv, 0.0), axis=0)
        if DO_LOW:
            nv = tl.maximum(tl.load(nvis_ptr + b * Hq * Q + h * G * Q + qq, mask=qq < Q, other=1.0), 1.0)
            thr = tl.div_rn(tl.zeros([BLOCK_Q], dtype=tl.float32) + thr_g, nv)
            w = tl.load(w_ptr + b * Q + qq, mask=qq < Q, other=0.0)
            low = visq & (P < thr[:, None])
            acc_low += tl.sum(tl.where(low, w[:, None], 0.0), axis=0)
    o = h * out_sh + slot
    if DO_SUM:
        tl.store(sum_ptr + o, tl.load(sum_ptr + o, mask=jm, other=0.0) + acc_sum, mask=jm)
    if DO_LAST:
        tl.store(lastout_ptr + o, acc_last, mask=jm)
    if DO_WIN:
        tl.store(win_ptr + o, tl.load(win_ptr + o, mask=jm, other=0.0) + acc_win, mask=jm)
    if DO_LOW:
        dec = tl.load(decay_ptr + b)
        tl.store(low_ptr + o, tl.load(low_ptr + o, mask=jm, other=0.0) * dec + acc_low, mask=jm)


def _config(G: int, Q: int, D: int, block_n: int | None) -> dict[str, int]:
    g_pad = triton.next_power_of_2(G)
    block_q = max(triton.next_power_of_2(min(max(Q, 1), 16)), max(1, 16 // g_pad))
    block_q = max(1, min(block_q, max(1, 64 // g_pad)))
    if g_pad * block_q < 16:
        block_q = 16 // g_pad
    block_d = max(16, triton.next_power_of_2(D))
    bn = block_n or (64 if block_d <= 128 else 32)
    warps = 8 if g_pad * block_q * bn >= 4096 else 4
    return {"G_PAD": g_pad, "BLOCK_Q": block_q, "BLOCK_N": bn, "BLOCK_D": block_d, "num_warps": warps}


def update_attn_stats(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cache_lens: torch.Tensor,
    query_pos: torch.Tensor,
    key_positions: torch.Tensor,
    stats: dict[str, torch.Tensor],
    scale: float | None = None,
    obs_window: int = 32,
    history_window: int = 64,
    low_attn_threshold: float = 1.0,
    prompt_lens: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Update ``stats[name]`` (``[H_kv, S]`` float32, names from :data:`STAT_NAMES`) in place for one
    layer and one step; ``prompt_lens [B]`` (default: the end of this step) places the observation
    window; see :mod:`.attn_stats_ref` / ``vtoken_runtime.stats.torch_stats`` for the definitions."""
    unknown = set(stats) - set(STAT_NAMES)
    if unknown:
        raise ValueError(f"unknown attention statistics {sorted(unknown)}; known: {STAT_NAMES}")
    B, Q, Hq, D = query.shape
    NB, bs, Hkv, Dk = key_cache.shape
    if Dk != D or Hq % Hkv:
        raise ValueError(f"query {tuple(query.shape)} does not match key cache {tuple(key_cache.shape)}")
    if B == 0 or Q == 0 or not stats:
        return
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key_cache.stride(-1) != 1:
        raise ValueError("key_cache must have unit stride along D")
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dev = query.device
    cfg = _config(G, Q, D, block_n)
    num_warps = num_warps or cfg["num_warps"]
    bt = block_tables.to(dev).contiguous()
    lens = cache_lens.to(dev, torch.int32).contiguous()
    qpos = query_pos.to(dev, torch.int64).contiguous()
    kpos = key_positions.to(dev, torch.int64).contiguous()
    if kpos.shape[0] not in (1, Hkv):
        raise ValueError(f"key_positions rows must be 1 or H_kv={Hkv}, got {kpos.shape[0]}")
    per_head = kpos.shape[0] == Hkv and Hkv > 1
    # fp32 caches: exact fp32 dot. bf16/fp16: native tensor-core dot (products exact, fp32 accumulate);
    # the interpreter's half-precision dot is wrong, so it upcasts (same products, same result).
    upcast = key_cache.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET", "0") == "1"
    m = torch.empty((B, Hq, Q), dtype=torch.float32, device=dev)
    lsum = torch.empty_like(m)
    nvis = torch.empty_like(m)  # visible keys per query row (the same for the G heads of a KV head)
    valid_q = qpos >= 0
    qn = valid_q.sum(1)
    i = torch.arange(Q, device=dev)[None, :]
    decay = 1.0 - 1.0 / int(history_window)
    w = (decay ** (qn[:, None] - 1 - i).clamp(min=0).to(torch.float32) * valid_q).contiguous()  # as the collector
    decay_b = (decay ** qn.to(torch.float32)).contiguous()
    qn32 = qn.to(torch.int32).contiguous()
    plen = (qpos.max(1).values + 1 if prompt_lens is None else prompt_lens.to(dev, torch.int64)).contiguous()
    common = (query, query.stride(0), query.stride(1), query.stride(2), key_cache, key_cache.stride(0),
              key_cache.stride(1), key_cache.stride(2), bt, bt.stride(0), lens, qpos, qpos.stride(0), kpos,
              kpos.stride(0), m, lsum, nvis)
    consts = {"G": G, "G_PAD": cfg["G_PAD"], "BLOCK_Q": cfg["BLOCK_Q"], "BLOCK_N": cfg["BLOCK_N"],
              "BLOCK_D": cfg["BLOCK_D"], "bs": bs, "KPOS_PER_HEAD": per_head,
              "PREC": "ieee" if upcast else "tf32", "UPCAST": upcast}
    softmax_rows_kernel[(B, Hkv, triton.cdiv(Q, cfg["BLOCK_Q"]))](*common, Q, Hq, D, scale, **consts,
                                                                   num_warps=num_warps)
    ref = next(iter(stats.values()))
    ptrs = [stats.get(n, ref) for n in STAT_NAMES]
    for t in ptrs:
        if t.dtype != torch.float32 or t.dim() != 2 or t.stride(1) != 1 or t.stride(0) != ref.stride(0):
            raise ValueError("stats must be [H_kv, S] float32 tensors with unit stride along S and equal strides")
    thr_g = float(np.float32(low_attn_threshold) * np.float32(G))
    grid = (B, Hkv, triton.cdiv(bt.shape[1] * bs, cfg["BLOCK_N"]))
    slot_stats_kernel[grid](*common, qn32, plen, w, decay_b, *ptrs, ref.stride(0), Q, Hq, D, scale, int(obs_window),
                            thr_g, DO_SUM="attn_sum" in stats, DO_LAST="attn_last" in stats,
                            DO_WIN="attn_window" in stats, DO_LOW="low_attn_count" in stats, **consts,
                            num_warps=num_warps)


def aot_specs(arch: int = 90) -> list[tuple[object, dict[str, str], dict[str, object], int, str]]:
    """(kernel, signature, constexprs, num_warps, label): bf16 cache, D=128, GQA G=3 (SmolLM2-like) decode
    and G=4 prefill chunk, block size 16."""
    out = []
    base = {"q_ptr": "*bf16", "q_sb": "i32", "q_sq": "i32", "q_sh": "i32", "k_ptr": "*bf16", "k_snb": "i32",
            "k_sbs": "i32", "k_sh": "i32", "bt_ptr": "*i32", "bt_sb": "i32", "lens_ptr": "*i32",
            "qpos_ptr": "*i64", "qpos_sb": "i32", "kpos_ptr": "*i64", "kpos_sr": "i32", "m_ptr": "*fp32",
            "l_ptr": "*fp32", "nvis_ptr": "*fp32"}
    for G, Q, what in ((3, 1, "decode G=3"), (4, 512, "prefill G=4")):
        cfg = _config(G, Q, 128, None)
        warps = cfg.pop("num_warps")
        consts = {"G": G, **cfg, "bs": 16, "KPOS_PER_HEAD": True, "PREC": "tf32", "UPCAST": False}
        out.append((softmax_rows_kernel, {**base, "Q": "i32", "Hq": "i32", "D": "i32", "scale": "fp32"}, consts, warps,
                    f"attn_stats.softmax_rows[{what}]"))
        sig = {**base, "qn_ptr": "*i32", "plen_ptr": "*i64", "w_ptr": "*fp32", "decay_ptr": "*fp32", "sum_ptr": "*fp32",
               "lastout_ptr": "*fp32", "win_ptr": "*fp32", "low_ptr": "*fp32", "out_sh": "i32", "Q": "i32",
               "Hq": "i32", "D": "i32", "scale": "fp32", "obs_window": "i32", "thr_g": "fp32"}
        out.append((slot_stats_kernel, sig, {**consts, "DO_SUM": True, "DO_LAST": True, "DO_WIN": True,
                                             "DO_LOW": True}, warps, f"attn_stats.slot_stats[{what}]"))
    return out
