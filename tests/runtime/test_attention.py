"""Attention over the compacted paged cache == dense attention over the kept tokens (fp32, <= 1e-5).

Chunked prefill and decode, batched requests of different lengths, GQA, both granularities, both K/V
layouts, compact / ordered / naive. In compact and ordered mode the check is done twice: with true
key positions (the reference kernel) and with the *unmodified* vLLM rule (key index <= cache_len -
query_len + i, no positions, no mask), which is what makes reclamation transparent to real kernels.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken_runtime.cache import VTokenCache
from vtoken_runtime.paged_attention import dense_attention, paged_attention

from ._runtime_helpers import kv_values

L, H, G, D, BS, NB = 2, 2, 3, 8, 4, 96
TOL = 1e-5


class Driver:
    """Drives a cache like an engine would and keeps an independent model of what was kept."""

    def __init__(self, granularity: str, mode: str, layout: str, seed: int) -> None:
        self.c = VTokenCache(L, H, D, BS, NB, granularity=granularity, mode=mode, kv_layout=layout,
                             stat_names=("acc",), debug=True)
        self.R = self.c.num_rows
        self.rng = np.random.default_rng(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.uid: dict[str, int] = {}
        self.live: dict[str, np.ndarray] = {}  # [R, logical_len] bool

    def add(self, rid: str) -> None:
        self.c.add_request(rid, pinned_positions=[0])
        self.uid[rid] = len(self.uid) + 1
        self.live[rid] = np.zeros((self.R, 0), bool)

    def append(self, rid: str, n: int) -> np.ndarray:
        start = self.live[rid].shape[1]
        assert self.c.reserve(rid, n) is not None
        pos = np.arange(start, start + n)
        for layer in range(L):
            k, v = kv_values(self.uid[rid], layer, H, pos, D)
            self.c.write_kv(layer, rid, k, v)
        self.live[rid] = np.concatenate([self.live[rid], np.ones((self.R, n), bool)], axis=1)
        return pos

    def evict(self, rid: str, frac: float) -> None:
        pos, _ = self.c.live_view(rid)
        R, n = pos.shape
        k = max(1, int(round(n * (1 - frac))))
        score = self.rng.random((R, n)) + 2.0 * (pos == 0)  # pin position 0
        keep = np.zeros((R, n), bool)
        np.put_along_axis(keep, np.argsort(-score, axis=1)[:, :k], True, axis=1)
        self.c.apply_keep_mask(rid, keep)
        r, c = np.nonzero(~keep)
        self.live[rid][r, pos[r, c]] = False

    def dense(self, rid: str, layer: int, query: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        lv = self.live[rid][:, : int(qpos.max()) + 1]
        rows = [lv[layer * H + h] if self.R > 1 else lv[0] for h in range(H)]
        kpos = np.stack([np.nonzero(r)[0] for r in rows])  # [H, n] (equal counts)
        keys, vals = [], []
        for h in range(H):
            k, v = kv_values(self.uid[rid], layer, H, kpos[h], D)
            keys.append(k[:, h])
            vals.append(v[:, h])
        return dense_attention(query, torch.stack(keys), torch.stack(vals), qpos, torch.as_tensor(kpos))

    def check(self, queries: dict[str, np.ndarray], index_rule: bool) -> float:
        """Batched paged attention for ``queries`` (rid -> positions) vs dense, every layer."""
        ids = sorted(queries)
        md = self.c.attention_metadata(ids)
        Q = max(len(p) for p in queries.values())
        qpos = torch.full((len(ids), Q), -1, dtype=torch.int64)
        for b, r in enumerate(ids):
            qpos[b, : len(queries[r])] = torch.as_tensor(queries[r])
        worst = 0.0
        for layer in range(L):
            query = torch.randn(len(ids), Q, H * G, D, generator=self.gen)
            out, _ = self.c.attention(layer, query, md, qpos)
            outs = [out]
            if index_rule:  # unmodified-kernel semantics: no positions, no mask
                outs.append(paged_attention(query, self.c.key_cache(layer), self.c.value_cache(layer),
                                            md.block_tables, md.cache_lens, qpos)[0])
            for b, r in enumerate(ids):
                nq = len(queries[r])
                ref = self.dense(r, layer, query[b, :nq], qpos[b, :nq])
                for o in outs:
                    worst = max(worst, float((o[b, :nq] - ref).abs().nan_to_num(nan=float("inf")).max()))  # NaN: a failure
        return worst


@pytest.mark.parametrize("layout", ["generic", "vllm_cpu"])
@pytest.mark.parametrize("mode", ["compact", "ordered", "naive"])
@pytest.mark.parametrize("granularity", ["request", "head"])
def test_paged_equals_dense_chunked_prefill_and_decode(granularity: str, mode: str, layout: str) -> None:
    d = Driver(granularity, mode, layout, seed=zlib.crc32(f"{granularity}{mode}{layout}".encode()))
    index_rule = mode != "naive"
    lens = {"a": 37, "b": 22, "c": 9}
    for r in lens:
        d.add(r)
    # chunked prefill with evictions between chunks (SnapKV-style prefill compression)
    for r, n in lens.items():
        done = 0
        while done < n:
            chunk = min(n - done, int(d.rng.integers(3, 11)))
            pos = d.append(r, chunk)
            assert d.check({r: pos}, index_rule) <= TOL
            done += chunk
            if done < n:
                d.evict(r, 0.3)
                d.c.reclaim()
    for step in range(12):  # decode: all requests in one batch, evict every third step
        q = {r: d.append(r, 1) for r in lens}
        assert d.check(q, index_rule) <= TOL
        if step % 3 == 2:
            for r in lens:
                d.evict(r, 0.4)
            st_ = d.c.reclaim()
            if mode == "compact":
                assert st_.tokens_moved <= st_.tokens_evicted
    for r in lens:
        live = int(d.live[r][0].sum())
        if mode == "naive":
            assert d.c.held_blocks(r) == d.c.naive_held_blocks(r)
        else:
            assert d.c.held_blocks(r) == -(-live // BS) <= d.c.naive_held_blocks(r)


@settings(max_examples=25, deadline=None)
@given(granularity=st.sampled_from(["request", "head"]), mode=st.sampled_from(["compact", "ordered"]),
       seed=st.integers(0, 2**31 - 1), frac=st.floats(0.1, 0.9))
def test_paged_equals_dense_random(granularity: str, mode: str, seed: int, frac: float) -> None:
    d = Driver(granularity, mode, "generic", seed)
    d.add("x")
    d.append("x", int(d.rng.integers(5, 40)))
    d.evict("x", frac)
    d.c.reclaim()
    q = d.append("x", int(d.rng.integers(1, 6)))  # a chunk after compaction
    assert d.check({"x": q}, index_rule=True) <= TOL


def test_holes_are_reclaimed_before_attention() -> None:
    """compact: attention_metadata reclaims a request with holes, so unmodified kernels stay exact."""
    d = Driver("head", "compact", "generic", seed=3)
    d.add("a")
    d.append("a", 21)
    d.evict("a", 0.5)
    assert d.c.cache_len("a") == 21  # holes still inside the visible range
    q = d.append("a", 1)
    assert d.check({"a": q}, index_rule=True) <= TOL  # the metadata call reclaimed first
    assert d.c.cache_len("a") == d.c.live_tokens("a")


def test_stats_accumulate_from_probabilities() -> None:
    """probs from the reference kernel scattered into the slot store == dense probabilities per token."""
    d = Driver("head", "compact", "vllm_cpu", seed=5)
    d.add("a")
    d.append("a", 30)
    d.evict("a", 0.5)
    d.c.reclaim()
    qp = d.append("a", 4)
    md = d.c.attention_metadata(["a"])
    layer = 1
    query = torch.randn(1, 4, H * G, D, generator=d.gen)
    qpos = torch.as_tensor(qp)[None]
    _, probs = d.c.attention(layer, query, md, qpos, return_probs=True)
    d.c.accumulate_stats("acc", layer, md, probs.sum(dim=2))  # [B, H_kv, max_len]
    got = d.c.gather_stats("a", ["acc"])["acc"][layer]  # [H, n] in live_view order
    pos, _ = d.c.live_view("a")
    for h in range(H):
        kp = pos[layer * H + h]
        k, _ = kv_values(d.uid["a"], layer, H, kp, D)
        s = torch.einsum("qgd,nd->gqn", query[0].view(4, H, G, D)[:, h], k[:, h]) / np.sqrt(D)
        mask = torch.as_tensor(kp)[None, None, :] <= qpos[0][None, :, None]
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        assert torch.allclose(got[h], p.sum(dim=(0, 1)), atol=1e-5)
