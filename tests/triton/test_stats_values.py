"""The Triton attention-statistics kernel (``update_attn_stats``, TRITON_INTERPRET=1) against the
independent dense reference in ``tests/oracles/stats_reference.py`` (the catalog's rules), not
against ``attn_stats_ref`` / ``vtoken_runtime.stats``.

Two requests of different lengths share a paged cache (blocks in a shuffled order); each runs a long
prefill chunk (keys spanning two ``block_n`` tiles), a second chunk (request 0: the prompt's
observation window spans both chunks; request 1: the chunk is longer than the window) and two decode
tokens, batched together with padding. After every step attn_sum, attn_last, attn_window and
low_attn_count of every (request, KV head, position) are compared, for plain multi-head attention and
for GQA (3 query heads per KV head).

Tolerance: atol 1e-5 + rtol 1e-4; low_attn_count may additionally differ by the weight of (query,
key) pairs whose attention lies within 1e-5 (relative) of the threshold (float32 rounding).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.oracles.stats_reference import ATTENTION_STATS, RefParams, dense_probs, mismatches, reference_stats

pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

OBS, HIST, THR = 4, 5, 1.0
CHUNKS = {0: [26, 3, 1, 1], 1: [12, 5, 1, 1]}  # tokens per step of each request (same number of steps)
PROMPT = {0: 29, 1: 17}  # the first two steps are the prompt


def _run(G: int, Hkv: int, D: int, bs: int, scale: float, seed: int) -> None:
    from vtoken_runtime.kernels.attn_stats_triton import update_attn_stats

    B = len(CHUNKS)
    assert all(sum(CHUNKS[b][:2]) == PROMPT[b] for b in range(B))
    n_steps = len(CHUNKS[0])
    total = [sum(c) for c in CHUNKS.values()]
    g = torch.Generator().manual_seed(seed)
    q_all = [torch.randn(G * Hkv, T, D, generator=g) * 2 for T in total]  # [H_q, T, D], index = position
    k_all = [torch.randn(Hkv, T, D, generator=g) for T in total]  # [H_kv, T, D]
    max_blocks = -(-max(total) // bs)
    NB = B * max_blocks + 3
    rng = np.random.default_rng(seed)
    bt = torch.as_tensor(rng.permutation(NB)[: B * max_blocks].reshape(B, max_blocks), dtype=torch.int32)
    key_cache = torch.zeros(NB, bs, Hkv, D)
    kpos = torch.full((1, NB * bs), -1, dtype=torch.int64)
    stats = {n: torch.zeros(Hkv, NB * bs) for n in ATTENTION_STATS}

    def slot(b: int, p: int) -> int:
        return int(bt[b, p // bs]) * bs + p % bs

    done = [0] * B
    steps: list[list[list[int]]] = [[] for _ in range(B)]
    got: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(B)]
    for k in range(n_steps):
        Q = max(CHUNKS[b][k] for b in range(B))
        query = torch.zeros(B, Q, G * Hkv, D)
        qpos = torch.full((B, Q), -1, dtype=torch.int64)
        for b in range(B):
            pos = list(range(done[b], done[b] + CHUNKS[b][k]))
            for i, p in enumerate(pos):
                s = slot(b, p)
                key_cache[s // bs, s % bs] = k_all[b][:, p]
                kpos[0, s] = p
                query[b, i] = q_all[b][:, p]
                qpos[b, i] = p
            steps[b].append(pos)
            done[b] += len(pos)
        lens = torch.as_tensor(done, dtype=torch.int32)
        update_attn_stats(query, key_cache, bt, lens, qpos, kpos, stats, scale=scale, obs_window=OBS,
                          history_window=HIST, low_attn_threshold=THR,
                          prompt_lens=torch.as_tensor([PROMPT[b] for b in range(B)]), block_n=16)
        for b in range(B):
            slots = torch.as_tensor([slot(b, p) for p in range(done[b])])
            got[b].append({n: t[:, slots][None] for n, t in stats.items()})  # [1, H_kv, n]

    params = RefParams(obs_window=OBS, history_window=HIST, low_attn_threshold=THR)
    for b in range(B):
        snaps = reference_stats([dense_probs(q_all[b], k_all[b], scale)], steps[b], G, params, PROMPT[b])
        for k, (g_k, want) in enumerate(zip(got[b], snaps, strict=True)):
            bad = mismatches(g_k, want, atol=1e-5, rtol=1e-4)
            assert not bad, f"request {b}, step {k}:\n" + "\n".join(bad)
        low = snaps[-1].values["low_attn_count"]
        assert float(low.max()) > 1.0 and float(low.max() - low.min()) > 0.5, "low_attn_count is trivial"
        assert not torch.allclose(snaps[1].values["attn_window"], snaps[1].values["attn_last"])
        assert bool((snaps[0].values["attn_window"] > 0).any()) == (b == 0)  # window spans chunks of request 0
        # key 0 always ties with query 0 (P = G = the threshold exactly); other ties must be rare
        assert float((snaps[-1].low_attn_slack[..., 1:] > 0).double().mean()) < 0.02


@pytest.mark.parametrize(("G", "Hkv"), [(1, 4), (3, 2)], ids=["mha", "gqa3"])
def test_triton_kernel_matches_dense_reference_every_step(G: int, Hkv: int) -> None:
    _run(G, Hkv, D=16, bs=4, scale=0.3, seed=G)
