"""Attention statistics on CPU (numba): ``attn_sum`` / ``attn_last`` / ``attn_window`` / ``low_attn_count``.

:func:`update_attn_stats_cpu` has the signature and the semantics of the Triton kernel
(``vtoken_runtime.kernels.attn_stats_triton.update_attn_stats``; the rules are
``vtoken_runtime.stats.reference``'s) for CPU tensors, without materialising probabilities: the torch
collector builds ``[B, H_kv, G*Q, L]`` probabilities (and gathered ``[B, H_kv, L, D]`` keys) per layer,
this kernel keeps each query's scores (or ``O(LANES)`` state per (query, head) row) and makes three passes
over them.

For every (request ``b``, KV head ``h``), over key tiles of ``BN`` virtual slots (``block_n``; default
128 for ``D <= 64``, else 64), gathered through the block table into transposed fp32 tiles ``[D, BN]`` (bf16 bits widened to fp32 in
the kernel; a pure copy of the bits, whatever the cache layout): a unit stride along D takes 8 x 8 blocks
(vector loads + an in-register transpose); a unit stride along the block slot (vLLM's CPU layout: K
dim-major per (block, head)) copies, per run of the tile's consecutive keys inside one block, one
contiguous slice per ``d``; any other layout is read element by element. A dim-major cache with a block size
that is a multiple of 8 and a request whose scores are cached (below) gathers no keys at all: pass 1
reads the keys in place, each vector load shared by up to ``DOT_ROWS`` query heads of the GQA group (the same
sums in the same order, so the same bits; the tile copy of 16-key runs cost more than the dot products it
feeds, decode and prefill alike). With 16-slot-aligned segments (a multiple of 16: vLLM's amx segments, fp32 /
vec blocks of 32) the tile's whole groups of 16 keys go 64 / 32 / 16 keys per call, one 512-bit load per
group and ``d``, the groups of one call taken from different segments or blocks: rows x groups independent
FMA chains (one 16-key segment x 3 rows per call left the dot products bound by the FMA latency: 1.4x
slower); the rest of a tile 32 / 16 / 8 keys per call inside one segment. vLLM's bf16 ``amx`` layout
stores K as pairs of dims per 32-bit word, dim-major by pair (:class:`PairedKeys`): the same paths read it, one
word (load) per pair of dims, split into the two dims' fp32 bits (low half: dim 2p, high half: 2p + 1):

1. pass 1: for every needed (query, query head) row, the scores ``s = scale * q . k`` (``_NEG`` where a key
   is not visible), their running max in ``LANES`` lanes per row (key ``jj`` of a tile on lane ``jj % LANES``;
   the row max ``m`` = the max of the lanes) and the visible-key count ``n_vis`` of the query;
2. the sum pass, once ``m`` is final: ``e = exp(s - m)`` per visible (row, key), 0 elsewhere, added to the
   row's lanes (tiles ascending, keys in order), ``l`` = the lanes summed in order: one exponential per
   (row, key), where an online max would need a rescale per tile and a second exponential in pass 2;
   16 keys per call (``_exp_acc16``: 512-bit vectors, the scalar polynomial's operations);
3. pass 2: ``P = sum_g e_g * (1 / l_g)`` per (query, key), reduced over queries into the four
   statistics, per virtual slot; then folded into the per-slot stores (add / overwrite / decay-and-add) at
   the physical slots (every virtual slot ``j < cache_len``: dead slots get the same 0 contributions, the
   overwrite and the decay as in the reference).

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

Queries: ``query [B, Q, H_q, D]``, or (:func:`prepare_step`'s ``token_index``) the step's flat query rows
``[T, H_q, D]`` read in place, e.g. vLLM's query tensor (no padded copy); bf16 queries are read as their bits
and widened in the kernel (exact), fp32 as they are.

Only the queries a statistic reads are processed (the per-request list is built first):
``attn_last`` reads the request's last valid query, ``attn_window`` the valid queries at positions
``[prompt_len - obs_window, prompt_len)``; ``attn_sum`` and ``low_attn_count`` read every valid query
(the count's exponential window covers all of them, and ``n_vis(q)`` is per query). H2O
(``attn_sum``) at prefill therefore costs one pass of ``Q x L`` dot products (three without the score cache); TOVA (``attn_last``)
and SnapKV (``attn_window``) at prefill cost only their few queries.

Numerics: fp32 everywhere, IEEE operations (``fastmath=False``: no reassociation, no implicit contraction).
Dots accumulate over ``d`` in order from 0 with an explicit fused multiply-add per term
(``acc = fma(q_d, k_d, acc)``, ``llvm.fma``: one rounding per term, in every path: the tile loops, the in-place
vector dots and their scalar tails, so every path gives the same bits);
``exp`` is a Cephes-style fp32 polynomial (< 1 ulp measured; written inline so the loops vectorise), its
argument clamped at ``-87`` (``exp(-87)`` ~ 1.6e-38: a probability below that, after the division by
the row's sum, is reported as at most that instead of 0); probabilities are ``e * (1 / l)`` like
torch's CPU softmax; the low-attention threshold is ``(1 / n_vis) * (threshold * G)`` in fp32 and the
count weights ``decay ** k`` are fp32 (``decay = float32(1 - 1/history_window)``), as the collector
computes them. Results equal the collector within ``atol = 2e-6``, ``rtol = 1e-5``; a (query, key)
pair whose ``P`` lies within 1e-5 (relative) of the threshold may be counted on either side (as for
the Triton kernel, docs/kernels.md).

numba is imported on the first call (not at module import; ``ImportError`` with the fix if it is
missing). The kernels are compiled once per argument-type combination (fp32 / bf16 cache: ~5-10 s each)
and cached on disk (``cache=True``, ``__pycache__``); they release the GIL (``nogil=True``; all scratch
is allocated per call, so concurrent calls on different stores are safe) and are single-threaded
(``parallel=False``: vLLM's CPU workers here run with ``OMP_NUM_THREADS=1`` and one core per worker).

Importing numba into a process that later builds a vLLM engine used to crash vLLM's kernel-rebinding
scan (``vllm.triton_utils.dispatcher._rebind_kernels``, run by ``init_worker`` ->
``register_triton_kernel_overrides``): for every module attribute ``value`` with a ``__dict__`` it calls
``vars(value).get("kernel")``, and llvmlite's ``llvmlite.binding.ffi.lib`` (a ``__slots__`` object
whose ``__getattr__`` forwards to the ctypes library) answers ``__dict__`` with a ``_lib_fn_wrapper``,
which has no ``.get``. :func:`make_llvmlite_scan_safe` gives that object a plain ``{}`` for ``__dict__``
(it is never otherwise read); it runs right after numba is imported here.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._numba_compat import make_llvmlite_scan_safe
from .reference import ATTENTION_STATS

STAT_NAMES = ATTENTION_STATS

__all__ = ["STAT_NAMES", "PairedKeys", "PreparedLayer", "kernels_available", "make_llvmlite_scan_safe", "prepare_layer", "prepare_step",
           "run_prepared", "update_attn_stats_cpu"]

# fp32 constants (numba types numpy scalars by their dtype: the arithmetic stays in float32)
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_HALF = np.float32(0.5)
_NEG = np.float32(-3.0e38)  # "no visible key yet" (finite: NEG - NEG = 0, never NaN)
_EXP_LO = np.float32(-87.0)  # exp(-87) ~ 1.65e-38 stays a normal number (no denormal slow paths)
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)  # Cephes split of ln 2 (n * _LN2_HI is exact for |n| < 2^15)
_LN2_LO = np.float32(-2.12194440e-4)
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)

F_LAST, F_WIN = 2, 4  # per-query flags
# key formats (``kfmt``): fp32 bits, one bf16 per 16-bit element (the value is the left shift that makes the fp32
# bits), or bf16 pairs of dims in one 32-bit word (vLLM's CPU ``amx`` layout: dim 2p in the low half, 2p+1 high)
KF_F32, KF_BF16, KF_PAIRS = 0, 16, 1
_HI16 = np.uint32(0xFFFF0000)
_MAX_TILE = 256
# key tiles (transposed fp32 keys) kept between the passes of one (request, KV head); a longer request
# re-gathers its earlier tiles in the sum pass and pass 2 (the chunk the previous pass ended on is reused)
SCRATCH_BYTES = 32 << 20
# the scores of a block of a request's needed queries (as many as fit, at least one), kept across the passes
# when the request's key tiles fit in one scratch chunk; else every pass recomputes them (same bits)
SCORE_BYTES = 16 << 20
DOT_ROWS = 4  # query rows (heads of a GQA group) per in-place dot-product call
LANES = 32  # running max (pass 1) and sum of exp (sum pass) lanes per row (a tile's keys fold onto them)


# ---------------------------------------------------------------- numba code (compiled on first use)
# Plain functions here; _load() wraps them with numba.njit and binds the wrapped versions to the module
# globals their callers name (numba is not imported with this module; callee names resolve at compile time).

def _py_fexp(x):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """exp(x) for float32 x <= 0 (Cephes expf polynomial, IEEE fp32 ops; NaN and x < -87 -> exp(-87))."""
    x = x if x > _EXP_LO else _EXP_LO
    x = x if x < _F0 else _F0
    fx = np.floor(x * _LOG2E + _HALF)
    z = x - fx * _LN2_HI
    z = z - fx * _LN2_LO
    y = _P0 * z + _P1
    y = y * z + _P2
    y = y * z + _P3
    y = y * z + _P4
    y = y * z + _P5
    y = y * (z * z) + z + _F1
    e = np.uint32(np.int32(fx) + np.int32(127))
    return y * _as_f32(np.uint32(e << np.uint32(23)))  # noqa: F821 - bound by _load()


def _py_kbits(kraw, i, d, k_sd, kfmt):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The fp32 bits of dim ``d`` of the key whose dim 0 lies at ``kraw[i]`` (``k_sd``: the stride per dim, per
    pair of dims for ``KF_PAIRS``)."""
    if kfmt == KF_PAIRS:
        w = np.uint32(kraw[i + (d >> 1) * k_sd])
        return np.uint32(w & _HI16) if d & 1 else np.uint32(w << np.uint32(16))
    return np.uint32(np.uint32(kraw[i + d * k_sd]) << np.uint32(kfmt))


def _py_gather(kraw, kfmt, k_snb, k_sbs, k_sh, k_sd, k_seg, k_sseg, bt, b, h, j0, nt, bs, kpos, kp_off, ktu, kp, slots, rowb,
               BN, D, copy):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """Key tile: virtual slots ``j0 .. j0+nt-1`` of request ``b``, KV head ``h`` -> ``ktu[d*BN + jj]`` (the fp32
    tile's bits: fp32 bits as they are, bf16 bits shifted into the high half; zeros up to the tile's
    compute width; only if ``copy``), true positions ``kp`` (-1 past ``nt``), physical ``slots`` and the
    keys' offsets ``rowb`` in ``kraw`` (of d = 0). A block's slots are stored in segments of ``k_seg`` slots
    (``k_sseg`` apart; ``k_seg = bs`` for a plain strided layout, 16 for vLLM's amx). Returns the tile's smallest
    valid position (2**62 if none)."""
    kmin = np.int64(1) << np.int64(62)
    bi = j0 // bs  # block-table column, offset of key jj, its segment's offset and its offset there (no division
    off = j0 - bi * bs  # per key)
    seg_off = (off // k_seg) * k_sseg
    so = off % k_seg
    blk = np.int64(bt[b, bi])
    for jj in range(nt):
        if off == bs:
            bi += 1
            off = 0
            seg_off = 0
            so = 0
            blk = np.int64(bt[b, bi])
        elif so == k_seg:
            seg_off += k_sseg
            so = 0
        slot = blk * bs + off
        slots[jj] = slot
        p = kpos[kp_off + slot]
        kp[jj] = p
        if p >= 0 and p < kmin:
            kmin = p
        rowb[jj] = blk * k_snb + seg_off + so * k_sbs + h * k_sh
        off += 1
        so += 1
    for jj in range(nt, BN):
        kp[jj] = -1
        slots[jj] = 0
    if not copy:
        return kmin
    sh = np.uint32(kfmt)
    BNe = _width(nt, BN)  # noqa: F821
    if k_sbs == 1 and k_sd != 1:
        # dim-major blocks (vLLM's CPU layouts): the tile's keys inside one segment of a block are contiguous
        # along the slot for every d (every pair of dims: amx) -> per run of consecutive keys in one segment,
        # D (D / 2) contiguous row copies
        jj0 = 0
        while jj0 < nt:
            run = min(k_seg - (j0 + jj0) % k_seg, nt - jj0)
            base = rowb[jj0]
            if kfmt == KF_PAIRS:
                for p in range(D // 2):
                    src = kraw[base + p * k_sd:base + p * k_sd + run]
                    d_lo = ktu[2 * p * BN + jj0:2 * p * BN + jj0 + run]
                    d_hi = ktu[(2 * p + 1) * BN + jj0:(2 * p + 1) * BN + jj0 + run]
                    for u in range(run):
                        w = np.uint32(src[u])
                        d_lo[u] = w << np.uint32(16)
                        d_hi[u] = w & _HI16
            else:
                for d in range(D):
                    src = kraw[base + d * k_sd:base + d * k_sd + run]
                    dst = ktu[d * BN + jj0:d * BN + jj0 + run]
                    for u in range(run):
                        dst[u] = np.uint32(src[u]) << sh
            jj0 += run
        n_done = nt
    else:
        n_done = 0
    # vector path: unit stride along D (else the scalar loop below)
    n8 = nt - nt % 8 if k_sd == 1 and kfmt != KF_PAIRS else 0
    D8 = D - D % 8
    for jb in range(0, n8, 8):  # 8 x 8 blocks: vector loads + in-register transpose
        for d0 in range(0, D8, 8):
            _tr8(kraw, rowb, jb, d0, ktu, BN)  # noqa: F821
    for d in range(D):
        row = ktu[d * BN:(d + 1) * BN]
        for jj in range(max(n_done, n8 if d < D8 else 0), nt):
            row[jj] = _kbits(kraw, rowb[jj], d, k_sd, kfmt)  # noqa: F821
        for jj in range(nt, BNe):
            row[jj] = np.uint32(0)
    return kmin


def _py_width(nt, BN):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """Compute width of a tile holding ``nt`` keys: ``nt`` rounded up to 8, at most ``BN``."""
    return min(BN, (nt + 7) // 8 * 8)


def _py_scores(qb, r0, G, D, kt, kto, acc, ao, BN, BNe):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """``acc[ao + g*BN + jj] = sum_d qb[(r0 + g)*D + d] * kt[kto + d*BN + jj]`` (jj < BNe) for the G query heads of
    one query: fp32, accumulated over d in order with one fused multiply-add per term (unrolled by 4 without
    reassociation: the plain loop's sums). Offsets, not slices, here and in every per-tile function (a slice in
    a loop costs an atomic reference count increment and decrement each time: 12-17% of a call), and unsigned
    indices in the inner loops (numba tests a signed index for negative wraparound, which stops the loop from
    vectorising: 2.4x slower)."""
    D4 = D - D % 4
    n = np.uint64(BNe)  # unsigned indices: no negative-index wraparound test, so the loops vectorise
    for g in range(G):
        ab = np.uint64(ao + g * BN)
        qo = (r0 + g) * D
        for jj in range(n):
            acc[ab + jj] = _F0
        for d in range(0, D4, 4):
            q0 = qb[qo + d]
            q1 = qb[qo + d + 1]
            q2 = qb[qo + d + 2]
            q3 = qb[qo + d + 3]
            k0 = np.uint64(kto + d * BN)
            k1 = np.uint64(kto + (d + 1) * BN)
            k2 = np.uint64(kto + (d + 2) * BN)
            k3 = np.uint64(kto + (d + 3) * BN)
            for jj in range(n):
                acc[ab + jj] = _fma32(q3, kt[k3 + jj], _fma32(q2, kt[k2 + jj], _fma32(  # noqa: F821
                    q1, kt[k1 + jj], _fma32(q0, kt[k0 + jj], acc[ab + jj]))))  # noqa: F821
        for d in range(D4, D):
            q0 = qb[qo + d]
            k0 = np.uint64(kto + d * BN)
            for jj in range(n):
                acc[ab + jj] = _fma32(q0, kt[k0 + jj], acc[ab + jj])  # noqa: F821


def _py_scores_direct(qb, r0, G, D, kraw, kfmt, rowb, j0, nt, seg, k_sd, acc, ao, BN,
                      BNe):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """:func:`_py_scores` read straight from a dim-major cache (unit stride along the block slot inside segments of
    ``seg`` slots, ``seg % 8 == 0``) instead of a gathered tile, for up to ``DOT_ROWS`` of the G query heads at
    once: with ``seg % 16 == 0`` (and the tile starting 16-aligned in its segment) the tile's whole 16-key groups
    64 / 32 / 16 keys per call (``_dot64`` / ``_dot32`` / ``_dot16``: 512-bit loads, one per group and d, groups of
    different segments), then per run of the remaining keys inside one segment 32 / 16 / 8 keys per call
    (``_dot8``: 256-bit), vector loads of ``kraw[rowb + d*k_sd ...]``, the key's fp32 bits as the gather would
    write them, serving every row; rows x vectors independent accumulators keep the FMA units busy;
    ``KF_PAIRS``: one vector load of words per pair of dims, split into the two dims' keys), the rest one by
    one. Every score is the same sum in the same order (from 0, fma over d in order): the same bits."""
    pairs = kfmt == KF_PAIRS
    jj0 = 0
    off = j0 % seg  # of the tile's first key; later runs start segments
    if seg % 16 == 0 and off % 16 == 0:
        # the tile's whole groups of 16 keys: each lies inside one segment (segments start 16-aligned from the tile's
        # first key), so one call takes up to 4 groups from different segments (vLLM's amx segments hold 16 keys):
        # rows x 4 independent accumulator chains, enough to hide the FMA latency (1 group x 3 rows is not)
        nfull = nt - nt % 16
        g = 0
        while g < G:
            nr = min(G - g, DOT_ROWS)
            qo = (r0 + g) * D
            o = ao + g * BN
            u = 0
            while u + 64 <= nfull:
                _dot64(qb, qo, nr, kraw, rowb, u, k_sd, D, acc, o + u, BN, pairs)  # noqa: F821
                u += 64
            if u + 32 <= nfull:
                _dot32(qb, qo, nr, kraw, rowb, u, k_sd, D, acc, o + u, BN, pairs)  # noqa: F821
                u += 32
            if u < nfull:
                _dot16(qb, qo, nr, kraw, rowb, u, k_sd, D, acc, o + u, BN, pairs)  # noqa: F821
            g += nr
        jj0 = nfull
        off = (off + nfull) % seg
    while jj0 < nt:
        run = min(seg - off, nt - jj0)
        n8 = run - run % 8
        if n8 < run and off + n8 + 8 <= seg and jj0 + n8 + 8 <= BN:
            # the tile ends inside this segment (e.g. a request's partial last block) and 8 more keys stay inside
            # the segment's rows: their scores past ``nt`` land before ``BN`` (zeroed below up to ``BNe``, never
            # read past it)
            n8 += 8
        base = rowb[jj0]
        g = 0
        while g < G:  # up to DOT_ROWS query heads per call: each key vector load serves them all
            nr = min(G - g, DOT_ROWS)
            qo = (r0 + g) * D
            o = ao + g * BN + jj0
            u = 0
            while u + 32 <= n8:
                _dot32(qb, qo, nr, kraw, rowb, jj0 + u, k_sd, D, acc, o + u, BN, pairs)  # noqa: F821
                u += 32
            if u + 16 <= n8:
                _dot16(qb, qo, nr, kraw, rowb, jj0 + u, k_sd, D, acc, o + u, BN, pairs)  # noqa: F821
                u += 16
            if u < n8:
                _dot8(qb, qo, nr, kraw, rowb, jj0 + u, k_sd, D, acc, o + u, BN, pairs)  # noqa: F821
            g += nr
        for g in range(G):
            qo = (r0 + g) * D
            o = ao + g * BN + jj0
            for u in range(n8, run):
                a = _F0
                for d in range(D):
                    a = _fma32(qb[qo + d], _as_f32(_kbits(kraw, base + u, d, k_sd, kfmt)), a)  # noqa: F821
                acc[o + u] = a
        jj0 += run
        off = 0
    for g in range(G):  # the gathered tile's zero keys (never visible: pass 1 masks them the same way)
        for jj in range(nt, BNe):
            acc[ao + g * BN + jj] = _F0


def _py_visible(kp, kpo, qp, vis, BNe):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """``vis[jj] = 0 <= kp[kpo + jj] <= qp`` for jj < BNe; returns the number of visible keys."""
    cnt = 0
    ko = np.uint64(kpo)
    for jj in range(np.uint64(BNe)):
        k = kp[ko + jj]
        v = (k >= 0) & (k <= qp)
        vis[jj] = v
        cnt += v
    return cnt


def _py_kmax(kp, kpo, BNe):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The tile's largest key position (-1: no live key). A query at ``qp`` sees the keys a query at
    ``min(qp, kmax)`` sees, so every query past the tile (all of them but the causal diagonal's, at prefill)
    shares one visibility mask: the passes compute ``vis`` again only when ``min(qp, kmax)`` changes."""
    mx = np.int64(-1)
    ko = np.uint64(kpo)
    for jj in range(np.uint64(BNe)):
        k = kp[ko + jj]
        mx = k if k > mx else mx
    return mx


def _py_vis_at(kp, kpo, qp, kmax, vis, BNe, vq, cnt):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """``vis`` for a query at ``qp``: the mask of position ``min(qp, kmax)`` (:func:`_py_kmax`), computed only when
    that differs from ``vq``, the position ``vis`` holds (``cnt`` visible keys; -2: none yet). Returns the new
    ``(vq, cnt)``."""
    qv = qp if qp < kmax else kmax
    if qv != vq:
        return qv, _visible(kp, kpo, qv, vis, BNe)  # noqa: F821
    return vq, cnt


def _py_masked_scores(qb, i, G, D, kt, kto, vis, buf, bo, scale, BN, BNe, direct, kraw, kfmt, rowb, j0, nt, seg,
                      k_sd):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """``buf[bo + g*BN + jj] = scale * q . k`` of query ``i``'s G rows over one tile, ``_NEG`` where not visible
    (``vis`` of this query); ``direct``: the dot products read the cache, else the gathered tile at ``kt[kto:]``."""
    if direct:
        _scores_direct(qb, i * G, G, D, kraw, kfmt, rowb, j0, nt, seg, k_sd, buf, bo, BN, BNe)  # noqa: F821
    else:
        _scores(qb, i * G, G, D, kt, kto, buf, bo, BN, BNe)  # noqa: F821
    for g in range(G):
        ab = np.uint64(bo + g * BN)
        for jj in range(np.uint64(BNe)):
            s = buf[ab + jj] * scale
            buf[ab + jj] = s if vis[jj] else _NEG


def _py_pass1(qb, n_need, qp_n, G, D, kt, kto, kp, kpo, kmin, nt, vis, acc, sc, sc_off, cached, ml, nvis, scale,
              BN, W, direct, kraw, kfmt, rowb, j0, seg, k_sd):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """One key tile of pass 1: the masked scaled scores of every needed row (:func:`_py_masked_scores`; kept in
    ``sc[sc_off + i*G*BN ...]`` for the next passes when ``cached``, else in ``acc``) and the running max of each
    row's ``W`` lanes (key ``jj`` of a tile goes to lane ``jj % W``): ``ml``; ``nvis[i]`` += visible keys of query
    ``i``. No exponential here: the sums start once the row max is final (:func:`_py_pass1b`)."""
    BNe = _width(nt, BN)  # noqa: F821
    GB = G * BN
    buf = sc if cached else acc
    kmax = _kmax(kp, kpo, BNe)  # noqa: F821
    vq, cnt = np.int64(-2), 0  # vis holds the mask of a query at position vq (cnt keys)
    for i in range(n_need):
        qp = qp_n[i]
        if qp < kmin:
            continue  # no key of the tile is visible to this query
        vq, cnt = _vis_at(kp, kpo, qp, kmax, vis, BNe, vq, cnt)  # noqa: F821
        if cnt == 0:
            continue
        nvis[i] += cnt
        bo = sc_off + i * GB if cached else 0
        _masked_scores(qb, i, G, D, kt, kto, vis, buf, bo, scale, BN, BNe, direct, kraw, kfmt, rowb, j0, nt, seg,  # noqa: F821
                       k_sd)
        for g in range(G):
            mo = np.uint64((i * G + g) * W)
            for c in range(0, BNe, W):
                w = np.uint64(min(W, BNe - c))
                ab = np.uint64(bo + g * BN + c)
                for u in range(w):
                    x = buf[ab + u]
                    ml[mo + u] = x if x > ml[mo + u] else ml[mo + u]


def _py_pass1b(qb, n_need, qp_n, nvis, m, G, D, kt, kto, kp, kpo, kmin, nt, vis, acc, sc, sc_off, cached, ll, scale,
               BN, W, kraw, kfmt, rowb, j0, seg, k_sd):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """One key tile of the sum pass, once the row maxima ``m`` are final: ``e = exp(s - m)`` per visible
    (row, key) (0 elsewhere) added to the row's lane ``jj % W`` of ``ll`` (tiles in ascending order, in key
    order within a tile). ``cached``: ``e`` replaces the score in ``sc`` (pass 2 then computes no
    exponential); else the scores are recomputed from the tile (the same bits as pass 1's)."""
    BNe = _width(nt, BN)  # noqa: F821
    GB = G * BN
    buf = sc if cached else acc
    kmax = _kmax(kp, kpo, BNe)  # noqa: F821
    vq, cnt = np.int64(-2), 0  # vis holds the mask of a query at position vq (as in pass 1)
    for i in range(n_need):
        qp = qp_n[i]
        if qp < kmin or nvis[i] == 0:
            continue  # the query sees no key of the tile (or none at all)
        vq, cnt = _vis_at(kp, kpo, qp, kmax, vis, BNe, vq, cnt)  # noqa: F821
        bo = sc_off + i * GB if cached else 0
        if not cached:
            _masked_scores(qb, i, G, D, kt, kto, vis, buf, bo, scale, BN, BNe, False, kraw, kfmt, rowb, j0, nt,  # noqa: F821
                           seg, k_sd)
        for g in range(G):
            mg = m[i * G + g]
            lo = (i * G + g) * W
            for c in range(0, BNe, W):
                w = min(W, BNe - c)
                ab = bo + g * BN + c
                u = 0
                while u + 16 <= w:  # 16 keys per call (lanes u .. u + 15), then one by one: the same bits
                    _exp_acc16(buf, ab + u, vis, c + u, ll, lo + u, mg)  # noqa: F821
                    u += 16
                for t in range(u, w):
                    e = _fexp(buf[ab + t] - mg)  # noqa: F821
                    e = e if vis[c + t] else _F0
                    buf[ab + t] = e
                    ll[lo + t] += e


def _py_pass2(qb, n_need, qp_n, fl_n, w_n, thr_n, nvis, m, invl, G, D, kt, kto, kp, kpo, kmin, nt, vis, acc, sc,
              sc_off, cached, P, a_sum, a_last, a_win, a_low, ao, do_sum, do_last, do_win, do_low, scale,
              BN, kraw, kfmt, rowb, j0, seg, k_sd):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """One key tile of pass 2: ``P = sum_g exp(s - m_g) * (1 / l_g)`` per (query, key), reduced over the
    queries (in order) into the tile's contributions ``a_*[ao + jj]``. ``cached``: the exponentials are the sum
    pass's (``sc``); else the scores and their exponentials are recomputed (same bits)."""
    BNe = _width(nt, BN)  # noqa: F821
    GB = G * BN
    n = np.uint64(BNe)
    ou = np.uint64(ao)
    buf = sc if cached else acc
    kmax = _kmax(kp, kpo, BNe)  # noqa: F821
    vq, cnt = np.int64(-2), 0  # vis holds the mask of a query at position vq (as in pass 1)
    for i in range(n_need):
        qp = qp_n[i]
        if qp < kmin or nvis[i] == 0:
            continue
        vq, cnt = _vis_at(kp, kpo, qp, kmax, vis, BNe, vq, cnt)  # noqa: F821
        for jj in range(n):
            P[jj] = _F0
        bo = sc_off + i * GB if cached else 0
        if cached:
            for g in range(G):
                il = invl[i * G + g]
                ab = np.uint64(bo + g * BN)
                for jj in range(n):
                    P[jj] += buf[ab + jj] * il  # exp(s - m), 0 where not visible
        else:
            _masked_scores(qb, i, G, D, kt, kto, vis, buf, bo, scale, BN, BNe, False, kraw, kfmt, rowb, j0, nt,  # noqa: F821
                           seg, k_sd)
            for g in range(G):
                mg = m[i * G + g]
                il = invl[i * G + g]
                ab = np.uint64(bo + g * BN)
                for jj in range(n):
                    e = _fexp(buf[ab + jj] - mg)  # noqa: F821
                    e = e if vis[jj] else _F0
                    P[jj] += e * il
        f = fl_n[i]
        if do_sum:
            for jj in range(n):
                a_sum[ou + jj] += P[jj]
        if do_last and (f & F_LAST) != 0:
            for jj in range(n):
                a_last[ou + jj] += P[jj]
        if do_win and (f & F_WIN) != 0:
            for jj in range(n):
                a_win[ou + jj] += P[jj]
        if do_low:
            th = thr_n[i]
            wi = w_n[i]
            for jj in range(n):
                a_low[ou + jj] += wi if (vis[jj] & (P[jj] < th)) else _F0


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


# ---------------------------------------------------------------- loading
_K: Any = None
_LOCK = threading.Lock()


def _load() -> Any:
    """Import numba and bind the compiled kernels (once per process; compiled lazily per type signature)."""
    global _K
    if _K is not None:
        return _K
    with _LOCK:
        if _K is not None:
            return _K
        try:
            import numba
            from llvmlite import ir
            from numba import types
            from numba.extending import intrinsic
        except ImportError as e:  # pragma: no cover - numba is a dependency
            raise ImportError("update_attn_stats_cpu needs numba (requirements.lock pins numba==0.65.0: "
                              "`pip install numba`), or use the torch collector "
                              "(vtoken_runtime.stats.StatsCollector)") from e
        make_llvmlite_scan_safe()

        @intrinsic
        def as_f32(typingctx, x):  # type: ignore[no-untyped-def]
            """Reinterpret the bits of a 32-bit integer as float32."""
            if not isinstance(x, types.Integer) or x.bitwidth != 32:
                return None

            def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
                return builder.bitcast(args[0], ir.FloatType())

            return types.float32(x), codegen

        @intrinsic
        def fma32(typingctx, a, b, c):  # type: ignore[no-untyped-def]
            """``a * b + c`` rounded once (llvm.fma.f32)."""
            if not all(isinstance(x, types.Float) and x.bitwidth == 32 for x in (a, b, c)):
                return None

            def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
                return builder.fma(*args)

            return types.float32(a, b, c), codegen

        @intrinsic
        def tr8(typingctx, kraw, rowb, jb, d0, ktu, bn):  # type: ignore[no-untyped-def]
            """8 keys x 8 dims, transposed: ``ktu[(d0+u)*bn + jb + i] = bits(kraw[rowb[jb+i] + d0 + u])`` for
            i, u < 8 (bf16 bits widened into the high half of the fp32 bits): 8 vector loads, a 24-shuffle
            transpose, 8 vector stores."""
            if not (isinstance(kraw, types.Array) and kraw.dtype in (types.uint32, types.uint16)
                    and isinstance(ktu, types.Array) and ktu.dtype == types.uint32):
                return None

            def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
                kty, rty, jty, dty, oty, bty = signature.args
                k_a = context.make_array(kty)(context, builder, args[0])
                r_a = context.make_array(rty)(context, builder, args[1])
                o_a = context.make_array(oty)(context, builder, args[4])
                i64 = ir.IntType(64)
                jb_, d0_, bn_ = (context.cast(builder, args[n], t, types.int64)
                                 for n, t in ((2, jty), (3, dty), (5, bty)))
                wide = kty.dtype == types.uint16
                elt = ir.IntType(16 if wide else 32)
                v32 = ir.VectorType(ir.IntType(32), 8)
                rows = []
                for i in range(8):
                    rb = builder.load(builder.gep(r_a.data, [builder.add(jb_, ir.Constant(i64, i))]))
                    p = builder.gep(k_a.data, [builder.add(rb, d0_)])
                    v = builder.load(builder.bitcast(p, ir.VectorType(elt, 8).as_pointer()), align=elt.width // 8)
                    if wide:
                        v = builder.shl(builder.zext(v, v32), ir.Constant(v32, [16] * 8))
                    rows.append(v)

                def shuf(a, b, idx):  # type: ignore[no-untyped-def]
                    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), 8), idx))

                lo, hi = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
                t = [shuf(rows[2 * (n // 2)], rows[2 * (n // 2) + 1], lo if n % 2 == 0 else hi) for n in range(8)]
                p0, p1 = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
                s_ = [shuf(t[0], t[2], p0), shuf(t[0], t[2], p1), shuf(t[1], t[3], p0), shuf(t[1], t[3], p1),
                      shuf(t[4], t[6], p0), shuf(t[4], t[6], p1), shuf(t[5], t[7], p0), shuf(t[5], t[7], p1)]
                q0, q1 = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
                for u in range(4):  # dims u and u + 4
                    for du, idx in ((u, q0), (u + 4, q1)):
                        off = builder.add(builder.mul(builder.add(d0_, ir.Constant(i64, du)), bn_), jb_)
                        dst = builder.bitcast(builder.gep(o_a.data, [off]), v32.as_pointer())
                        builder.store(shuf(s_[u], s_[u + 4], idx), dst, align=4)
                return context.get_dummy_value()

            return types.void(kraw, rowb, jb, d0, ktu, bn), codegen

        def dot(nv: int, lanes: int) -> Any:
            """Intrinsic for ``nv`` groups of ``lanes`` keys (group ``v``: keys ``jj + v*lanes ...``, contiguous along
            the slot from ``base_v = rowb[jj + v*lanes]``, so the groups may lie in different segments or blocks) and
            ``nr`` (1 to ``DOT_ROWS``) query rows: ``out[o + r*ostr + v*lanes + u] = sum_d qb[qo + r*D + d] *
            key(kraw[base_v + d*k_sd + u])`` (u < lanes, v < nv, r < nr; keys' bf16
            bits widened into the high half of the fp32 bits), each sum fp32 from 0 over d in order (one fused
            multiply-add per term, ``llvm.fma.v{lanes}f32``: the scalar paths' bits). One loop per row count (a
            switch on ``nr``; any other ``nr`` writes nothing): ``nr * nv`` vector accumulators of ``lanes`` fp32 (8: 256-bit, 16: 512-bit; the
            same per-lane sums either way), one vector load per ``lanes`` keys and d shared by the rows, one store each at the end. ``pairs`` (32-bit words only:
            ``KF_PAIRS``): ``kraw[base_v + p*k_sd + u]`` holds dims 2p (low half) and 2p + 1 (high half) of key
            u; one load per ``lanes`` keys and pair, the two dims' terms added in order."""

            @intrinsic
            def dot_n(typingctx, qb, qo, nr, kraw, rowb, jj, k_sd, D, out, o, ostr, pairs):  # type: ignore[no-untyped-def]
                if not (isinstance(kraw, types.Array) and kraw.dtype in (types.uint32, types.uint16)
                        and isinstance(qb, types.Array) and qb.dtype == types.float32
                        and isinstance(rowb, types.Array) and rowb.dtype == types.int64
                        and isinstance(out, types.Array) and out.dtype == types.float32
                        and isinstance(pairs, types.Boolean)):
                    return None

                def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
                    qty, kty, rty, oty = (signature.args[n] for n in (0, 3, 4, 8))
                    q_a = context.make_array(qty)(context, builder, args[0])
                    k_a = context.make_array(kty)(context, builder, args[3])
                    r_a = context.make_array(rty)(context, builder, args[4])
                    o_a = context.make_array(oty)(context, builder, args[8])
                    i64 = ir.IntType(64)
                    qo_, nr_, jj_, ksd_, D_, o_, os_ = (
                        context.cast(builder, args[n], signature.args[n], types.int64) for n in (1, 2, 5, 6, 7, 9, 10))
                    bases = [builder.load(builder.gep(r_a.data, [builder.add(jj_, ir.Constant(i64, lanes * v))]))
                             for v in range(nv)]  # of each vector's first key (dim 0)
                    wide = kty.dtype == types.uint16
                    elt = ir.IntType(16 if wide else 32)
                    v32 = ir.VectorType(ir.IntType(32), lanes)
                    vf = ir.VectorType(ir.FloatType(), lanes)
                    zero = ir.Constant(vf, [0.0] * lanes)
                    vfma = builder.module.globals.get(f"llvm.fma.v{lanes}f32") or ir.Function(
                        builder.module, ir.FunctionType(vf, [vf, vf, vf]), name=f"llvm.fma.v{lanes}f32")
                    exit_ = builder.append_basic_block("dot.exit")

                    def rows_loop(paired: bool) -> None:
                        """The switch on ``nr`` and its loops, from the current block to ``exit_``."""
                        tag = "p" if paired else "d"
                        n_d = builder.ashr(D_, ir.Constant(i64, 1)) if paired else D_  # loop trips
                        switch = builder.switch(nr_, exit_)
                        for nrows in range(1, DOT_ROWS + 1):
                            pre = builder.append_basic_block(f"dot.{tag}{nrows}")
                            switch.add_case(ir.Constant(i64, nrows), pre)
                            builder.position_at_end(pre)
                            loop = builder.append_basic_block(f"dot.{tag}{nrows}.loop")
                            done = builder.append_basic_block(f"dot.{tag}{nrows}.done")
                            builder.cbranch(builder.icmp_signed(">", n_d, ir.Constant(i64, 0)), loop, done)
                            builder.position_at_end(loop)
                            d = builder.phi(i64)
                            accs = [builder.phi(vf) for _ in range(nrows * nv)]
                            dk = builder.mul(d, ksd_)
                            kvs = []  # per dim of this trip (one, or the pair's two), the nv key vectors
                            for v in range(nv):
                                p = builder.gep(k_a.data, [builder.add(bases[v], dk)])
                                kv = builder.load(builder.bitcast(p, ir.VectorType(elt, lanes).as_pointer()),
                                                  align=elt.width // 8)
                                if wide:
                                    kv = builder.shl(builder.zext(kv, v32), ir.Constant(v32, [16] * lanes))
                                if paired:
                                    kvs.append((builder.bitcast(builder.shl(kv, ir.Constant(v32, [16] * lanes)), vf),
                                                builder.bitcast(builder.and_(kv, ir.Constant(v32, [-65536] * lanes)),
                                                                vf)))
                                else:
                                    kvs.append((builder.bitcast(kv, vf),))
                            nxt = list(accs)
                            for r in range(nrows):
                                for k in range(2 if paired else 1):
                                    dd = builder.add(builder.shl(d, ir.Constant(i64, 1)), ir.Constant(i64, k)) \
                                        if paired else d
                                    qi = builder.add(builder.add(qo_, builder.mul(D_, ir.Constant(i64, r))), dd)
                                    qd = builder.load(builder.gep(q_a.data, [qi]))
                                    qv = builder.shuffle_vector(
                                        builder.insert_element(ir.Constant(vf, ir.Undefined), qd,
                                                               ir.Constant(ir.IntType(32), 0)),
                                        ir.Constant(vf, ir.Undefined), ir.Constant(v32, [0] * lanes))
                                    for v in range(nv):
                                        nxt[r * nv + v] = builder.call(vfma, [qv, kvs[v][k], nxt[r * nv + v]])
                            d1 = builder.add(d, ir.Constant(i64, 1))
                            d.add_incoming(ir.Constant(i64, 0), pre)
                            d.add_incoming(d1, loop)
                            for acc, n in zip(accs, nxt, strict=True):
                                acc.add_incoming(zero, pre)
                                acc.add_incoming(n, loop)
                            builder.cbranch(builder.icmp_signed("<", d1, n_d), loop, done)
                            builder.position_at_end(done)
                            res = [builder.phi(vf) for _ in range(nrows * nv)]
                            for rr, n in zip(res, nxt, strict=True):
                                rr.add_incoming(zero, pre)
                                rr.add_incoming(n, loop)
                            for r in range(nrows):
                                for v in range(nv):
                                    off = builder.add(builder.add(o_, builder.mul(os_, ir.Constant(i64, r))),
                                                      ir.Constant(i64, lanes * v))
                                    dst = builder.gep(o_a.data, [off])
                                    builder.store(res[r * nv + v], builder.bitcast(dst, vf.as_pointer()), align=4)
                            builder.branch(exit_)

                    if wide:  # 16-bit elements hold one dim each: no pairs
                        rows_loop(False)
                    else:
                        b_pairs = builder.append_basic_block("dot.pairs")
                        b_dims = builder.append_basic_block("dot.dims")
                        builder.cbranch(context.cast(builder, args[11], signature.args[11], types.boolean),
                                        b_pairs, b_dims)
                        builder.position_at_end(b_pairs)
                        rows_loop(True)
                        builder.position_at_end(b_dims)
                        rows_loop(False)
                    builder.position_at_end(exit_)
                    return context.get_dummy_value()

                return types.void(qb, qo, nr, kraw, rowb, jj, k_sd, D, out, o, ostr, pairs), codegen

            return dot_n

        @intrinsic
        def exp_acc16(typingctx, buf, ab, vis, vo, ll, lo, mg):  # type: ignore[no-untyped-def]
            """16 keys of the sum pass at once (512-bit vectors; two 256-bit halves without AVX-512):
            ``e = exp(buf[ab + u] - mg)`` (:func:`_py_fexp`'s operations in its order: the same bits), 0 where
            ``vis[vo + u]`` is false; ``buf[ab + u] = e`` and ``ll[lo + u] += e`` for u < 16."""
            if not (isinstance(buf, types.Array) and buf.dtype == types.float32
                    and isinstance(ll, types.Array) and ll.dtype == types.float32
                    and isinstance(vis, types.Array) and vis.dtype == types.boolean):
                return None

            def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
                b_a = context.make_array(signature.args[0])(context, builder, args[0])
                v_a = context.make_array(signature.args[2])(context, builder, args[2])
                l_a = context.make_array(signature.args[4])(context, builder, args[4])
                ab_, vo_, lo_ = (context.cast(builder, args[n], signature.args[n], types.int64) for n in (1, 3, 5))
                f32, i32 = ir.FloatType(), ir.IntType(32)
                vf, vi = ir.VectorType(f32, 16), ir.VectorType(i32, 16)

                def splat(x: float) -> Any:
                    return ir.Constant(vf, [float(np.float32(x))] * 16)

                def vptr(arr: Any, off: Any, ty: Any) -> Any:
                    return builder.bitcast(builder.gep(arr.data, [off]), ty.as_pointer())

                mgv = builder.insert_element(ir.Constant(vf, ir.Undefined), args[6], ir.Constant(i32, 0))
                mgv = builder.shuffle_vector(mgv, ir.Constant(vf, ir.Undefined), ir.Constant(vi, [0] * 16))
                p_buf = vptr(b_a, ab_, vf)
                x = builder.fsub(builder.load(p_buf, align=4), mgv)
                lo_c, zero = splat(_EXP_LO), splat(0.0)
                x = builder.select(builder.fcmp_ordered(">", x, lo_c), x, lo_c)
                x = builder.select(builder.fcmp_ordered("<", x, zero), x, zero)
                vfloor = builder.module.globals.get("llvm.floor.v16f32") or ir.Function(
                    builder.module, ir.FunctionType(vf, [vf]), name="llvm.floor.v16f32")
                fx = builder.call(vfloor, [builder.fadd(builder.fmul(x, splat(_LOG2E)), splat(_HALF))])
                z = builder.fsub(x, builder.fmul(fx, splat(_LN2_HI)))
                z = builder.fsub(z, builder.fmul(fx, splat(_LN2_LO)))
                y = builder.fadd(builder.fmul(splat(_P0), z), splat(_P1))
                for c in (_P2, _P3, _P4, _P5):
                    y = builder.fadd(builder.fmul(y, z), splat(c))
                y = builder.fadd(builder.fadd(builder.fmul(y, builder.fmul(z, z)), z), splat(1.0))
                n = builder.add(builder.fptosi(fx, vi), ir.Constant(vi, [127] * 16))
                e = builder.fmul(y, builder.bitcast(builder.shl(n, ir.Constant(vi, [23] * 16)), vf))
                vb = builder.load(vptr(v_a, vo_, ir.VectorType(ir.IntType(8), 16)), align=1)
                e = builder.select(builder.icmp_unsigned("!=", vb, ir.Constant(ir.VectorType(ir.IntType(8), 16),
                                                                                [0] * 16)), e, zero)
                builder.store(e, p_buf, align=4)
                p_ll = vptr(l_a, lo_, vf)
                builder.store(builder.fadd(builder.load(p_ll, align=4), e), p_ll, align=4)
                return context.get_dummy_value()

            return types.void(buf, ab, vis, vo, ll, lo, mg), codegen

        g = globals()
        g["_exp_acc16"] = exp_acc16
        g["_as_f32"] = as_f32
        g["_fma32"] = fma32
        g["_tr8"] = tr8
        g["_dot8"] = dot(1, 8)
        g["_dot16"] = dot(1, 16)  # one 512-bit vector per 16 keys (two 256-bit halves on a CPU without AVX-512)
        g["_dot32"] = dot(2, 16)
        g["_dot64"] = dot(4, 16)
        opts = {"cache": True, "nogil": True, "fastmath": False}
        g["_fexp"] = numba.njit(inline="always", **opts)(_py_fexp)
        g["_kbits"] = numba.njit(inline="always", **opts)(_py_kbits)
        g["_gather"] = numba.njit(**opts)(_py_gather)
        g["_scores"] = numba.njit(**opts)(_py_scores)
        g["_scores_direct"] = numba.njit(**opts)(_py_scores_direct)
        g["_visible"] = numba.njit(inline="always", **opts)(_py_visible)
        g["_width"] = numba.njit(inline="always", **opts)(_py_width)
        g["_kmax"] = numba.njit(inline="always", **opts)(_py_kmax)
        g["_vis_at"] = numba.njit(inline="always", **opts)(_py_vis_at)
        g["_masked_scores"] = numba.njit(inline="always", **opts)(_py_masked_scores)
        g["_pass1"] = numba.njit(**opts)(_py_pass1)
        g["_pass1b"] = numba.njit(**opts)(_py_pass1b)
        g["_pass2"] = numba.njit(**opts)(_py_pass2)
        _K = numba.njit(**opts)(_py_kernel)
    return _K


def kernels_available() -> bool:
    """True when numba imports (the kernel can run); does not compile anything."""
    try:
        _load()
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------- wrapper
def _flat(t: torch.Tensor, as_dtype: torch.dtype | None = None) -> np.ndarray:
    """1-D numpy array (zero copy) over the memory a tensor spans, from its first element; ``as_dtype``
    reinterprets the bits (same element size)."""
    if as_dtype is not None and as_dtype != t.dtype:
        t = t.view(as_dtype)
    if t.is_contiguous():
        return t.numpy().reshape(-1)
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0
    return torch.as_strided(t, (span,), (1,)).numpy()


_UNUSED = np.zeros(1, np.float32)


def _tile(D: int, block_n: int | None) -> int:
    if block_n is not None:
        if not 1 <= int(block_n) <= _MAX_TILE:
            raise ValueError(f"block_n must be in [1, {_MAX_TILE}], got {block_n}")
        return int(block_n)
    return 128 if D <= 64 else 64


class PreparedLayer:
    """What the kernel reads of one layer's cache tensors, as zero-copy numpy views, validated once
    (:func:`prepare_layer`): the keys ``[NB, bs, H_kv, D]`` (raw bits and strides), the key positions and
    the statistic stores. A caller that runs the kernel every step keeps one per layer while those tensors
    stay the same (``StatsCollector``: ~60 us of Python per call saved in the serving engine)."""

    __slots__ = ("D", "Hkv", "bs", "do", "kfmt", "kp_rs", "kpos", "kraw", "kseg", "kstrides", "outs", "rs")

    def __init__(self, kraw: np.ndarray, kfmt: int, kstrides: tuple[int, int, int, int], kseg: tuple[int, int],
                 bs: int, Hkv: int, D: int, kpos: np.ndarray, kp_rs: int, outs: tuple[np.ndarray, ...],
                 do: tuple[bool, ...], rs: int) -> None:
        self.kraw, self.kfmt, self.kstrides, self.kseg, self.bs, self.Hkv, self.D = kraw, kfmt, kstrides, kseg, bs, Hkv, D
        self.kpos, self.kp_rs, self.outs, self.do, self.rs = kpos, kp_rs, outs, do, rs


@dataclass(frozen=True)
class PairedKeys:
    """A bf16 key cache stored as pairs of dims in 32-bit words, which no strided bf16 view can address (vLLM's
    CPU ``amx`` layout, ``vtoken_runtime.vllm_plugin.cpu_layout.amx_paired_keys``). A block's ``bs`` slots are
    stored in segments of ``segment`` slots, ``segment_stride`` words apart; inside a segment, ``strides`` (in
    words: block, slot, head, pair) address the words::

        words[o + n * s_nb + (t // segment) * segment_stride + (t % segment) * s_t + h * s_h + p * s_p]
            = bits(K[n, t, h, 2p]) | bits(K[n, t, h, 2p + 1]) << 16          (o = words.storage_offset())

    The kernel reads it in place (``KF_PAIRS``) with the bits and the results of the plain layouts."""

    words: torch.Tensor  # int32, its first element is K word 0 of block 0, head 0
    shape: tuple[int, int, int, int]  # (NB, bs, H_kv, D) of the keys
    strides: tuple[int, int, int, int]
    segment: int
    segment_stride: int = 0

    def __post_init__(self) -> None:
        NB, bs, H, D = self.shape
        if self.words.dtype != torch.int32 or D % 2 or self.segment < 1 or bs % self.segment:
            raise ValueError(f"PairedKeys: words must be int32 ({self.words.dtype}), D even ({D}) and the segment "
                             f"({self.segment}) must divide the block size ({bs})")
        if self.words.storage_offset() + self.span() > self.words.untyped_storage().nbytes() // 4:
            raise ValueError("PairedKeys: the strides address words past the end of the storage")

    @property
    def device(self) -> torch.device:
        return self.words.device

    def span(self) -> int:
        """Words from the first one to the last one addressed, inclusive."""
        NB, bs, H, D = self.shape
        dims = (NB, self.segment, H, D // 2)
        return 1 + sum((n - 1) * st for n, st in zip(dims, self.strides, strict=True)) \
            + (bs // self.segment - 1) * self.segment_stride

    def segments(self) -> list[torch.Tensor]:
        """``[NB, segment, H_kv, D // 2]`` int32 views of the words, one per segment of the blocks."""
        NB, bs, H, D = self.shape
        o = self.words.storage_offset()
        return [torch.as_strided(self.words, (NB, self.segment, H, D // 2), self.strides, o + i * self.segment_stride)
                for i in range(bs // self.segment)]

    def unpack(self) -> torch.Tensor:
        """``[NB, bs, H_kv, D]`` bf16 copy of the keys (for references and tests)."""
        w = torch.cat(self.segments(), dim=1)
        halves = torch.stack([(w & 0xFFFF).to(torch.int16), (w >> 16).to(torch.int16)], dim=-1)
        return halves.reshape(*self.shape).view(torch.bfloat16)


def prepare_layer(key_cache: torch.Tensor | PairedKeys, key_positions: torch.Tensor,
                  stats: dict[str, torch.Tensor]) -> PreparedLayer:
    """Validate one layer's tensors (the arguments of :func:`update_attn_stats_cpu`) and view them as numpy
    arrays over the same memory. ``stats`` must not be empty."""
    unknown = set(stats) - set(STAT_NAMES)
    if unknown:
        raise ValueError(f"unknown attention statistics {sorted(unknown)}; known: {STAT_NAMES}")
    NB, bs, Hkv, D = key_cache.shape
    if key_cache.device.type != "cpu":
        raise ValueError("update_attn_stats_cpu takes CPU tensors (the Triton kernel runs on GPUs)")
    kraw: np.ndarray
    kseg = (bs, 0)
    if isinstance(key_cache, PairedKeys):  # strides in words, one per pair of dims along the last axis
        w = key_cache.words.detach()
        kraw = torch.as_strided(w, (key_cache.span(),), (1,), w.storage_offset()).numpy().view(np.uint32)
        kfmt, kstrides, kseg = KF_PAIRS, key_cache.strides, (key_cache.segment, key_cache.segment_stride)
    elif key_cache.dtype == torch.float32:
        kraw, kfmt, kstrides = _flat(key_cache.detach(), torch.int32).view(np.uint32), KF_F32, key_cache.stride()
    elif key_cache.dtype == torch.bfloat16:
        kraw, kfmt, kstrides = _flat(key_cache.detach(), torch.int16).view(np.uint16), KF_BF16, key_cache.stride()
    else:
        raise ValueError(f"key_cache dtype {key_cache.dtype} not supported (float32, bfloat16)")
    if key_positions.shape[0] not in (1, Hkv):
        raise ValueError(f"key_positions rows must be 1 or H_kv={Hkv}, got {key_positions.shape[0]}")
    outs: list[np.ndarray] = []
    rs = None
    for n in STAT_NAMES:
        t = stats.get(n)
        if t is None:
            outs.append(_UNUSED)  # never written (its flag is off)
            continue
        if (t.dtype != torch.float32 or t.dim() != 2 or t.shape[0] != Hkv or t.stride(1) != 1
                or t.device.type != "cpu" or (rs is not None and t.stride(0) != rs)):
            raise ValueError("stats must be [H_kv, S] float32 CPU tensors with unit stride along S and equal strides")
        rs = t.stride(0)
        outs.append(_flat(t))
    if rs is None:
        raise ValueError("prepare_layer needs at least one statistic")
    kp = key_positions.detach()
    if kp.dtype != torch.int64 or kp.stride(-1) != 1:
        # a converted copy would not see later writes: the kernel needs the store itself
        raise ValueError(f"key_positions must be int64 with unit stride along S, got {kp.dtype}, strides {kp.stride()}")
    per_head = kp.shape[0] == Hkv and Hkv > 1
    return PreparedLayer(kraw, kfmt, tuple(kstrides), kseg, bs, Hkv, D, _flat(kp), kp.stride(0) if per_head else 0,
                         tuple(outs), tuple(n in stats for n in STAT_NAMES), rs)


Step = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]  # see prepare_step


def prepare_step(block_tables: torch.Tensor, cache_lens: torch.Tensor, query_pos: torch.Tensor,
                 prompt_lens: torch.Tensor | None, token_index: torch.Tensor | None = None) -> Step:
    """The step's metadata as the kernel reads it (the same for every layer of a step):
    ``(block_tables int32 [B, max_blocks], cache_lens int32 [B], query_pos int64 [B, Q], prompt_lens int64 [B],
    token_index int64 [B, Q] or None)``. ``token_index`` (-1 = padding): the row of (request ``b``, query ``q``) in
    the flat query rows :func:`run_prepared` then takes (``[T, H_q, D]``, e.g. vLLM's query tensor of the step, read
    in place: no padded ``[B, Q, H_q, D]`` copy); None: :func:`run_prepared` takes ``query [B, Q, H_q, D]``."""
    bt = np.ascontiguousarray(block_tables.numpy(), dtype=np.int32)
    lens = np.ascontiguousarray(cache_lens.numpy(), dtype=np.int32)
    qpos = np.ascontiguousarray(query_pos.numpy(), dtype=np.int64)
    if prompt_lens is None:
        plen = qpos.max(1) + 1 if qpos.size else np.zeros(qpos.shape[0], np.int64)
    else:
        plen = np.ascontiguousarray(prompt_lens.numpy(), dtype=np.int64)
    tok = None
    if token_index is not None:
        if tuple(token_index.shape) != qpos.shape:
            raise ValueError(f"token_index {tuple(token_index.shape)}; expected query_pos's shape {qpos.shape}")
        tok = np.ascontiguousarray(token_index.numpy(), dtype=np.int64)
    return bt, lens, qpos, plen, tok


def _query_rows(rows: torch.Tensor) -> tuple[np.ndarray, bool]:
    """``rows [T, H_q, D]`` as the kernel reads them: ``(C-contiguous array, bf16 bits)``: bf16 as its uint16 bits
    (widened exactly in the kernel; no fp32 copy), fp32 as it is, another dtype converted to fp32."""
    r = rows.detach()
    if r.dtype == torch.bfloat16:
        return r.contiguous().view(torch.int16).numpy().view(np.uint16), True
    return r.to(torch.float32).contiguous().numpy(), False


def run_prepared(layer: PreparedLayer, step: Step, query: torch.Tensor, scale: float | None = None,
                 obs_window: int = 32, history_window: int = 64, low_attn_threshold: float = 1.0,
                 block_n: int | None = None) -> None:
    """:func:`update_attn_stats_cpu` on a :func:`prepare_layer` / :func:`prepare_step` pair: ``query [B, Q, H_q, D]``,
    or, with the step's ``token_index``, the flat query rows ``[T, H_q, D]`` it indexes (only the rows of valid
    queries are read)."""
    bt, lens, qpos, plen, tok = step
    if tok is None:
        if query.dim() != 4:
            raise ValueError(f"query {tuple(query.shape)}; expected [B, Q, H_q, D] (or rows [T, H_q, D] with a "
                             "token_index in prepare_step)")
        B, Q, Hq, D = query.shape
        rows = query.reshape(B * Q, Hq, D)
        tok = np.arange(B * Q, dtype=np.int64).reshape(B, Q)
    else:
        if query.dim() != 3:
            raise ValueError(f"query {tuple(query.shape)}; expected rows [T, H_q, D] (the step has a token_index)")
        (B, Q), (T, Hq, D) = tok.shape, query.shape
        if tok.size and int(tok.max()) >= T:
            raise ValueError(f"token_index reaches row {int(tok.max())} of {T} query rows")
        rows = query
    Hkv = layer.Hkv
    if D != layer.D or Hq % Hkv:
        raise ValueError(f"query {tuple(query.shape)} does not match the key cache (H_kv {Hkv}, D {layer.D})")
    if query.device.type != "cpu":
        raise ValueError("update_attn_stats_cpu takes CPU tensors (the Triton kernel runs on GPUs)")
    if B == 0 or Q == 0:
        return
    G = Hq // Hkv
    BN = _tile(D, block_n)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    qf, q_bits = _query_rows(rows)
    s_nb, s_bs, s_h, s_d = layer.kstrides
    o_sum, o_last, o_win, o_low = layer.outs
    f_sum, f_last, f_win, f_low = layer.do
    decay = np.float32(1.0 - 1.0 / int(history_window))
    thr_g = np.float32(float(low_attn_threshold) * G)  # the collector's threshold * group_size, in fp32
    _load()(qf, tok, q_bits, layer.kraw, layer.kfmt, s_nb, s_bs, s_h, s_d, *layer.kseg, bt, lens, qpos, plen, layer.kpos,
            layer.kp_rs, layer.bs, Hkv, o_sum, o_last, o_win, o_low, layer.rs, f_sum, f_last, f_win, f_low,
            np.float32(scale), int(obs_window), decay, thr_g, BN, max(1, SCRATCH_BYTES // (D * BN * 4 + BN * 16)),
            SCORE_BYTES // 4)


def update_attn_stats_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor | PairedKeys,
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
    """Update ``stats[name]`` (``[H_kv, S]`` float32 CPU tensors, names from :data:`STAT_NAMES`; only those
    present are computed) in place for one layer and one step, exactly like the Triton
    ``update_attn_stats`` (same arguments): ``query [B, Q, H_q, D]``, ``key_cache [NB, bs, H_kv, D]``
    (float32 or bfloat16, any strides: a unit stride along D takes the vectorised 8 x 8 gather, a unit stride
    along the block slot (vLLM's CPU layout stores K dim-major) contiguous per-dim copies or, with a block size
    that is a multiple of 8 and cached scores, no copy (dot products read the cache), another the scalar one;
    same bits; or :class:`PairedKeys`, bf16 pairs of dims in 32-bit words, read the same ways),
    ``block_tables [B, max_blocks]``, ``cache_lens [B]``, ``query_pos [B, Q]`` (-1 = padding),
    ``key_positions [H_kv or 1, S]`` (-1 = dead), ``prompt_lens [B]`` (default: the end of this step).
    ``block_n`` = key tile width (default 128 for D <= 64, else 64); ``num_warps`` is ignored (GPU only)."""
    del num_warps
    if not stats:
        return
    kp = key_positions
    if kp.dtype != torch.int64 or kp.stride(-1) != 1:
        kp = kp.to(torch.int64).contiguous()  # read-only here: a converted copy is fine
    run_prepared(prepare_layer(key_cache, kp, stats), prepare_step(block_tables, cache_lens, query_pos, prompt_lens),
                 query, scale, obs_window, history_window, low_attn_threshold, block_n)
