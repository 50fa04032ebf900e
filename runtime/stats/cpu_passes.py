"""The three passes of the numba statistics kernel over one key tile (compiled by :func:`bind`), for the rows of a
request's needed queries (query heads of one KV head's GQA group):

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
   overwrite and the decay as in the torch backend, :mod:`.torch_stats`).

Visibility: key ``j`` is visible to a query at ``qp`` iff its position ``kp`` satisfies ``0 <= kp <= qp``
(:func:`_py_visible`); a tile's mask is shared by every query past its largest key (:func:`_py_kmax`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .cpu_gather import KF_PAIRS
from .cpu_numerics import _F0, _NEG, DOT_ROWS

F_LAST, F_WIN = 2, 4  # per-query flags


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
    buf = sc if cached else acc
    kmax = _kmax(kp, kpo, BNe)  # noqa: F821
    vq, cnt = np.int64(-2), 0  # vis holds the mask of a query at position vq (as in pass 1)
    ou = np.uint64(ao)  # the tile's first virtual slot in the contributions
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



def bind(numba: Any, opts: dict[str, Any], callees: dict[str, Any]) -> dict[str, Any]:
    """Compile this module's functions (numba compiles each on its first call) and bind them, with ``callees``
    (the numerics' and the gather's), to the globals they are called by here; returns them by name."""
    own = {
        "_scores": numba.njit(**opts)(_py_scores),
        "_scores_direct": numba.njit(**opts)(_py_scores_direct),
        "_visible": numba.njit(inline="always", **opts)(_py_visible),
        "_kmax": numba.njit(inline="always", **opts)(_py_kmax),
        "_vis_at": numba.njit(inline="always", **opts)(_py_vis_at),
        "_masked_scores": numba.njit(inline="always", **opts)(_py_masked_scores),
        "_pass1": numba.njit(**opts)(_py_pass1),
        "_pass1b": numba.njit(**opts)(_py_pass1b),
        "_pass2": numba.njit(**opts)(_py_pass2),
    }
    globals().update(callees)
    globals().update(own)
    return own
