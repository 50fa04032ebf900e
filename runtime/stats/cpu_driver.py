"""The numba statistics kernel's driver (:func:`_py_kernel`: per request and KV head, the passes of :mod:`.cpu_passes`
over the key tiles of :mod:`.cpu_gather`, then the fold into the per-slot stores) and its loader (:func:`load`).

The cache is read once per (request, KV head) (in place: once per needed query): the transposed tiles
stay in a scratch buffer (``SCRATCH_BYTES``, 32 MiB: ~64K tokens at D = 128) between the passes; a longer
request re-gathers its earlier tiles in the sum pass and pass 2. The scores are cached: pass 1 writes them,
the sum pass replaces them by their exponentials, pass 2 reads those (no dot product and no exponential
after pass 1). The cache holds a block of the request's needed queries at a time (as many as fit in
``SCORE_BYTES``, 16 MiB: e.g. 256 queries x 3 query heads x 5K keys per block; the three passes run per
block, and the contributions add up per key over the queries in order across blocks, so the bits do not
depend on the blocks). Only when the request's tiles do not fit in one scratch chunk (or one query's scores
not in ``SCORE_BYTES``) are the scores recomputed in each pass, with the same bits. No probability matrix
exists. Tiles whose smallest key position is past a query's position are skipped for it (the causal half
of a prefill chunk). A query at position ``qp`` sees the keys of a tile that a query at ``min(qp, kmax)`` sees
(``kmax``: the tile's largest key position), so each pass computes a tile's visibility mask once for all the
queries past the tile and again only along the causal diagonal (per query it cost a third of a prefill call).

Only the queries a statistic reads are processed (the per-request list is built first):
``attn_last`` reads the request's last valid query, ``attn_window`` the valid queries at positions
``[prompt_len - obs_window, prompt_len)``; ``attn_sum`` and ``low_attn_count`` read every valid query
(the count's exponential window covers all of them, and ``n_vis(q)`` is per query). H2O
(``attn_sum``) at prefill therefore costs one pass of ``Q x L`` dot products (three without the score cache); TOVA (``attn_last``)
and SnapKV (``attn_window``) at prefill cost only their few queries.

Loading and the on-disk cache: :mod:`.cpu_kernel`'s docstring.

numba's on-disk cache checks each compiled function against its own source file only, and a compiled caller
holds its callees' code: a caller in one of the kernel's files would keep an edited callee of another file.
:func:`load` therefore drops the kernel's cache files when the kernel's sources changed
(:func:`~vtoken_runtime._numba_compat.drop_stale_cache`), as an edit of the one file they used to share did.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from .._numba_compat import drop_stale_cache, make_llvmlite_scan_safe
from . import cpu_gather, cpu_numerics, cpu_passes
from .cpu_numerics import _F0, _F1, _NEG, LANES
from .cpu_passes import F_LAST, F_WIN

# the modules whose functions numba compiles into the kernel (their sources decide whether its cache is fresh)
KERNEL_MODULES = (cpu_numerics, cpu_gather, cpu_passes)


def _py_kernel(qf, qtok, q_bits, kraw, kfmt, k_snb, k_sbs, k_sh, k_sd, k_seg, k_sseg, bt, lens, qpos, plen, kpos, kp_rs, bs, Hkv,
               out_sum, out_last, out_win, out_low, o_rs, do_sum, do_last, do_win, do_low,
               scale, obs_window, decay, thr_g, BN, max_tiles, max_scores):  # type: ignore[no-untyped-def]  # pragma: no cover
    T, Hq, D = qf.shape  # query rows [T, H_q, D]: fp32, or bf16 bits (``q_bits``) as uint16
    B, Q = qtok.shape  # qf's row of (request b, query q); read only where qpos[b, q] >= 0
    G = Hq // Hkv
    W = min(BN, LANES)
    need_all = do_sum or do_low
    per_head = kp_rs != 0
    max_len = 0
    for b in range(B):
        max_len = max(max_len, np.int64(lens[b]))
    CT = max(1, min((max_len + BN - 1) // BN, max_tiles))  # key tiles kept between the passes
    TS = D * BN
    # score cache: per request whose tiles fit in one scratch chunk, a block of its queries x G x tiles x BN within
    # max_scores (at least one query; the request's needed queries are among its valid ones)
    n_sc = 0
    for b in range(B):
        n_t = (np.int64(lens[b]) + BN - 1) // BN
        qn = 0
        for q in range(Q):
            if qpos[b, q] >= 0:
                qn += 1
        one = G * n_t * BN
        if 0 < n_t <= CT and one <= max_scores:
            n_sc = max(n_sc, min(qn, max_scores // one) * one)
    sc = np.empty(n_sc, np.float32)
    # scratch, reused for every (request, KV head); every element a tile computation reads is written first
    kts = np.empty(CT * TS, np.float32)
    ktu = kts.view(np.uint32)
    kps = np.empty(CT * BN, np.int64)
    slts = np.empty(CT * BN, np.int64)
    kmins = np.empty(CT, np.int64)
    rowb = np.empty(BN, np.int64)
    vis = np.zeros(BN, np.bool_)
    acc = np.zeros(G * BN, np.float32)
    P = np.zeros(BN, np.float32)
    NT = (max_len + BN - 1) // BN * BN
    c_sum = np.zeros(NT, np.float32)  # a request's contributions per virtual slot, over all its query blocks
    c_last = np.zeros(NT, np.float32)
    c_win = np.zeros(NT, np.float32)
    c_low = np.zeros(NT, np.float32)
    qidx = np.empty(Q, np.int64)
    qp_n = np.empty(Q, np.int64)
    fl_n = np.empty(Q, np.int64)
    w_n = np.empty(Q, np.float32)
    thr_n = np.empty(Q, np.float32)
    nvis = np.empty(Q, np.int64)
    qb = np.empty(Q * G * D, np.float32)
    ml = np.empty(Q * G * W, np.float32)
    ll = np.empty(Q * G * W, np.float32)
    m = np.empty(Q * G, np.float32)
    invl = np.empty(Q * G, np.float32)
    for b in range(B):
        n_len = np.int64(lens[b])
        # ---- the request's needed queries (ascending q) with their flags and count weights
        qn = 0
        for q in range(Q):
            if qpos[b, q] >= 0:
                qn += 1
        lo = plen[b] - obs_window
        n_need = 0
        for q in range(Q):
            p = qpos[b, q]
            if p < 0:
                continue
            f = 0
            if q == qn - 1:
                f |= F_LAST
            if p >= lo and p < plen[b]:
                f |= F_WIN
            if need_all or (do_last and (f & F_LAST) != 0) or (do_win and (f & F_WIN) != 0):
                qidx[n_need] = q
                qp_n[n_need] = p
                fl_n[n_need] = f
                k = qn - 1 - q
                w_n[n_need] = np.float32(np.float64(decay) ** (k if k > 0 else 0))
                n_need += 1
        dec_b = np.float32(np.float64(decay) ** qn)
        if n_len <= 0 or (n_need == 0 and not do_last):
            continue  # nothing to add (attn_last, set to 0 without a query, is the only write without queries)
        n_tiles = (n_len + BN - 1) // BN
        last_c0 = ((n_tiles - 1) // CT) * CT
        # the queries go in blocks of QB whose scores stay cached between the passes (every query at once when
        # they do not fit: the scores are recomputed); contributions add up per key over the queries in order,
        # whatever the blocks, so the bits do not depend on them
        one = G * n_tiles * BN
        cached = n_tiles <= CT and 0 < one <= n_sc
        QB = max(1, min(n_need, n_sc // one)) if cached else max(1, n_need)
        # dim-major cache (vLLM's CPU layout) and cached scores: pass 1 reads the keys in place, no key tiles
        # (pass 2 reads no keys); the tile copy costs more than the dot products it would speed up
        direct = cached and k_sbs == 1 and k_sd != 1 and k_seg % 8 == 0
        for h in range(Hkv):
            kp_off = h * kp_rs if per_head else 0
            for c in (c_sum, c_last, c_win, c_low):  # zeroed once per (request, head): pass 2 adds every block
                c[:n_tiles * BN] = _F0
            for q0 in range(0, max(n_need, 1), QB):
                nq = min(QB, n_need - q0)  # 0: no query (attn_last only: the fold below writes its zeros)
                RS = nq * G * BN  # one tile's cached scores
                for i in range(nq):  # query rows of this block: qb[(i*G + g)*D + d] (bf16 bits widened: exact)
                    tq = qtok[b, qidx[q0 + i]]
                    for g in range(G):
                        rb = (i * G + g) * D
                        row = qf[tq, h * G + g]
                        if q_bits:
                            for d in range(D):
                                qb[rb + d] = _as_f32(np.uint32(np.uint32(row[d]) << np.uint32(16)))  # noqa: F821
                        else:
                            for d in range(D):
                                qb[rb + d] = row[d]
                qp_b = qp_n[q0:q0 + nq]
                nv_b = nvis[q0:q0 + nq]
                # ---- pass 1 (chunks of CT tiles): scores and row maxima
                if nq > 0:
                    for r in range(nq * G * W):
                        ml[r] = _NEG
                        ll[r] = _F0
                    for i in range(nq):
                        nv_b[i] = 0
                    for c0 in range(0, n_tiles, CT):
                        for t in range(c0, min(c0 + CT, n_tiles)):
                            ti = t - c0
                            nt = min(BN, n_len - t * BN)
                            if q0 == 0 or n_tiles > CT or direct:  # later blocks: the key offsets of in-place dots
                                kmins[ti] = _gather(kraw, kfmt, k_snb, k_sbs, k_sh, k_sd, k_seg, k_sseg, bt, b, h, t * BN, nt, bs,  # noqa: F821
                                                    kpos, kp_off, ktu[ti * TS:(ti + 1) * TS], kps[ti * BN:(ti + 1) * BN],
                                                    slts[ti * BN:(ti + 1) * BN], rowb, BN, D, not direct)
                            _pass1(qb, nq, qp_b, G, D, kts, ti * TS, kps, ti * BN, kmins[ti], nt, vis, acc, sc,  # noqa: F821
                                   ti * RS, cached, ml, nv_b, scale, BN, W, direct, kraw, kfmt, rowb, t * BN, k_seg, k_sd)
                    for r in range(nq * G):  # the row max: max over the lanes
                        mr = ml[r * W:(r + 1) * W]
                        mx = _NEG
                        for u in range(W):
                            mx = mr[u] if mr[u] > mx else mx
                        m[r] = mx
                    # ---- the sum pass (tiles ascending; a multi-chunk request re-gathers from its first chunk,
                    # and the last chunk stays in the scratch for pass 2): l = sum of exp(s - m), lanes in order
                    for c0 in range(0, n_tiles, CT):
                        for t in range(c0, min(c0 + CT, n_tiles)):
                            ti = t - c0
                            nt = min(BN, n_len - t * BN)
                            if n_tiles > CT:
                                kmins[ti] = _gather(kraw, kfmt, k_snb, k_sbs, k_sh, k_sd, k_seg, k_sseg, bt, b, h, t * BN, nt, bs,  # noqa: F821
                                                    kpos, kp_off, ktu[ti * TS:(ti + 1) * TS], kps[ti * BN:(ti + 1) * BN],
                                                    slts[ti * BN:(ti + 1) * BN], rowb, BN, D, True)
                            _pass1b(qb, nq, qp_b, nv_b, m, G, D, kts, ti * TS, kps, ti * BN, kmins[ti], nt, vis, acc,  # noqa: F821
                                    sc, ti * RS, cached, ll, scale, BN, W, kraw, kfmt, rowb, t * BN, k_seg, k_sd)
                    for r in range(nq * G):
                        lr = ll[r * W:(r + 1) * W]
                        lsum = _F0
                        for u in range(W):
                            lsum += lr[u]
                        invl[r] = _F1 / lsum if lsum > _F0 else _F0
                    for i in range(nq):  # the collector's threshold: (1 / n_vis) * (threshold * G), fp32
                        thr_n[i] = (_F1 / np.float32(max(nv_b[i], 1))) * thr_g
                # ---- pass 2 (chunks in reverse order: the chunk the sum pass left in the scratch first)
                for c0 in range(last_c0, -1, -CT):
                    for t in range(c0, min(c0 + CT, n_tiles)):
                        ti = t - c0
                        nt = min(BN, n_len - t * BN)
                        if nq == 0 or c0 != last_c0:
                            kmins[ti] = _gather(kraw, kfmt, k_snb, k_sbs, k_sh, k_sd, k_seg, k_sseg, bt, b, h, t * BN, nt, bs, kpos,  # noqa: F821
                                                kp_off, ktu[ti * TS:(ti + 1) * TS], kps[ti * BN:(ti + 1) * BN],
                                                slts[ti * BN:(ti + 1) * BN], rowb, BN, D, nq > 0 and not cached)
                        _pass2(qb, nq, qp_b, fl_n[q0:q0 + nq], w_n[q0:q0 + nq], thr_n, nv_b, m, invl, G, D, kts,  # noqa: F821
                               ti * TS, kps, ti * BN, kmins[ti], nt, vis, acc, sc, ti * RS, cached, P, c_sum, c_last,
                               c_win, c_low, t * BN, do_sum, do_last, do_win, do_low, scale, BN, kraw, kfmt, rowb,
                               t * BN, k_seg, k_sd)
            # ---- fold into the per-slot stores (chunks ascending: pass 2 left the first one in the scratch)
            ob = h * o_rs
            for c0 in range(0, n_tiles, CT):
                for t in range(c0, min(c0 + CT, n_tiles)):
                    ti = t - c0
                    nt = min(BN, n_len - t * BN)
                    if c0 != 0:
                        _gather(kraw, kfmt, k_snb, k_sbs, k_sh, k_sd, k_seg, k_sseg, bt, b, h, t * BN, nt, bs, kpos,  # noqa: F821
                                kp_off, ktu[ti * TS:(ti + 1) * TS], kps[ti * BN:(ti + 1) * BN],
                                slts[ti * BN:(ti + 1) * BN], rowb, BN, D, False)
                    sl = slts[ti * BN:(ti + 1) * BN]
                    o = t * BN
                    for jj in range(nt):
                        so = ob + sl[jj]
                        if do_sum:
                            out_sum[so] += c_sum[o + jj]
                        if do_last:
                            out_last[so] = c_last[o + jj]
                        if do_win:
                            out_win[so] += c_win[o + jj]
                        if do_low:
                            out_low[so] = out_low[so] * dec_b + c_low[o + jj]


_K: Any = None
_LOCK = threading.Lock()


def load() -> Any:
    """Import numba and bind the compiled kernel (once per process; compiled lazily per type signature)."""
    global _K
    if _K is not None:
        return _K
    with _LOCK:
        if _K is not None:
            return _K
        try:
            import numba
        except ImportError as e:  # pragma: no cover - numba is a dependency
            raise ImportError("update_attn_stats_cpu needs numba (requirements.lock pins numba==0.65.0: "
                              "`pip install numba`), or use the torch collector "
                              "(vtoken_runtime.stats.StatsCollector)") from e
        make_llvmlite_scan_safe()
        opts = {"cache": True, "nogil": True, "fastmath": False}
        bound: dict[str, Any] = {}
        for module in KERNEL_MODULES:  # callees first: each module binds what it calls
            bound.update(module.bind(numba, opts, bound))
        globals().update(bound)
        kernel = numba.njit(**opts)(_py_kernel)
        drop_stale_cache(kernel.stats.cache_path, [*(Path(str(m.__file__)) for m in KERNEL_MODULES), Path(__file__)],
                         "vtoken_stats_kernel")
        _K = kernel
    return _K
