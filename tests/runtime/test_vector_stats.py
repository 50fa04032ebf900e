"""Vector statistics in the HF adapter: keys / values read from the paged cache and query summaries from the
query window store, compared with the dense model.

The policy is intercepted by a mask policy that records every batch it is handed (``s.key``, ``s.value``,
``s.query_mean``, ``s.query_mean_future``, ``s.query_cov_future``, positions) and evicts scattered tokens
(different ones per (layer, head) at head granularity), so compaction / ordered repacking moves tokens
between the evictions. The oracle replays the run on HF's eager attention with a dense ``DynamicCache``
restricted to the recorded kept sets (as ``tests/oracles/dense.py``): just before each recorded eviction its
cache holds exactly the live tokens the batch describes, with the keys / values the model computed under the
same evictions; hooks on ``q_proj`` give the pre-RoPE queries of every processed position, from which the
query summaries are computed independently (float64, explicit D x D rotation matrices from ``rope_theta``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

import vtoken_sdk as vt
from tests.oracles.dense import _restrict
from vtoken_bench.models import tiny_llama, tiny_qwen2
from vtoken_runtime.hf_adapter import HFSession
from vtoken_runtime.stats.query_vectors import QueryWindows
from vtoken_runtime.stats.rope import UnsupportedRope, rotary_tables
from vtoken_sdk.selection import select

VECTORS = ("key", "value", "query_mean", "query_mean_future", "query_cov_future")
ATOL, RTOL = 2e-4, 2e-4


def _prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def recording_policy(log: list[dict[str, Any]], granularity: str, obs_window: int, future_window: int,
                     ratio: float = 0.5) -> vt.Policy:
    """A mask policy reading every vector statistic: records its inputs and evicts a scattered set (per row at
    head granularity: the score mixes position, layer and head)."""

    @vt.mask_policy(budget=vt.Budget(ratio=ratio), reads=(*VECTORS, "layer"), protect=[vt.sinks(2)],
                    granularity=granularity,
                    stats=vt.StatsConfig(obs_window=obs_window, future_window=future_window))
    def recorder(s: vt.TokenStats, ctx: vt.MaskContext):
        b, l_, h, n = ctx.shape
        entry = {k: getattr(s, k).clone() for k in VECTORS}
        entry.update(positions=ctx.positions.expand(b, l_, h, n).clone(), lengths=ctx.lengths.clone(),
                     seq_lens=ctx.seq_lens.clone(), layers=s.layer.reshape(-1).to(torch.int64).tolist())
        log.append(entry)
        pos = ctx.positions.expand(b, l_, h, n)
        if granularity == "head":
            layer = s.layer.reshape(1, l_, 1, 1)
            head = torch.arange(h).reshape(1, 1, h, 1)
            score = ((pos * 7 + layer * 13 + head * 5) % 11).to(torch.float32)
        else:
            score = ((pos * 7) % 11).to(torch.float32)
        keep = select(score.reshape(b, l_ * h, n), ctx.lengths, ctx.pins.reshape(b, l_ * h, n), ctx.keep_count)
        return keep.reshape(b, l_, h, n)

    return recorder


# ----------------------------------------------------------------------------------------------- dense oracle
def _rope_matrix(theta: float, D: int, p: np.ndarray) -> np.ndarray:
    """``R(p) [len(p), D, D]`` float64 from the rope base: ``rope(q, p) = R(p) q`` with ``q cos + rotate_half(q)
    sin`` (rotate_half x = cat(-x2, x1)), built as explicit matrices."""
    inv = 1.0 / theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.concatenate([np.outer(p, inv)] * 2, axis=1)  # [P, D]
    J = np.zeros((D, D))
    h = D // 2
    J[np.arange(h), np.arange(h) + h] = -1.0  # (J x)[i] = -x[i + h]
    J[np.arange(h) + h, np.arange(h)] = 1.0  # (J x)[i + h] = x[i]
    return np.cos(ang)[:, :, None] * np.eye(D)[None] + np.sin(ang)[:, :, None] * J[None]


class Snapshot:
    """The dense model's state just before one eviction: live positions, keys / values per layer, and the
    pre-RoPE queries of every position processed so far."""

    def __init__(self, n: int, cur: list[np.ndarray], keys: list[torch.Tensor], values: list[torch.Tensor],
                 qpre: list[np.ndarray]) -> None:
        self.n, self.cur, self.keys, self.values, self.qpre = n, cur, keys, values, qpre


@torch.inference_mode()
def dense_replay(model: Any, prompt: Sequence[int], generated: Sequence[int],
                 keep_log: Sequence[tuple[int, np.ndarray]]) -> list[Snapshot]:
    """Feed ``prompt`` then ``generated[:-1]`` through HF eager attention with a dense cache restricted to each
    recorded kept set; a :class:`Snapshot` just before each restriction."""
    from transformers import DynamicCache

    cfg = model.config
    L, H = cfg.num_hidden_layers, cfg.num_key_value_heads
    Hq = cfg.num_attention_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // Hq
    keeps = dict(keep_log)
    qpre: list[list[np.ndarray]] = [[] for _ in range(L)]
    hooks = [layer.self_attn.q_proj.register_forward_hook(
        lambda mod, inp, out, li=li: qpre[li].append(out[0].double().reshape(-1, Hq, D).numpy()))
        for li, layer in enumerate(model.model.layers)]
    old = cfg._attn_implementation
    cfg._attn_implementation = "eager"
    snaps: list[Snapshot] = []
    try:
        cache = DynamicCache(config=cfg)
        cur = [np.tile(np.arange(0), (H, 1)) for _ in range(L)]
        feeds = [(list(prompt), 0)] + [([t], len(prompt) + i) for i, t in enumerate(generated[:-1])]
        for toks, start in feeds:
            end = start + len(toks)
            model(input_ids=torch.tensor([toks]), position_ids=torch.arange(start, end)[None], past_key_values=cache,
                  use_cache=True)
            cur = [np.concatenate([c, np.tile(np.arange(start, end), (H, 1))], axis=1) for c in cur]
            if end in keeps:
                snaps.append(Snapshot(end, [c.copy() for c in cur],
                                      [cache.layers[i].keys[0].clone() for i in range(L)],
                                      [cache.layers[i].values[0].clone() for i in range(L)],
                                      [np.concatenate(q) for q in qpre]))
                _restrict(cache, cur, keeps[end], L, H)
    finally:
        cfg._attn_implementation = old
        for h in hooks:
            h.remove()
    return snaps


def expected_queries(snap: Snapshot, theta: float, num_kv_heads: int, obs_window: int, future_window: int
                     ) -> dict[str, np.ndarray]:
    """The catalog's query summaries from the dense pre-RoPE queries: ``name -> [L, H, ...]`` float64."""
    n = snap.n
    w = min(obs_window, n)
    out: dict[str, list[np.ndarray]] = {k: [] for k in ("query_mean", "query_mean_future", "query_cov_future")}
    for q in snap.qpre:  # [T, Hq, D] per layer
        Hq, D = q.shape[1], q.shape[2]
        G = Hq // num_kv_heads
        p = np.arange(n - w, n)
        qw = q[n - w:n]  # [W, Hq, D]
        R = _rope_matrix(theta, D, p)  # [W, D, D]
        qr = np.einsum("wde,whe->whd", R, qw)
        out["query_mean"].append(qr.reshape(w, num_kv_heads, G, D).mean(axis=(0, 2)))
        Rbar = _rope_matrix(theta, D, np.arange(n, n + future_window)).mean(0)
        mu = qw.mean(0)  # [Hq, D]
        x = qw - mu[None]
        S = np.einsum("whd,whe->hde", x, x) / w
        out["query_mean_future"].append((mu @ Rbar.T).reshape(num_kv_heads, G, D))
        out["query_cov_future"].append((Rbar[None] @ S @ Rbar.T[None]).reshape(num_kv_heads, G, D, D))
    return {k: np.stack(v) for k, v in out.items()}


def _merge_chunks(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per eviction: batches of one eviction evaluated in layer chunks are concatenated along L."""
    out: list[dict[str, Any]] = []
    for e in log:
        if out and e["layers"][0] != 0:
            prev = out[-1]
            assert prev["layers"][-1] + 1 == e["layers"][0] and torch.equal(prev["seq_lens"], e["seq_lens"])
            for k in (*VECTORS, "positions"):
                prev[k] = torch.cat([prev[k], e[k]], dim=1)
            prev["layers"] = prev["layers"] + e["layers"]
        else:
            out.append(dict(e))
    return out


def check_against_dense(model: Any, log: list[dict[str, Any]], rids: list[str], session: HFSession,
                        prompts: list[list[int]], outs: list[list[int]], obs_window: int, future_window: int) -> int:
    """Every recorded batch entry equals the dense replay; returns the number of (request, eviction) pairs."""
    cfg = model.config
    L, H = cfg.num_hidden_layers, cfg.num_key_value_heads
    theta = float(cfg.rope_parameters["rope_theta"])
    batches = _merge_chunks(log)
    checked = 0
    for b_rid, (rid, p, o) in enumerate(zip(rids, prompts, outs, strict=True)):
        keep_log = session.requests[rid].keep_log
        snaps = dense_replay(model, p, o, keep_log)
        assert [s.n for s in snaps] == [n for n, _ in keep_log]
        mine = [(e, i) for e in batches for i in range(len(e["seq_lens"]))
                if int(e["seq_lens"][i]) in {s.n for s in snaps}]
        for snap in snaps:
            # the batch holding this request at this length (requests of one session are batched together)
            hits = [(e, i) for e, i in mine if int(e["seq_lens"][i]) == snap.n and
                    len(e["seq_lens"]) == len(rids) and i == b_rid]
            if not hits:  # evicted alone (the other request did not evict at this step)
                hits = [(e, i) for e, i in mine if int(e["seq_lens"][i]) == snap.n and len(e["seq_lens"]) == 1]
            assert hits, f"{rid}: no batch for the eviction at length {snap.n}"
            e, i = hits[-1]
            assert e["layers"] == list(range(L)) or len(e["layers"]) == 1
            n = int(e["lengths"][i])
            want_q = expected_queries(snap, theta, H, obs_window, future_window)
            for li in range(L):
                for h in range(H):
                    pos = e["positions"][i, li, h, :n].numpy()
                    assert np.array_equal(pos, snap.cur[li][h]), f"{rid} n={snap.n} ({li},{h}): live positions"
                    idx = np.searchsorted(snap.cur[li][h], pos)
                    for name, dense in (("key", snap.keys), ("value", snap.values)):
                        got, want = e[name][i, li, h, :n], dense[li][h, idx].to(torch.float32)
                        where = f"{rid} n={snap.n} {name} layer {li} head {h}"
                        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m, w=where: f"{w}: {m}")
            for name, want in want_q.items():
                got = e[name][i].double()
                where = f"{rid} n={snap.n} {name}"
                torch.testing.assert_close(got, torch.from_numpy(want), atol=ATOL, rtol=RTOL,
                                           msg=lambda m, w=where: f"{w}: {m}")
            checked += 1
    return checked


def _run(factory: Callable[..., Any], granularity: str, mode: str, obs_window: int, future_window: int,
         chunk_bytes: int | None = None, lengths: tuple[int, ...] = (90, 71), steps: int = 9
         ) -> tuple[Any, HFSession, list[dict[str, Any]], list[str], list[list[int]], list[list[int]]]:
    model = factory()
    log: list[dict[str, Any]] = []
    pol = recording_policy(log, granularity, obs_window, future_window)
    s = HFSession(model, block_size=8, num_blocks=128, mode=mode, granularity=granularity, chunk_size=32,
                  record_keeps=True, debug=True)
    if chunk_bytes is not None:
        s.driver.vector_chunk_bytes = chunk_bytes
    rids = [f"r{i}" for i in range(len(lengths))]
    prompts = [_prompt(n, seed=3 + i) for i, n in enumerate(lengths)]
    for r in rids:
        s.add(r, pol)
    outs = s.generate(rids, prompts, steps)
    for r in rids:
        assert not s.requests[r].failures, s.requests[r].failures
        assert len(s.requests[r].keep_log) >= 4
    return model, s, log, rids, prompts, outs


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
@pytest.mark.parametrize(("granularity", "mode"), [("head", "compact"), ("head", "ordered"), ("request", "compact"),
                                                   ("request", "ordered")])
def test_vectors_equal_the_dense_model_after_evictions_and_reclaims(factory, granularity: str, mode: str) -> None:
    """Two batched requests, chunked prefill (32), eviction after prefill and every other decode step:
    keys / values of every live token and the query summaries (window 6 < prompt, sliding over generated
    tokens; future window 37) equal the dense model's."""
    obs, fut = 6, 37
    model, s, log, rids, prompts, outs = _run(factory, granularity, mode, obs, fut)
    assert s.cache.tokens_moved_total > 0, "no token moved: the reclaim path is not exercised"
    assert check_against_dense(model, log, rids, s, prompts, outs, obs, fut) >= 8


def test_query_window_spanning_prefill_chunks_and_layer_chunks() -> None:
    """Window 40 > the last prefill chunk (26 tokens): it spans chunks. ``vector_chunk_bytes=1`` evaluates the
    policy one layer at a time (``layer_offset``): the same values, layer by layer."""
    obs, fut = 40, 512
    model, s, log, rids, prompts, outs = _run(tiny_llama, "head", "compact", obs, fut, chunk_bytes=1)
    assert all(len(e["layers"]) == 1 for e in log) and {e["layers"][0] for e in log} == {0, 1}
    assert check_against_dense(model, log, rids, s, prompts, outs, obs, fut) >= 8


def test_layer_chunks_make_the_same_decisions() -> None:
    runs = [_run(tiny_qwen2, "head", "compact", 6, 37, chunk_bytes=cb)[1] for cb in (None, 1)]
    for r in ("r0", "r1"):
        a, b = (x.requests[r].keep_log for x in runs)
        assert len(a) == len(b) and all(n1 == n2 and np.array_equal(k1, k2) for (n1, k1), (n2, k2) in zip(a, b, strict=True))


def test_bf16_keys_and_values_are_the_cached_values_upcast() -> None:
    """A bf16 model: the vectors handed to the policy are the cached bf16 K/V upcast exactly (read through the
    token table after compaction)."""
    model = tiny_llama(dtype=torch.bfloat16)
    log: list[dict[str, Any]] = []
    pol = recording_policy(log, "head", 6, 37)
    s = HFSession(model, block_size=8, num_blocks=64, chunk_size=32)
    s.add("a", pol)
    s.generate(["a"], [_prompt(60)], 6)
    e = log[-1]
    n = int(e["lengths"][0])
    for layer in range(model.config.num_hidden_layers):
        pos, k, v = s.cache.gather_kv(layer, "a")
        assert k.dtype == torch.bfloat16
        # the cache has evicted again since: compare the positions still live in both
        for h in range(k.shape[0]):
            bp = e["positions"][0, layer, h, :n].numpy()
            common, ia, ib = np.intersect1d(pos[h].numpy(), bp, return_indices=True)
            assert common.size > 10
            assert torch.equal(e["key"][0, layer, h, ib], k[h, ia].to(torch.float32))
            assert torch.equal(e["value"][0, layer, h, ib], v[h, ia].to(torch.float32))


# ---------------------------------------------------------------------------------------- shipped-style policies
@pytest.mark.parametrize("name", ["keydiff", "query_dot", "expected_attention"])
def test_fork_after_a_shared_prefill_records_the_queries(name: str) -> None:
    """A policy-free prefill forked into a query-reading policy (claimed up front): the fork's summaries equal
    those of the same request prefilled directly with the policy."""
    from tests.sdk.dsl_policies import POLICIES

    pol = POLICIES[name].configure(protect=[vt.sinks(2)], stats=vt.StatsConfig(obs_window=8))
    model = tiny_llama()
    ids = _prompt(70)
    shared = HFSession(model, block_size=8, num_blocks=96, chunk_size=32, policies=[pol], record_keeps=True)
    shared.add("src", None)
    shared.prefill(["src"], [ids], evict=False)
    shared.fork("src", "dst", pol)
    shared.evict(["dst"], "prefill")
    direct = HFSession(model, block_size=8, num_blocks=96, chunk_size=32, record_keeps=True)
    direct.add("a", pol)
    direct.prefill(["a"], [ids])
    ka, kb = shared.requests["dst"].keep_log, direct.requests["a"].keep_log
    assert len(ka) == len(kb) == 1 and np.array_equal(ka[0][1], kb[0][1])


def test_policy_reading_queries_after_the_first_forward_is_refused() -> None:
    from tests.sdk.dsl_policies import POLICIES

    s = HFSession(tiny_llama(), block_size=8, num_blocks=32, chunk_size=32)
    s.add("a", None)
    s.prefill(["a"], [_prompt(20)])
    with pytest.raises(ValueError, match="obs_window"):
        s.add("b", POLICIES["query_dot"])
    s.add("c", POLICIES["keydiff"])  # keys and values come from the cache: always available


# ---------------------------------------------------------------------------------------------- rotary tables
def _rope_configs() -> list[Any]:
    from transformers import LlamaConfig

    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=4096)
    return [
        tiny_llama().config, tiny_qwen2().config,
        LlamaConfig(**base, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
        LlamaConfig(**base, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 512}),
        LlamaConfig(**base, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                             "original_max_position_embeddings": 1024}),
    ]


@pytest.mark.parametrize("i", range(5), ids=["llama", "qwen2", "linear", "llama3", "yarn"])
def test_rotary_tables_match_the_models_rotary_embedding(i: int) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = _rope_configs()[i]
    t = rotary_tables(cfg)
    emb = LlamaRotaryEmbedding(cfg)
    pos = torch.tensor([[0, 1, 5, 77, 300, 2047, 4000]])
    cos, sin = emb(torch.zeros(1, dtype=torch.float32), pos)
    c, s = t.cos_sin(pos)
    torch.testing.assert_close(c * t.attention_scaling, cos, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s * t.attention_scaling, sin, atol=1e-6, rtol=1e-6)
    assert (t.attention_scaling != 1.0) == (cfg.rope_parameters["rope_type"] == "yarn")
    q = torch.randn(1, 1, pos.shape[1], t.head_dim)
    rq, _ = apply_rotary_pos_emb(q, q, cos, sin)
    torch.testing.assert_close(t.rotate(rq[0, 0], c[0], s[0], inverse=True), q[0, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(t.rotate(q[0, 0], c[0], s[0]), rq[0, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("params", "match"), [
    ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, "sequence length"),
    ({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, "partial"),
    ({"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}, "mrope"),
])
def test_unsupported_rope_is_refused_when_a_policy_reads_future_queries(params: dict, match: str) -> None:
    from tests.sdk.dsl_policies import POLICIES

    model = tiny_llama()
    model.config.rope_parameters = params
    with pytest.raises(UnsupportedRope, match=match):
        rotary_tables(model.config)
    s = HFSession(model, block_size=8, num_blocks=16)
    with pytest.raises(ValueError, match=match):
        s.add("a", POLICIES["expected_attention"])
    s.add("b", POLICIES["query_dot"])  # post-RoPE mean: no rotation needed


# ---------------------------------------------------------------------------------------- the store on its own
def test_query_window_ring_buffer_keeps_the_latest_queries() -> None:
    """Chunks longer than the window, several requests, removal and reuse of rows, incomplete windows."""
    L, Hq, H, D, W = 2, 4, 2, 6, 5
    st = QueryWindows(L, Hq, H, D, W)
    q_of = lambda r, p: torch.full((Hq, D), float(r * 1000 + p)) + torch.arange(Hq)[:, None] * 0.5  # noqa: E731
    lens = {"a": 0, "b": 0}
    for chunk in ([("a", 12), ("b", 3)], [("a", 1), ("b", 1)], [("b", 7)], [("a", 2), ("b", 1)]):
        rids = [r for r, _ in chunk]
        Q = max(n for _, n in chunk)
        tok = np.full((len(chunk), Q), -1)
        qpos = np.full((len(chunk), Q), -1)
        flat = []
        for b, (r, n) in enumerate(chunk):
            tok[b, :n] = np.arange(len(flat), len(flat) + n)
            qpos[b, :n] = np.arange(lens[r], lens[r] + n)
            flat += [q_of(int(r == "b"), p) for p in range(lens[r], lens[r] + n)]
            lens[r] += n
        idx = st.plan(rids, tok, qpos)
        for layer in range(L):
            st.write(layer, torch.stack(flat) * (layer + 1), idx)
        for r in ("a", "b"):
            n = lens[r]
            for w in (1, 3, W):
                got = st.summaries([r], {"query_mean"}, [n], w, 8)["query_mean"][0]  # [L, H, D]
                ww = min(w, n)
                want = torch.stack([q_of(int(r == "b"), p) for p in range(n - ww, n)]).mean(0)  # [Hq, D]
                want = want.view(H, Hq // H, D).mean(1)
                for layer in range(L):
                    torch.testing.assert_close(got[layer], want * (layer + 1))
    assert st.problems(["a"], [lens["a"] + 1], 3)  # a position that was never recorded
    assert st.problems(["a"], [lens["a"]], W + 1)  # more than the store keeps
    assert st.problems(["zz"], [3], 2)
    st.remove("a")
    st.remove("b")
    assert st.capacity == 0
