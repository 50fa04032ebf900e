"""Copy engine: moves K/V, stats and positions exactly as the plan says (simultaneous-assignment
semantics), for both layouts and granularities, with overlapping ordered-mode moves split into tiny
chunks, synchronously and on the worker thread."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vtoken_runtime.cache import VTokenCache
from vtoken_runtime.copy_engine import CopyPlan
from vtoken_runtime.planner import plan_compact, plan_ordered

L, H, D, BS, NB = 2, 3, 4, 4, 10


@pytest.mark.parametrize("async_copy", [False, True])
@pytest.mark.parametrize("chunk", [8, 1 << 20])
@pytest.mark.parametrize("planner", ["ordered", "compact"])
@pytest.mark.parametrize("layout", ["generic", "vllm_cpu"])
@pytest.mark.parametrize("granularity", ["request", "head"])
def test_moves_match_reference(granularity: str, layout: str, planner: str, chunk: int, async_copy: bool) -> None:
    c = VTokenCache(L, H, D, BS, NB, granularity=granularity, kv_layout=layout, stat_names=("a", "b"),
                    async_copy=async_copy, copy_chunk_bytes=chunk)
    g = torch.Generator().manual_seed(0)
    for layer in range(L):
        c.kv_caches[layer].copy_(torch.randn(c.kv_caches[layer].shape, generator=g))
    for t in c.store.stats.values():
        t.copy_(torch.randn(t.shape, generator=g))
    c.store.positions.copy_(torch.randint(0, 1000, c.store.positions.shape, generator=g))
    rng = np.random.default_rng(1)
    R, U, n = c.num_rows, 4 * BS, 7
    live = np.zeros((R, U), bool)
    for r in range(R):
        live[r, rng.choice(U, n, replace=False)] = True
    rows, src, dst = (plan_ordered if planner == "ordered" else plan_compact)(live, n)
    blocks = np.array([7, 2, 9, 4])  # a request's (scattered) blocks
    ps, pd = blocks[src // BS] * BS + src % BS, blocks[dst // BS] * BS + dst % BS
    old_k = [c.key_cache(layer).clone() for layer in range(L)]
    old_v = [c.value_cache(layer).clone() for layer in range(L)]
    old_s = {k: t.clone() for k, t in c.store.stats.items()}
    old_p = c.store.positions.clone()
    c.engine.submit(CopyPlan(rows, ps, pd))
    c.fence()
    for layer in range(L):
        ek, ev = old_k[layer].clone(), old_v[layer].clone()
        es = {k: t[layer].clone() for k, t in old_s.items()}
        for r, s, d in zip(rows.tolist(), ps.tolist(), pd.tolist(), strict=True):
            if R > 1 and r // H != layer:
                continue
            hs = [r % H] if R > 1 else list(range(H))
            for h in hs:
                ek[d // BS, d % BS, h] = old_k[layer][s // BS, s % BS, h]
                ev[d // BS, d % BS, h] = old_v[layer][s // BS, s % BS, h]
                for k in es:
                    es[k][h, d] = old_s[k][layer, h, s]
        assert torch.equal(c.key_cache(layer), ek) and torch.equal(c.value_cache(layer), ev)
        for k in es:
            assert torch.equal(c.store.stats[k][layer], es[k])
    ep = old_p.clone()
    for r, s, d in zip(rows.tolist(), ps.tolist(), pd.tolist(), strict=True):
        ep[r, d] = old_p[r, s]
    assert torch.equal(c.store.positions, ep)
    assert c.engine.bytes_moved == rows.size * c.engine.row_bytes()
