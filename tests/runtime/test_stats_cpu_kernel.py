"""The numba CPU statistics kernel (``vtoken_runtime.stats.cpu_kernel.update_attn_stats_cpu``) equals the
runtime's torch statistics backend (``StatsCollector(backend="torch")``, no code shared with the
kernel) on a real VTokenCache over several steps (chunked prefill, decode with
padding rows, eviction + reclaim or naive holes), per statistic, at request and head granularity, MHA and
GQA, fp32 and bf16 caches, both KV layouts; and the kernel oracle ``kernels.attn_stats_ref`` on random shapes
(hypothesis).

Tolerance (docs/kernels.md, as for the Triton kernel): atol 2e-6 + rtol 1e-5; ``low_attn_count`` may
differ only by the weight of (query, key) pairs whose attention lies within 1e-5 (relative) of the
low-attention threshold (the random tests compute that allowance from the reference's probabilities).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vtoken_runtime.cache import VTokenCache
from vtoken_runtime.kernels.attn_stats_ref import apply_step_stats, step_stats
from vtoken_runtime.stats import StatsCollector
from vtoken_runtime.stats import cpu_kernel as ck
from vtoken_runtime.stats.collector import gather_query_rows
from vtoken_runtime.stats.cpu_kernel import STAT_NAMES, update_attn_stats_cpu
from vtoken_runtime.stats.cpu_numerics import DOT_ROWS
from vtoken_sdk import StatsConfig

pytest.importorskip("numba")
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning")]

ATOL, RTOL, THR_RTOL = 2e-6, 1e-5, 1e-5
SUBSETS = (STAT_NAMES, ("attn_sum",), ("attn_last",), ("attn_window",), ("low_attn_count",),
           ("attn_last", "attn_window"))
OBS, HIST = 3, 4
LAYER = 1  # the kernel runs on the second of two layers (per-head position rows start at H_kv)


def _collector_run(granularity: str, dtype: torch.dtype, G: int, layout: str, mode: str,
                   block_n: int | None = None, H: int = 2, D: int = 16, bs: int = 4) -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    L = 2
    cache = VTokenCache(L, H, D, bs, num_blocks=40, granularity=granularity, mode=mode, kv_layout=layout,
                        dtype=dtype, stat_names=STAT_NAMES, async_copy=False)
    # the torch backend: probabilities over the paged cache (paged_attention) folded by the update rules, no code
    # shared with the kernel (auto would pick the numba kernel itself and compare it with itself)
    col = StatsCollector(cache, STAT_NAMES, StatsConfig(obs_window=OBS, history_window=HIST), G, backend="torch")
    assert col.backend == "torch"
    mirrors = [{n: cache.stats_tensor(n)[LAYER].clone() for n in sub} for sub in SUBSETS]
    reqs = ["a", "b", "c"]
    prompt = torch.tensor([9, 6, 4])  # a's window (positions 6..8) spans its two prefill chunks
    # new tokens per step and request (0: the request is in the batch with padding rows only)
    schedule = [(5, 6, 4), (4, 1, 0), (1, 1, 1), (3, 1, 1), (1, 1, 1), (1, 2, 1)]
    for r in reqs:
        cache.add_request(r)
    for step, counts in enumerate(schedule):
        Q = max(counts) + 1  # at least one padding row everywhere
        query_pos = torch.full((len(reqs), Q), -1, dtype=torch.int64)
        for i, (r, n) in enumerate(zip(reqs, counts, strict=True)):
            if n == 0:
                continue
            start = cache.logical_len(r)
            slots = cache.reserve(r, n)
            assert slots is not None
            for mirror in mirrors:  # the runtime zeroes the stats of new tokens' slots
                for t in mirror.values():
                    t[:, torch.as_tensor(slots)] = 0.0
            for li in range(L):
                cache.write_kv(li, r, torch.randn(n, H, D), torch.randn(n, H, D))
            query_pos[i, :n] = torch.arange(start, start + n)
        query = torch.randn(len(reqs), Q, H * G, D).to(dtype)
        md = cache.attention_metadata(reqs)
        col.attention(LAYER, query, md, query_pos, prompt)
        for mirror in mirrors:
            update_attn_stats_cpu(query, cache.key_cache(LAYER), md.block_tables, md.cache_lens, query_pos,
                                  cache.key_positions(LAYER), mirror, obs_window=OBS, history_window=HIST,
                                  prompt_lens=prompt, block_n=block_n)
            for n, t in mirror.items():
                torch.testing.assert_close(t, cache.stats_tensor(n)[LAYER], atol=ATOL, rtol=RTOL,
                                           msg=lambda m, n=n, s=step, k=tuple(mirror): f"step {s} {n} ({k}): {m}")
        if step == 2:  # evict 3 tokens per row (different ones per row at head granularity), then reclaim
            for r in reqs:
                live = cache.live_tokens(r)
                keep = torch.ones(cache.num_rows, live, dtype=torch.bool)
                for row in range(cache.num_rows):
                    keep[row, rng.choice(np.arange(1, live - 1), size=3, replace=False)] = False
                cache.apply_keep_mask(r, keep)
            if mode != "naive":
                cache.reclaim(reqs)
            cache.fence()
            for mirror in mirrors:  # stats move with their tokens
                for n, t in mirror.items():
                    t.copy_(cache.stats_tensor(n)[LAYER])
    if mode == "naive":  # dead slots stayed inside the cache lengths
        md = cache.attention_metadata(reqs)
        assert int(md.cache_lens.sum()) > sum(cache.live_tokens(r) for r in reqs)


@pytest.mark.parametrize("granularity", ["head", "request"])
@pytest.mark.parametrize(("dtype", "G", "layout", "mode"), [
    (torch.float32, 3, "vllm_cpu", "compact"),
    (torch.float32, 1, "generic", "naive"),
    (torch.bfloat16, 3, "generic", "ordered"),
    (torch.bfloat16, 2, "vllm_cpu", "naive"),
])
def test_kernel_matches_stats_collector_over_steps(granularity: str, dtype: torch.dtype, G: int, layout: str,
                                                   mode: str) -> None:
    _collector_run(granularity, dtype, G, layout, mode)


def test_collector_prepares_each_layer_once_and_each_step_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The collector's numba path views a layer's stores once (reused over steps, evictions and reclaims: the
    test above checks the values against fresh calls) and the step's metadata once for all layers; a new
    store tensor (here a statistic store replaced) is seen and prepared again."""
    calls = {"layer": 0, "step": 0}
    real_layer, real_step = ck.prepare_layer, ck.prepare_step

    def count(name, fn):  # type: ignore[no-untyped-def]
        def wrapped(*a, **kw):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(ck, "prepare_layer", count("layer", real_layer))
    monkeypatch.setattr(ck, "prepare_step", count("step", real_step))
    cache = VTokenCache(2, 2, 16, 4, num_blocks=20, granularity="head", kv_layout="vllm_cpu",
                        stat_names=("attn_sum",), async_copy=False)
    col = StatsCollector(cache, ("attn_sum",), StatsConfig(), 2)
    assert col.backend == "numba"
    cache.add_request("a")
    for step, n in enumerate((6, 1, 1)):
        start = cache.logical_len("a")
        cache.reserve("a", n)
        for li in range(2):
            cache.write_kv(li, "a", torch.randn(n, 2, 16), torch.randn(n, 2, 16))
        md = cache.attention_metadata(["a"])
        qpos, plen = torch.arange(start, start + n)[None], torch.tensor([6])  # one object each per step, as in vLLM
        for li in range(2):
            col.attention(li, torch.randn(1, n, 4, 16), md, qpos, plen)
        assert calls == {"layer": 2, "step": step + 1}
    col.attention(0, torch.randn(1, 1, 4, 16), cache.attention_metadata(["a"]), qpos, plen)  # a new step's metadata
    assert calls == {"layer": 2, "step": 4}
    before = cache.stats_tensor("attn_sum").clone()
    cache.store.stats["attn_sum"] = before.clone()  # a different tensor behind the same name
    md = cache.attention_metadata(["a"])
    col.attention(1, torch.randn(1, 1, 4, 16), md, torch.tensor([[cache.logical_len("a") - 1]]), torch.tensor([6]))
    assert calls == {"layer": 3, "step": 5}
    assert not torch.equal(cache.stats_tensor("attn_sum")[1], before[1])  # written into the new tensor


def test_collector_falls_back_to_torch_when_the_kernel_cannot_load(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A numba kernel failing before it writes anything (numba's on-disk cache written for the same file under
    another module name, as seen on this machine) does not fail the forward pass: the collector warns once and
    the torch backend collects from then on, the same statistics as a torch collector (within the tolerance);
    a ValueError (misuse) still propagates."""
    def broken(*a: object, **kw: object) -> None:
        raise ModuleNotFoundError("No module named 'runtime'")

    caches = [VTokenCache(2, 2, 16, 4, num_blocks=20, granularity="head", kv_layout="vllm_cpu",
                          stat_names=STAT_NAMES, async_copy=False) for _ in range(2)]
    cols = [StatsCollector(c, STAT_NAMES, StatsConfig(obs_window=2), 3, backend=b)
            for c, b in zip(caches, ("numba", "torch"), strict=True)]
    monkeypatch.setattr(ck, "run_prepared", broken)
    g = torch.Generator().manual_seed(0)
    for c in caches:
        c.add_request("a")
    with caplog.at_level("WARNING", logger="vtoken.stats"):
        for n in (6, 1, 1):
            k, v, q = torch.randn(2, n, 2, 16, generator=g), torch.randn(2, n, 2, 16, generator=g), \
                torch.randn(n, 6, 16, generator=g)
            qpos, plen = torch.arange(caches[0].logical_len("a"), caches[0].logical_len("a") + n)[None], torch.tensor([6])
            for c, col in zip(caches, cols, strict=True):
                c.reserve("a", n)
                for li in range(2):
                    c.write_kv(li, "a", k[li], v[li])
                md = c.attention_metadata(["a"])
                for li in range(2):
                    col.attention(li, q[None], md, qpos, plen)
    assert cols[0].backend == "torch" and sum("torch backend" in r.getMessage() for r in caplog.records) == 1
    for name in STAT_NAMES:
        torch.testing.assert_close(caches[0].stats_tensor(name), caches[1].stats_tensor(name), atol=ATOL, rtol=RTOL)
    assert float(caches[0].stats_tensor("attn_sum").sum()) > 0
    monkeypatch.undo()  # the kernel works again
    col = StatsCollector(caches[0], STAT_NAMES, StatsConfig(), 3, backend="numba")
    with pytest.raises(ValueError, match="does not match"):  # a query that does not fit the cache: misuse
        col.attention(0, torch.randn(1, 1, 5, 16), caches[0].attention_metadata(["a"]), torch.tensor([[8]]),
                      torch.tensor([6]))
    assert col.backend == "numba"


@pytest.mark.parametrize("block_n", [1, 5, 8, 13])
def test_key_tile_widths(block_n: int) -> None:
    """Tiles narrower than, not a multiple of, or equal to the 8-key transpose block."""
    _collector_run("head", torch.float32, 3, "vllm_cpu", "compact", block_n=block_n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smollm2_shape(dtype: torch.dtype) -> None:
    """SmolLM2-135M's attention shape (9 query / 3 KV heads, head size 64) with vLLM-CPU blocks of 32."""
    _collector_run("head", dtype, 3, "vllm_cpu", "compact", H=3, D=64, bs=32)


def _case(seed: int, B: int, Q: int, G: int, Hkv: int, D: int, bs: int, per_head: bool, dtype: torch.dtype,
          prefill: bool, full: bool = False):
    """Random paged batch in the vllm_cpu layout (a strided key view): random block tables, lengths,
    true positions (15% dead, duplicates and any order), padding rows, some requests without queries
    (``full``: every request at the longest length, no padding)."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    max_blocks = 4
    NB = B * max_blocks + 3
    query = (torch.randn(B, Q, G * Hkv, D, generator=g) * 2).to(dtype)
    cache = (torch.randn(NB, Hkv, bs, 2 * D, generator=g) * 2).to(dtype)
    key_cache = cache[..., :D].permute(0, 2, 1, 3)  # [NB, bs, Hkv, D] view
    bt = torch.as_tensor(rng.permutation(NB)[: B * max_blocks].reshape(B, max_blocks), dtype=torch.int32)
    lo = max_blocks * bs if full else 0
    lens = torch.as_tensor(rng.integers(lo, max_blocks * bs + 1, size=B), dtype=torch.int32)
    S = NB * bs
    R = Hkv if per_head else 1
    kpos = torch.full((R, S), -1, dtype=torch.int64)
    qpos = torch.full((B, Q), -1, dtype=torch.int64)
    for b in range(B):
        n = int(lens[b])
        for j in range(n):
            s = int(bt[b, j // bs]) * bs + j % bs
            for r in range(R):
                kpos[r, s] = -1 if rng.random() < 0.15 else int(rng.integers(0, n + Q))
        nq = int(rng.integers(0, Q + 1)) if B > 1 and not full else Q
        start = n if prefill else max(n - 1, 0)
        qpos[b, :nq] = torch.arange(start, start + nq)
    return query, key_cache, bt, lens, qpos, kpos, S


def _check_against_reference(seed: int, B: int, Q: int, G: int, Hkv: int, D: int, bs: int, per_head: bool,
                             dtype: torch.dtype, prefill: bool, obs: int, hist: int, thr: float,
                             block_n: int | None, names: tuple[str, ...], with_plen: bool,
                             scale: float | None, full: bool = False) -> dict[str, torch.Tensor]:
    query, key_cache, bt, lens, qpos, kpos, S = _case(seed, B, Q, G, Hkv, D, bs, per_head, dtype, prefill, full)
    plen = None
    if with_plen:
        plen = torch.as_tensor(np.random.default_rng(seed + 2).integers(0, bs * 4 + Q + 2, size=B))
    g = torch.Generator().manual_seed(seed + 1)
    init = {n: torch.rand(Hkv, S, generator=g) for n in STAT_NAMES}
    got = {n: init[n].clone() for n in names}
    want = {n: v.clone() for n, v in init.items()}
    update_attn_stats_cpu(query, key_cache, bt, lens, qpos, kpos, got, scale=scale, obs_window=obs,
                          history_window=hist, low_attn_threshold=thr, prompt_lens=plen, block_n=block_n)
    c = step_stats(query, key_cache, key_cache, bt, lens, qpos, kpos, scale=scale, obs_window=obs,
                   history_window=hist, low_attn_threshold=thr, prompt_lens=plen)
    apply_step_stats(want, c, bt, lens, qpos, bs)
    for n in names:
        if n == "low_attn_count":
            continue
        torch.testing.assert_close(got[n], want[n], atol=ATOL, rtol=RTOL, msg=lambda m, n=n: f"{n}: {m}")
    if "low_attn_count" in names:  # exact unless an attention value sits on the threshold
        near = ((c["visible"] & ((c["P"] - c["threshold"]).abs() <= THR_RTOL * c["threshold"])).float()
                * c["weight"][:, None, :, None]).sum(2)
        slack = torch.zeros(Hkv, S)
        apply_step_stats({"low_attn_count": slack}, {"low_attn_count": near, "low_attn_scale": c["low_attn_scale"]},
                         bt, lens, qpos, bs)
        diff = (got["low_attn_count"] - want["low_attn_count"]).abs()
        assert bool((diff <= slack + ATOL + RTOL * want["low_attn_count"].abs()).all()), \
            f"low_attn_count off by {diff.max()}"
    return c


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), B=st.integers(1, 3), Q=st.integers(1, 7), G=st.sampled_from([1, 2, 3, 4]),
       Hkv=st.integers(1, 3), D=st.sampled_from([4, 6, 8, 16, 20]), bs=st.sampled_from([1, 2, 4, 8]),
       per_head=st.booleans(), prefill=st.booleans(), bf16=st.booleans(), obs=st.integers(1, 4),
       hist=st.integers(1, 8), thr=st.sampled_from([0.5, 1.0, 2.0]), block_n=st.sampled_from([None, 3, 8, 16]),
       names=st.sampled_from(SUBSETS), with_plen=st.booleans(), scale=st.sampled_from([None, 0.3]))
def test_hypothesis_shapes(seed, B, Q, G, Hkv, D, bs, per_head, prefill, bf16, obs, hist, thr, block_n,  # type: ignore[no-untyped-def]
                           names, with_plen, scale) -> None:
    _check_against_reference(seed, B, Q, G, Hkv, D, bs, per_head, torch.bfloat16 if bf16 else torch.float32,
                             prefill, obs, hist, thr, block_n, names, with_plen, scale)


def test_dense_case_exercises_every_rule() -> None:
    """A fully valid prefill case (no padding) where every statistic and the threshold matter."""
    c = _check_against_reference(3, 2, 6, 3, 2, 16, 4, True, torch.float32, True, 2, 3, 1.0, None, STAT_NAMES,
                                 False, None, full=True)
    assert c["visible"].sum() > 200 and (c["low_attn_count"] > 0).any() and (c["attn_window"] > 0).any()


def test_scratch_chunks_are_bit_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scratch too small for a request's key tiles (pass 2 re-gathers earlier chunks) gives the same bits."""
    query, key_cache, bt, lens, qpos, kpos, S = _case(7, 3, 5, 3, 2, 16, 4, True, torch.float32, True)
    lens[:] = 16
    base = {n: torch.rand(2, S, generator=torch.Generator().manual_seed(1)) for n in STAT_NAMES}
    full = {n: v.clone() for n, v in base.items()}
    update_attn_stats_cpu(query, key_cache, bt, lens, qpos, kpos, full, block_n=3)
    for tiles in (1, 2):
        monkeypatch.setattr(ck, "SCRATCH_BYTES", tiles * (16 * 3 * 4 + 3 * 16))
        part = {n: v.clone() for n, v in base.items()}
        update_attn_stats_cpu(query, key_cache, bt, lens, qpos, kpos, part, block_n=3)
        for n in STAT_NAMES:
            assert torch.equal(part[n], full[n]), n


@pytest.mark.parametrize("block_n", [None, 5, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dim_major_keys_give_the_same_bits(dtype: torch.dtype, block_n: int | None) -> None:
    """vLLM's CPU layout stores K dim-major inside a (block, head) region (stride along the slot 1, along D
    the block size): the per-block run copies read it and produce exactly the bits of the unit-stride
    (vectorised) gather, for tiles holding whole blocks and tiles cutting blocks (block_n 5, 24 vs bs 16)."""
    query, key_cache, bt, lens, qpos, kpos, S = _case(5, 3, 6, 2, 2, 32, 16, True, dtype, True)
    NB, bs, H, D = key_cache.shape
    dim_major = key_cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # storage [NB, H, D, bs]
    assert dim_major.stride(-1) == bs and dim_major.stride(1) == 1 and torch.equal(dim_major, key_cache)
    base = {n: torch.rand(H, S, generator=torch.Generator().manual_seed(2)) for n in STAT_NAMES}
    want = {n: v.clone() for n, v in base.items()}
    got = {n: v.clone() for n, v in base.items()}
    update_attn_stats_cpu(query, key_cache, bt, lens, qpos, kpos, want, block_n=block_n)
    update_attn_stats_cpu(query, dim_major, bt, lens, qpos, kpos, got, block_n=block_n)
    for n in STAT_NAMES:
        assert torch.equal(got[n], want[n]), n


@pytest.mark.parametrize("bs", [8, 12, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dim_major_in_place_scores_give_the_same_bits(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                      bs: int) -> None:
    """vLLM's CPU region layout (K dim-major, then V, per (block, head)) with a block size that is a multiple of 8
    and cached scores: pass 1 reads the keys in place (whole 16-key groups 64 / 32 / 16 per call, across blocks; the
    rest 32 / 16 / 8 keys per call; a request's partial last block 8 at a time, reading past its length inside the
    block; tiles cutting blocks key by key) and gives exactly the
    bits of the gathered tiles: of the unit-stride layout and of the same memory without the score cache (tile
    copies; bs 12: always). Decode and short steps, SmolLM2's heads (3 KV heads, GQA 3, D 64), four requests;
    groups of 1, 2 and 5 query heads (a dot-product call takes up to ``DOT_ROWS`` = 4 rows: 5 = 4 + 1)."""
    assert DOT_ROWS == 4
    for Q, block_n, G in ((1, None, 3), (3, None, 3), (1, 24, 3), (2, 5, 3), (2, None, 5), (1, None, 1),
                          (3, 24, 2)):
        query, key_cache, bt, lens, qpos, kpos, S = _case(13 + Q, 4, Q, G, 3, 64, bs, True, dtype, False)
        lens[0] = 4 * bs - 3  # a partial last block, ending past a vector's 8 keys
        lens[1] = 4 * bs  # whole blocks
        for r in range(2):  # plain decode requests: positions 0 .. len-1, the last one's query
            for j in range(int(lens[r])):
                kpos[:, int(bt[r, j // bs]) * bs + j % bs] = j
            qpos[r] = -1
            qpos[r, 0] = int(lens[r]) - 1
        NB, _, H, D = key_cache.shape
        region = torch.randn(NB, H, 2, D, bs).to(dtype)  # V's (random) elements follow K's in each region
        region[:, :, 0] = key_cache.permute(0, 2, 3, 1)
        dim_major = region[:, :, 0].permute(0, 3, 1, 2)  # [NB, bs, H, D] view, strides (H*2*D*bs, 1, 2*D*bs, bs)
        assert dim_major.stride()[1::2] == (1, bs) and torch.equal(dim_major, key_cache)
        base = {n: torch.rand(H, S, generator=torch.Generator().manual_seed(4)) for n in STAT_NAMES}
        want = {n: v.clone() for n, v in base.items()}
        got = {n: v.clone() for n, v in base.items()}
        update_attn_stats_cpu(query, key_cache, bt, lens, qpos, kpos, want, block_n=block_n)
        update_attn_stats_cpu(query, dim_major, bt, lens, qpos, kpos, got, block_n=block_n)
        with monkeypatch.context() as mp:
            mp.setattr(ck, "SCORE_BYTES", 0)
            tiles = {n: v.clone() for n, v in base.items()}
            update_attn_stats_cpu(query, dim_major, bt, lens, qpos, kpos, tiles, block_n=block_n)
        with monkeypatch.context() as mp:  # one query per score block: keys read in place again per block
            bn = block_n or 128
            mp.setattr(ck, "SCORE_BYTES", G * -(-int(lens.max()) // bn) * bn * 4)
            blocks = {n: v.clone() for n, v in base.items()}
            update_attn_stats_cpu(query, dim_major, bt, lens, qpos, kpos, blocks, block_n=block_n)
        for n in STAT_NAMES:
            assert torch.equal(got[n], want[n]), (n, Q, block_n, G)
            assert torch.equal(tiles[n], want[n]), (n, Q, block_n, G)
            assert torch.equal(blocks[n], want[n]), (n, Q, block_n, G)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_rows_by_token_index_give_the_same_bits(dtype: torch.dtype) -> None:
    """The flat query rows of a step (``[T, H_q, D]``, a strided view like vLLM's query slice of the fused QKV
    output, rows in another order, rows no request reads) indexed by ``token_index [B, Q]`` (-1 = padding) give
    exactly the bits of the gathered ``[B, Q, H_q, D]`` query, whose padding rows hold garbage here: only valid
    queries are read. Through the kernel's ``prepare_step(token_index=...)`` and through ``StatsCollector``
    (the numba backend reads the rows in place, the torch backend gathers them and zeroes the padding)."""
    B, Q, G, Hkv, D = 4, 5, 3, 3, 64
    query, key_cache, bt, lens, qpos, kpos, S = _case(21, B, Q, G, Hkv, D, 32, True, dtype, True)
    assert bool((qpos < 0).any()) and bool((qpos >= 0).any())
    valid = (qpos >= 0).nonzero().tolist()
    T = len(valid) + 3
    order = np.random.default_rng(5).permutation(T)[: len(valid)]  # row of each valid (b, q)
    fused = torch.randn(T, (G + 2) * Hkv * D).to(dtype)  # [q | k | v] per token, as vLLM's QKV projection
    rows = fused[:, : G * Hkv * D].view(T, G * Hkv, D)
    assert not rows.is_contiguous()
    tok = torch.full((B, Q), -1, dtype=torch.int64)
    for (b, q), t in zip(valid, order, strict=True):
        tok[b, q] = int(t)
        query[b, q] = rows[int(t)]
    query[qpos < 0] = float("nan")  # the padding's rows are never read
    base = {n: torch.rand(Hkv, S, generator=torch.Generator().manual_seed(4)) for n in STAT_NAMES}
    want = {n: v.clone() for n, v in base.items()}
    got = {n: v.clone() for n, v in base.items()}
    update_attn_stats_cpu(query, key_cache, bt, lens, qpos, kpos, want)
    ck.run_prepared(ck.prepare_layer(key_cache, kpos, got), ck.prepare_step(bt, lens, qpos, None, tok), rows)
    for n in STAT_NAMES:
        assert torch.equal(got[n], want[n]), n
    with pytest.raises(ValueError, match="rows"):
        ck.run_prepared(ck.prepare_layer(key_cache, kpos, got), ck.prepare_step(bt, lens, qpos, None, tok), query)
    with pytest.raises(ValueError, match="token_index"):
        ck.prepare_step(bt, lens, qpos, None, tok[:, :2])

    cache = VTokenCache(1, Hkv, D, 4, num_blocks=12, granularity="head", dtype=dtype, stat_names=STAT_NAMES,
                        async_copy=False)
    reqs = ["a", "b"]
    for r in reqs:
        cache.add_request(r)
        cache.reserve(r, 7)
        cache.write_kv(0, r, torch.randn(7, Hkv, D).to(dtype), torch.randn(7, Hkv, D).to(dtype))
    md = cache.attention_metadata(reqs)
    qp = torch.tensor([[4, 5, 6], [6, -1, -1]])
    ti = torch.tensor([[2, 0, 3], [1, -1, -1]])
    flat = torch.randn(4, G * Hkv, D).to(dtype)
    plen = torch.tensor([7, 7])
    for backend in ("numba", "torch"):
        runs = []
        for rows_in, index in ((flat, ti), (gather_query_rows(flat, ti), None)):
            for n in STAT_NAMES:
                cache.stats_tensor(n)[0].zero_()
            col = StatsCollector(cache, STAT_NAMES, StatsConfig(), G, backend=backend)
            col.attention(0, rows_in, md, qp, plen, token_index=index)
            runs.append({n: cache.stats_tensor(n)[0].clone() for n in STAT_NAMES})
        for n in STAT_NAMES:
            assert torch.equal(runs[0][n], runs[1][n]), (backend, n)


def _paired(key_cache: torch.Tensor, segment: int | None) -> ck.PairedKeys:
    """``key_cache [NB, bs, H, D]`` bf16 as :class:`PairedKeys` in a fresh buffer: with a ``segment`` T, vLLM's
    CPU ``amx`` regions (per (block, head): K words ``(t // T) * T * D / 2 + p * T + t % T`` holding dims
    2p | 2p + 1, then random V words); None: token-major words ``[NB, bs, H, D / 2]`` (no unit stride along the
    slot: the scalar gather)."""
    NB, bs, H, D = key_cache.shape
    bits = key_cache.view(torch.int16).to(torch.int32) & 0xFFFF
    words = bits[..., 0::2] | (bits[..., 1::2] << 16)  # [NB, bs, H, D/2]
    P = D // 2
    if segment is None:
        flat = words.contiguous()
        return ck.PairedKeys(flat, (NB, bs, H, D), (bs * H * P, H * P, P, 1), bs)
    T = segment
    region = torch.randint(-2**31, 2**31 - 1, (NB, H, 2, bs // T, P, T), dtype=torch.int32)  # K words, then V's
    region[:, :, 0] = words.reshape(NB, bs // T, T, H, P).permute(0, 3, 1, 4, 2)
    R = bs * D
    return ck.PairedKeys(region, (NB, bs, H, D), (H * R, 1, R, T), T, T * P)


@pytest.mark.parametrize(("bs", "segment"), [(8, 8), (12, 12), (32, 32), (32, 16), (48, 16), (16, 8)])
def test_paired_keys_give_the_same_bits(monkeypatch: pytest.MonkeyPatch, bs: int, segment: int) -> None:
    """bf16 keys stored as pairs of dims per 32-bit word in segments of a block (vLLM's CPU ``amx`` layout:
    ``PairedKeys``, segments of 16 slots) give exactly the bits of the same keys in a plain layout: read in place
    (pass 1's paired vector loads: 64 / 32 / 16 keys from up to four 16-slot segments per call, then 16 / 8 keys
    inside one segment, a partial last block, tiles cutting segments), through tile
    copies (no score cache; segment 12: always) and through the scalar gather (token-major words). SmolLM2's
    heads (3 KV heads, GQA 3, D 64), decode and short steps."""
    for Q, block_n, G in ((1, None, 3), (3, None, 3), (2, 5, 3), (2, None, 5), (1, 24, 1)):
        query, key_cache, bt, lens, qpos, kpos, S = _case(13 + Q, 4, Q, G, 3, 64, bs, True, torch.bfloat16, False)
        lens[0] = 4 * bs - 3  # a partial last block, ending past a vector's 8 keys
        pk = _paired(key_cache, segment)
        assert pk.shape == tuple(key_cache.shape)
        assert torch.equal(pk.unpack(), key_cache) and torch.equal(_paired(key_cache, None).unpack(), key_cache)
        base = {n: torch.rand(3, S, generator=torch.Generator().manual_seed(4)) for n in STAT_NAMES}
        runs = {k: {n: v.clone() for n, v in base.items()} for k in ("want", "in_place", "tiles", "scalar")}
        update_attn_stats_cpu(query, key_cache, bt, lens, qpos, kpos, runs["want"], block_n=block_n)
        update_attn_stats_cpu(query, pk, bt, lens, qpos, kpos, runs["in_place"], block_n=block_n)
        update_attn_stats_cpu(query, _paired(key_cache, None), bt, lens, qpos, kpos, runs["scalar"], block_n=block_n)
        with monkeypatch.context() as mp:
            mp.setattr(ck, "SCORE_BYTES", 0)
            update_attn_stats_cpu(query, pk, bt, lens, qpos, kpos, runs["tiles"], block_n=block_n)
        for k in ("in_place", "tiles", "scalar"):
            for n in STAT_NAMES:
                assert torch.equal(runs[k][n], runs["want"][n]), (k, n, Q, block_n, G)


def test_collector_reads_paired_keys() -> None:
    """``StatsCollector(keys=...)`` (the vLLM amx path) gives the statistics of the plain cache's keys;
    keys are refused with another backend or the wrong number of layers."""
    cache = VTokenCache(2, 2, 16, 8, num_blocks=12, kv_layout="vllm_cpu", dtype=torch.bfloat16,
                        stat_names=STAT_NAMES, async_copy=False)
    cache.add_request("a")
    cache.reserve("a", 30)
    for li in range(2):
        cache.write_kv(li, "a", torch.randn(30, 2, 16), torch.randn(30, 2, 16))
    keys = [_paired(cache.key_cache(li).clone(), 8) for li in range(2)]
    plain = StatsCollector(cache, STAT_NAMES, StatsConfig(), 2, backend="numba")
    paired = StatsCollector(cache, STAT_NAMES, StatsConfig(), 2, backend="numba", keys=keys)
    query = torch.randn(1, 30, 4, 16).to(torch.bfloat16)
    qpos, plen = torch.arange(30)[None], torch.tensor([30])
    got = []
    for col in (plain, paired):
        for n in STAT_NAMES:
            cache.stats_tensor(n).zero_()
        col.attention(1, query, cache.attention_metadata(["a"]), qpos, plen)
        got.append({n: cache.stats_tensor(n)[1].clone() for n in STAT_NAMES})
    assert got[0]["attn_sum"].sum() > 0
    for n in STAT_NAMES:
        assert torch.equal(got[1][n], got[0][n]), n
    with pytest.raises(ValueError, match="numba backend only"):
        StatsCollector(cache, STAT_NAMES, StatsConfig(), 2, backend="torch", keys=keys)
    with pytest.raises(ValueError, match="numba backend only"):
        StatsCollector(cache, STAT_NAMES, StatsConfig(), 2, backend="numba", keys=keys[:1])
    with pytest.raises(ValueError, match="must be int32"):
        ck.PairedKeys(torch.zeros(64), (2, 8, 2, 8), (64, 1, 32, 8), 8)
    with pytest.raises(ValueError, match="divide the block size"):
        ck.PairedKeys(torch.zeros(64, dtype=torch.int32), (1, 8, 1, 8), (32, 1, 32, 8), 3)
    with pytest.raises(ValueError, match="past the end"):
        ck.PairedKeys(torch.zeros(64, dtype=torch.int32), (2, 8, 2, 8), (64, 1, 32, 8), 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_score_cache_is_bit_identical(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """The passes reading cached scores give the bits of recomputing them (no cache, a cache too small for
    some requests, a scratch of one tile: more than one chunk), and a request's queries cut into score blocks
    (one, two or three queries per block) give the bits of one block."""
    query, key_cache, bt, lens, qpos, kpos, S = _case(9, 3, 5, 3, 2, 16, 4, True, dtype, True)
    base = {n: torch.rand(2, S, generator=torch.Generator().manual_seed(3)) for n in STAT_NAMES}
    full = {n: v.clone() for n, v in base.items()}
    update_attn_stats_cpu(query, key_cache, bt, lens, qpos, kpos, full, block_n=3)
    one_query = 3 * -(-int(lens.max()) // 3) * 3 * 4  # G x tiles x block_n fp32 scores of the longest request
    assert int((qpos >= 0).sum(1).max()) > 3  # blocks of 1, 2 and 3 cut some request's queries
    for score_bytes, scratch in ((0, ck.SCRATCH_BYTES), (5 * 3 * 3 * 3 * 4, ck.SCRATCH_BYTES),
                                 (ck.SCORE_BYTES, 16 * 3 * 4 + 3 * 16), (one_query, ck.SCRATCH_BYTES),
                                 (2 * one_query, ck.SCRATCH_BYTES), (3 * one_query + 4, ck.SCRATCH_BYTES)):
        monkeypatch.setattr(ck, "SCORE_BYTES", score_bytes)
        monkeypatch.setattr(ck, "SCRATCH_BYTES", scratch)
        part = {n: v.clone() for n, v in base.items()}
        update_attn_stats_cpu(query, key_cache, bt, lens, qpos, kpos, part, block_n=3)
        for n in STAT_NAMES:
            assert torch.equal(part[n], full[n]), (n, score_bytes, scratch)


def test_only_requested_stats_and_slots_are_written() -> None:
    query, key_cache, bt, lens, qpos, kpos, S = _case(11, 2, 3, 2, 2, 8, 4, False, torch.float32, False)
    got = {"attn_last": torch.full((2, S), 7.0)}
    update_attn_stats_cpu(query, key_cache, bt, lens, qpos, kpos, got)
    inside = torch.zeros(S, dtype=torch.bool)
    for b in range(2):
        for j in range(int(lens[b])):
            inside[int(bt[b, j // 4]) * 4 + j % 4] = True
    assert bool((got["attn_last"][:, ~inside] == 7.0).all())  # slots outside every request untouched
    assert bool((got["attn_last"][:, inside] != 7.0).all())  # overwritten (0 where not attended)


def test_bad_arguments() -> None:
    query, key_cache, bt, lens, qpos, kpos, S = _case(0, 1, 1, 1, 1, 8, 4, False, torch.float32, False)
    stats = {"attn_sum": torch.zeros(1, S)}
    with pytest.raises(ValueError, match="unknown attention statistics"):
        update_attn_stats_cpu(query, key_cache, bt, lens, qpos, kpos, {"key_norm": torch.zeros(1, S)})
    with pytest.raises(ValueError, match="not supported"):
        update_attn_stats_cpu(query, key_cache.to(torch.float16), bt, lens, qpos, kpos, stats)
    with pytest.raises(ValueError, match="does not match"):
        update_attn_stats_cpu(query[..., :4], key_cache, bt, lens, qpos, kpos, stats)
    with pytest.raises(ValueError, match="float32"):
        update_attn_stats_cpu(query, key_cache, bt, lens, qpos, kpos, {"attn_sum": torch.zeros(1, S, dtype=torch.float64)})
    with pytest.raises(ValueError, match="block_n"):
        update_attn_stats_cpu(query, key_cache, bt, lens, qpos, kpos, stats, block_n=0)
    update_attn_stats_cpu(query[:, :0], key_cache, bt, lens, qpos[:, :0], kpos, stats)  # no queries: no-op
    assert not stats["attn_sum"].any()


def test_llvmlite_survives_vllm_rebinding_scan() -> None:
    """vLLM's worker init scans every module attribute (``vllm.triton_utils.dispatcher._rebind_kernels``:
    ``vars(value).get("kernel")`` for values with a ``__dict__``); llvmlite's ``ffi.lib`` used to break it."""
    assert ck.kernels_available()
    ffi = sys.modules["llvmlite.binding.ffi"]

    def scan() -> None:  # the loop of vllm.triton_utils.dispatcher._rebind_kernels, minus the rebinding
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] not in ("numba", "llvmlite"):
                continue
            namespace = getattr(module, "__dict__", None)
            if not namespace:
                continue
            for value in list(namespace.values()):
                if hasattr(value, "__dict__"):
                    vars(value).get("kernel")

    saved = ffi.lib._fntab.pop("__dict__")  # _load() applied the fix
    try:  # without the fix: the crash vLLM hit
        with pytest.raises(AttributeError, match="_lib_fn_wrapper"):
            vars(ffi.lib).get("kernel")
    finally:
        ffi.lib._fntab["__dict__"] = saved
    assert ck.make_llvmlite_scan_safe()
    scan()


def test_lazy_numba_import_and_vllm_kernel_overrides() -> None:
    """In a fresh process: importing the module does not import numba; then the real scan, vLLM's CPU
    platform registering its Triton-kernel overrides (what ``init_worker`` does for every engine) after
    numba was imported, crashes without the fix and passes with it."""
    code = """
import sys, warnings; warnings.simplefilter("ignore")
from vtoken_runtime.stats import cpu_kernel
assert "numba" not in sys.modules and "llvmlite" not in sys.modules, "numba imported with the module"
try:
    from vllm.platforms import current_platform
except ImportError:
    print("no vllm"); sys.exit(0)
import numba  # noqa: F401  (nothing jitted: the import alone is enough)
try:
    current_platform.register_triton_kernel_overrides()
    crashed = False
except AttributeError as e:
    crashed = "_lib_fn_wrapper" in str(e)
assert cpu_kernel.make_llvmlite_scan_safe()
current_platform.register_triton_kernel_overrides()
current_platform.register_triton_kernel_overrides()
print("crashed without the fix:", crashed)
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=300, capture_output=True, text=True)
    assert "crashed without the fix:" in out.stdout or "no vllm" in out.stdout


def test_kernel_cache_is_dropped_when_any_of_its_files_changes(tmp_path: Path) -> None:
    """numba checks a cached function against its own file only, and the kernel's compiled driver holds the code
    of its callees in other files (passes, gathers, numerics): ``drop_stale_cache`` removes the cache files of all
    of them when any one changed (an edited pass must not run its old code), keeps them otherwise, and leaves
    other modules' files and Python's own ``.pyc`` alone."""
    from vtoken_runtime._numba_compat import drop_stale_cache
    from vtoken_runtime.stats import cpu_driver

    src = tmp_path / "src"
    cache = tmp_path / "__pycache__"
    src.mkdir()
    cache.mkdir()
    files = [src / "cpu_passes.py", src / "cpu_driver.py"]
    for f in files:
        f.write_text(f"# {f.name}\n")
    cached = ["cpu_passes._py_pass1-10.py312.nbi", "cpu_passes._py_pass1-10.py312.0.nbc",
              "cpu_driver._py_kernel-5.py312.nbi", "cpu_driver._py_kernel-5.py312.1.nbc"]
    other = ["cpu_passes.cpython-312.pyc", "copy_kernels._run-3.py312.nbi"]

    def fill() -> None:
        for name in (*cached, *other):
            (cache / name).write_bytes(b"x")

    fill()
    assert drop_stale_cache(cache, files, "k")  # no record yet: whatever is there may be stale
    assert sorted(p.name for p in cache.iterdir()) == sorted([*other, "k.sources"])
    fill()
    assert not drop_stale_cache(cache, files, "k")  # same sources: the cache is kept
    assert all((cache / n).exists() for n in cached)
    files[0].write_text("# cpu_passes.py, a pass edited\n")  # a callee's file changed, not the caller's
    assert drop_stale_cache(cache, files, "k")
    assert not any((cache / n).exists() for n in cached) and all((cache / n).exists() for n in other)
    assert not drop_stale_cache(None, files, "k")  # not cached: nothing to do
    # the loader covers every module numba compiles into the kernel, and the driver itself
    assert {m.__name__.rsplit(".", 1)[1] for m in cpu_driver.KERNEL_MODULES} == {"cpu_numerics", "cpu_gather",
                                                                                "cpu_passes"}
