"""Attention-statistics kernels vs the dense torch reference (TRITON_INTERPRET=1).

Tolerance (docs/kernels.md): attn_sum / attn_last / attn_window within atol 2e-6 + rtol 1e-5 of the
reference (fp32 softmax, different summation order); low_attn_count (a decayed count) within the same
tolerance, except for (query, key) pairs whose attention lies within 1e-5 (relative) of the
threshold, where either side of the comparison is allowed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vtoken_runtime.kernels.attn_stats_ref import STAT_NAMES, apply_step_stats, step_stats

pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

ATOL, RTOL, THR_RTOL = 2e-6, 1e-5, 1e-5


def _case(seed: int, B: int, Q: int, G: int, Hkv: int, D: int, bs: int, per_head: bool, dtype: torch.dtype,
          prefill: bool, all_queries: bool = False):
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    NB = 3 * B * 4 + 2
    max_blocks = 4
    query = (torch.randn(B, Q, G * Hkv, D, generator=g) * 2).to(dtype)
    cache = (torch.randn(NB, Hkv, bs, 2 * D, generator=g) * 2).to(dtype)  # vllm_cpu layout
    key_cache = cache[..., :D].permute(0, 2, 1, 3)  # [NB, bs, Hkv, D] view
    perm = torch.as_tensor(rng.permutation(NB)[: B * max_blocks].reshape(B, max_blocks), dtype=torch.int32)
    lo = max_blocks * bs // 2 if all_queries else 0
    lens = torch.as_tensor(rng.integers(lo, max_blocks * bs + 1, size=B), dtype=torch.int32)
    S = NB * bs
    R = Hkv if per_head else 1
    kpos = torch.full((R, S), -1, dtype=torch.int64)
    qpos = torch.full((B, Q), -1, dtype=torch.int64)
    for b in range(B):
        n = int(lens[b])
        for j in range(n):
            s = int(perm[b, j // bs]) * bs + j % bs
            for r in range(R):
                kpos[r, s] = -1 if rng.random() < 0.15 else int(rng.integers(0, n + Q))
        nq = int(rng.integers(0, Q + 1)) if B > 1 and not all_queries else Q
        start = n if prefill else max(n - 1, 0)
        qpos[b, :nq] = torch.arange(start, start + nq)
    return query, key_cache, perm, lens, qpos, kpos, S, Hkv


def _run(seed, B, Q, G, Hkv, D, bs, per_head, dtype, prefill, obs, hist, thr,  # type: ignore[no-untyped-def]
         all_queries=False):
    from vtoken_runtime.kernels.attn_stats_triton import update_attn_stats

    query, key_cache, bt, lens, qpos, kpos, S, Hkv = _case(seed, B, Q, G, Hkv, D, bs, per_head, dtype, prefill,
                                                              all_queries)
    g = torch.Generator().manual_seed(seed + 1)
    init = {n: torch.rand(Hkv, S, generator=g) for n in STAT_NAMES}
    got = {n: v.clone() for n, v in init.items()}
    want = {n: v.clone() for n, v in init.items()}
    update_attn_stats(query, key_cache, bt, lens, qpos, kpos, got, obs_window=obs, history_window=hist,
                      low_attn_threshold=thr, block_n=16)
    c = step_stats(query, key_cache, key_cache, bt, lens, qpos, kpos, obs_window=obs, history_window=hist,
                   low_attn_threshold=thr)
    apply_step_stats(want, c, bt, lens, qpos, bs)
    for n in ("attn_sum", "attn_last", "attn_window"):
        torch.testing.assert_close(got[n], want[n], atol=ATOL, rtol=RTOL, msg=lambda m, n=n: f"{n}: {m}")
    # low_attn_count: exact unless an attention value sits on the threshold
    near = ((c["visible"] & ((c["P"] - c["threshold"]).abs() <= THR_RTOL * c["threshold"])).float()
            * c["weight"][:, None, :, None]).sum(2)  # [B, Hkv, Lm]: weight of queries on the threshold
    slack = torch.zeros(Hkv, S)
    apply_step_stats({"low_attn_count": slack}, {"low_attn_count": near, "low_attn_scale": c["low_attn_scale"]},
                     bt, lens, qpos, bs)
    diff = (got["low_attn_count"] - want["low_attn_count"]).abs()
    assert bool((diff <= slack + ATOL + RTOL * want["low_attn_count"].abs()).all()), \
        f"low_attn_count off by {diff.max()}"
    return c


@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize("per_head", [True, False])
def test_decode_and_prefill_match_reference(prefill: bool, per_head: bool) -> None:
    Q = 5 if prefill else 1
    c = _run(0, 3, Q, 3, 2, 16, 4, per_head, torch.float32, prefill, obs=2, hist=3, thr=1.0, all_queries=True)
    assert c["visible"].sum() > 50 and (c["low_attn_count"] > 0).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_cache_gqa_9_to_3(dtype: torch.dtype) -> None:
    c = _run(1, 2, 1, 3, 3, 32, 8, True, dtype, False, obs=32, hist=64, thr=0.5, all_queries=True)
    assert c["visible"].sum() > 20


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), B=st.integers(1, 3), Q=st.integers(1, 6), G=st.sampled_from([1, 2, 3, 4]),
       Hkv=st.integers(1, 2), per_head=st.booleans(), prefill=st.booleans(), obs=st.integers(1, 4),
       hist=st.integers(1, 8), thr=st.sampled_from([0.5, 1.0, 2.0]))
def test_hypothesis_shapes(seed, B, Q, G, Hkv, per_head, prefill, obs, hist, thr) -> None:
    _run(seed, B, Q, G, Hkv, 16, 4, per_head, torch.float32, prefill, obs, hist, thr)
