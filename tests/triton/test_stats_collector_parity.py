"""The Triton statistics kernel equals the runtime's torch stats collector (``backend="torch"``: no code shared
with the kernel) on a real VTokenCache (several steps: prefill, eviction, reclaim, decode). The kernel's values
against the independent dense oracle are ``tests/triton/test_stats_values.py``'s."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vtoken_runtime.cache import VTokenCache
from vtoken_runtime.kernels.attn_stats_ref import STAT_NAMES
from vtoken_runtime.stats import StatsCollector
from vtoken_sdk import StatsConfig

pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


@pytest.mark.parametrize("granularity", ["head", "request"])
def test_kernel_matches_stats_collector_over_steps(granularity: str) -> None:
    from vtoken_runtime.kernels.attn_stats_triton import update_attn_stats

    torch.manual_seed(0)
    L, H, G, D, bs = 1, 2, 3, 16, 4
    cache = VTokenCache(L, H, D, bs, num_blocks=24, granularity=granularity, mode="compact",
                        stat_names=STAT_NAMES, async_copy=False)
    mirror = {n: cache.stats_tensor(n)[0].clone() for n in STAT_NAMES}
    # the torch backend (probabilities over the paged cache, then the update rules): auto would pick the numba
    # kernel on these CPU tensors, so name the backend this test compares with
    col = StatsCollector(cache, STAT_NAMES, StatsConfig(obs_window=2, history_window=4), G, backend="torch")
    assert col.backend == "torch"
    prompt = torch.tensor([8, 6])  # the window lands on the prompt's last 2 queries, across steps 0-2
    reqs = ["a", "b"]
    for r in reqs:
        cache.add_request(r)
    rng = np.random.default_rng(0)
    for step, q_len in enumerate([7, 1, 1, 3, 1]):
        qpos = []
        for i, r in enumerate(reqs):
            n = q_len if not (step == 0 and i == 1) else 5
            start = cache.logical_len(r)
            slots = cache.reserve(r, n)
            for t in mirror.values():  # the runtime zeroes the stats of new tokens' slots
                t[:, torch.as_tensor(slots)] = 0.0
            cache.write_kv(0, r, torch.randn(n, H, D), torch.randn(n, H, D))
            qpos.append(list(range(start, start + n)) + [-1] * (max(q_len, 5 if step == 0 else q_len) - n))
        Q = max(len(p) for p in qpos)
        query_pos = torch.tensor([p + [-1] * (Q - len(p)) for p in qpos])
        query = torch.randn(len(reqs), Q, H * G, D)
        md = cache.attention_metadata(reqs)
        col.attention(0, query, md, query_pos, prompt)
        update_attn_stats(query, cache.key_cache(0), md.block_tables, md.cache_lens, query_pos,
                          cache.key_positions(0), mirror, obs_window=2, history_window=4, prompt_lens=prompt,
                          block_n=16)
        for n in STAT_NAMES:
            torch.testing.assert_close(mirror[n], cache.stats_tensor(n)[0], atol=2e-6, rtol=1e-5,
                                       msg=lambda m, n=n, s=step: f"step {s} {n}: {m}")
        if step == 2:  # evict some tokens and reclaim: stats move with their tokens (mirror them too)
            for r in reqs:
                live = cache.live_tokens(r)
                keep = torch.ones(1 if granularity == "request" else L * H, live, dtype=torch.bool)
                keep[:, rng.choice(np.arange(1, live - 1), size=3, replace=False)] = False
                cache.apply_keep_mask(r, keep)
            cache.reclaim(reqs)
            cache.fence()
            for n in STAT_NAMES:
                mirror[n].copy_(cache.stats_tensor(n)[0])
